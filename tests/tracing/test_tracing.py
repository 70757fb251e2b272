"""The tracing package without a daemon: the caller's traceparent, the settings' checks and
scopes, sampling (rate, count, a traceparent always traced, OFF never), the trace file's
indexed writes, and [trace] errors naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backends.base import Candidate
from edged.config import ConfigError, parse_config
from edged.tracing.context import parse_traceparent
from edged.tracing.settings import TraceConfig, TraceSetting, TraceSettingError, updated
from edged.tracing.tracer import Tracer

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_traceparent() -> None:
    parent = parse_traceparent(GOOD.encode())
    assert parent is not None and parent.flags == 1 and parent.header == GOOD
    assert parse_traceparent(" " + GOOD + " ") == parent
    assert parse_traceparent("01-" + GOOD[3:] + "-later") is not None  # a later version's extra
    for bad in (
        None,
        "",
        GOOD.upper(),  # upper-case hex is invalid
        GOOD[:-1],
        "ff" + GOOD[2:],
        GOOD + "-more",  # version 00 has exactly four fields
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    ):
        assert parse_traceparent(bad) is None, bad


def test_updates_check_every_value_and_clear_to_the_fallback() -> None:
    base = TraceSetting(("TIMESTAMPS",), 10, -1, 0)
    own = updated(base, {"trace_rate": "3", "trace_level": ["TENSORS", "TIMESTAMPS"]}, base)
    assert own == TraceSetting(("TIMESTAMPS", "TENSORS"), 3, -1, 0)
    assert updated(own, {"trace_rate": None}, base).rate == 10
    assert updated(base, {"trace_level": "OFF"}, base).level == ("OFF",)
    for changes, words in [
        ({"trace_rate": "0"}, "trace_rate"),
        ({"trace_rate": True}, "trace_rate"),
        ({"trace_count": "-2"}, "trace_count"),
        ({"log_frequency": "x"}, "log_frequency"),
        ({"trace_level": []}, "trace_level"),
        ({"trace_level": ["OFF", "TENSORS"]}, "OFF must be given alone"),
        ({"trace_file": "/tmp/x"}, "can not be updated"),
        ({"trace_mode": "opentelemetry"}, "[trace] mode"),
        ({"rate": "1"}, "unknown trace setting"),
    ]:
        with pytest.raises(TraceSettingError, match=words.replace("[", r"\[")):
            updated(base, changes, base)


def tracer(tmp_path: Path, **config) -> Tracer:
    return Tracer(TraceConfig(**config), tmp_path)


def test_sampling_rate_count_and_traceparent(tmp_path: Path) -> None:
    t = tracer(tmp_path, level=("TIMESTAMPS",), rate=3, count=2)
    got = [t.start("m", "HTTP") is not None for _ in range(6)]
    assert got == [False, False, True, False, False, True]
    assert t.setting().count == 0 and not t.any_on  # count used up: nothing more
    assert t.start("m", "HTTP", GOOD) is None

    t = tracer(tmp_path, level=("TIMESTAMPS",), rate=1000)
    traced = t.start("m", "GRPC", GOOD)
    assert traced is not None and traced.parent is not None and traced.transport == "GRPC"
    assert t.start("m", "HTTP", "garbage") is None  # an invalid one is sampled as none

    off = tracer(tmp_path)  # the default: OFF
    assert off.start("m", "HTTP", GOOD) is None and not off.any_on


def test_a_models_own_settings_and_their_clearing(tmp_path: Path) -> None:
    t = tracer(tmp_path)
    answer = t.update("det", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert answer["trace_level"] == ["TIMESTAMPS"] and t.any_on
    assert t.start("det", "HTTP") is not None and t.start("cls", "HTTP") is None
    t.update(None, {"trace_rate": "5"})  # the global changes; det keeps its own rate
    assert t.setting("det").rate == 1 and t.setting("cls").rate == 5
    t.update("det", {"trace_level": None, "trace_rate": None})
    assert t.setting("det") == t.setting() and not t.any_on
    with pytest.raises(TraceSettingError):
        t.update("det", {"trace_level": ["LOUD"], "trace_rate": "2"})
    assert t.setting("det") == t.setting()  # a refused change changes nothing


def finished(t: Tracer, model: str = "m"):
    trace = t.start(model, "HTTP")
    assert trace is not None
    trace.received(1.0, 1.001, "req-1")
    trace.queued(1.002, {"x": np.zeros((1, 2), np.float32)}, {"float32": "FP32"})
    timing = SimpleNamespace(
        compute_start=1.003,
        input_end=1.004,
        output_start=1.005,
        compute_end=1.006,
        batch_size=1,
        samples=1,
        ran=Candidate("onnxruntime", "CPU", "fp32"),
    )
    trace.ran(timing, "m.onnx", {"y": np.ones(2, np.float32)}, {"float32": "FP32"})
    trace.sending(1.007)
    trace.sent(1.008)
    t.finish(trace)
    return trace


def test_the_file_every_n_traces_and_at_close(tmp_path: Path) -> None:
    t = tracer(tmp_path, level=("TIMESTAMPS", "TENSORS"), rate=1, log_frequency=2)
    for _ in range(5):
        finished(t)
    t.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["trace.json.0", "trace.json.1", "trace.json.2"]
    entries = json.loads((tmp_path / "trace.json.0").read_text())
    heads = [e for e in entries if "model_name" in e]
    assert [h["id"] for h in heads] == [1, 2] and heads[0]["request_id"] == "req-1"
    stamps = [e["timestamps"][0] for e in entries if e["id"] == 1 and "timestamps" in e]
    assert stamps[0] == {"name": "HTTP_RECV_START", "ns": 1_000_000_000}
    tensors = [e["tensor"] for e in entries if e["id"] == 1 and "tensor" in e]
    assert tensors == [
        {"name": "x", "data": "0.0,0.0", "shape": "1,2", "dtype": "FP32"},
        {"name": "y", "data": "1.0,1.0", "shape": "2", "dtype": "FP32"},
    ]
    assert len(json.loads((tmp_path / "trace.json.2").read_text())) == 1 + 11 + 2  # the 5th


def test_at_close_with_log_frequency_0_the_file_itself(tmp_path: Path) -> None:
    t = tracer(tmp_path, level=("TIMESTAMPS",), rate=1)
    finished(t)
    finished(t)
    assert not (tmp_path / "trace.json").exists()  # not before shutdown
    t.close()
    assert (
        len([e for e in json.loads((tmp_path / "trace.json").read_text()) if "model_name" in e])
        == 2
    )


def test_an_unwritable_file_loses_traces_not_the_daemon(tmp_path: Path, caplog) -> None:
    t = Tracer(
        TraceConfig(
            level=("TIMESTAMPS",), rate=1, log_frequency=1, file=tmp_path / "no" / "t.json"
        ),
        tmp_path,
    )
    finished(t)
    t.close()
    assert "trace file" in caplog.text and "not written" in caplog.text


def test_opentelemetry_without_the_sdk_sends_nothing(tmp_path: Path, monkeypatch, caplog) -> None:
    from edged.tracing import otel

    monkeypatch.setattr(otel, "available", lambda: False)
    t = tracer(tmp_path, mode="opentelemetry", level=("TIMESTAMPS",), rate=1)
    finished(t)
    finished(t)
    t.close()
    assert caplog.text.count("no spans are sent") == 1 and "edged[otel]" in caplog.text


@pytest.mark.parametrize(
    ("table", "key", "words"),
    [
        ('mode = "zipkin"', "trace.mode", "expected one of triton, opentelemetry"),
        ('level = ["LOUD"]', "trace.level", "unknown level"),
        ("rate = 0", "trace.rate", ""),
        ("count = -2", "trace.count", ""),
        ('url = "localhost:4318"', "trace.url", "OTLP/HTTP URL"),
        ('file = "/nonexistent/t.json"', "trace.file", "no such folder"),
        ("resource = { a = 1 }", "trace.resource", "table of strings"),
        ("sample = 1", "trace", "sample"),
    ],
)
def test_trace_table_errors_name_the_key(tmp_path: Path, table: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(f"[trace]\n{table}\n", tmp_path / "edged.toml")
    assert key in str(err.value) and words in str(err.value)


def test_trace_table_read(tmp_path: Path) -> None:
    config = parse_config(
        '[trace]\nmode = "opentelemetry"\nlevel = ["TENSORS", "TIMESTAMPS"]\nrate = 2\n'
        'url = "http://10.0.0.2:4318/v1/traces"\nresource = { b = "2", a = "1" }\n',
        tmp_path / "edged.toml",
    ).trace
    assert config.level == ("TIMESTAMPS", "TENSORS") and config.rate == 2
    assert config.resource == (("a", "1"), ("b", "2"))


def test_traces_held_for_the_file_are_bounded(tmp_path: Path, monkeypatch, caplog) -> None:
    from edged.tracing import trace_file

    monkeypatch.setattr(trace_file, "MAX_PENDING", 3)
    t = tracer(tmp_path, level=("TIMESTAMPS",), rate=1)  # log_frequency 0: only at shutdown
    for _ in range(7):
        finished(t)
    t.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["trace.json.0", "trace.json.1", "trace.json.2"]  # 3, 3, and 1 at close
    assert caplog.text.count("written to indexed files from now on") == 1
