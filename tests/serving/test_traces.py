"""Traces against the real daemon: Triton's trace extension (settings round-tripped by an
unmodified tritonclient over HTTP and gRPC, the trace file in Triton's format) and the
OpenTelemetry mode, whose spans a test OTLP/HTTP receiver collects and decodes with
OpenTelemetry's own protobuf definitions."""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from tests.support.daemon_harness import (
    OUT,
    Daemon,
    cls_input,
    cls_table,
    grpc_port,
    write_config,
)

pytestmark = pytest.mark.integration

TRITON_ORDER = [
    "HTTP_RECV_START",
    "HTTP_RECV_END",
    "REQUEST_START",
    "QUEUE_START",
    "COMPUTE_START",
    "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START",
    "COMPUTE_END",
    "REQUEST_END",
    "HTTP_SEND_START",
    "HTTP_SEND_END",
]
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-00"  # the caller did not sample it: traced anyway


def infer_http(daemon: Daemon, headers: dict[str, str] | None = None):
    client = th.InferenceServerClient(daemon.address)
    x = cls_input()
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer("cls", [inp], headers=headers)
    client.close()
    return result.as_numpy(OUT)


def infer_grpc(daemon: Daemon, headers: dict[str, str] | None = None):
    client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port(daemon)}")
    x = cls_input()
    inp = tg.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("cls", [inp], headers=headers)
    client.close()
    return result.as_numpy(OUT)


@pytest.fixture(scope="module")
def triton_mode(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("traces")
    trace = (
        f'\n[trace]\nlevel = ["TIMESTAMPS"]\nrate = 1\nlog_frequency = 2\n'
        f'file = "{folder / "trace.json"}"\n'
    )
    daemon = Daemon(write_config(folder, cls_table(models_dir) + trace, "tcp_control = true"))
    yield daemon.wait_ready()
    assert daemon.stop() == 0, daemon.log_text()


def test_the_trace_file_is_tritons_format(triton_mode: Daemon) -> None:
    """log_frequency 2: every second trace the collected ones go to trace.json.<n>, each
    trace an entry naming the model and one entry per timestamp, in Triton's names and
    order (steady-clock ns)."""
    folder = triton_mode.config.parent
    before = sorted(folder.glob("trace.json.*"))
    infer_http(triton_mode)
    infer_http(triton_mode, {"traceparent": TRACEPARENT})
    deadline = time.monotonic() + 10
    while len(sorted(folder.glob("trace.json.*"))) == len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    new = sorted(set(folder.glob("trace.json.*")) - set(before))
    assert new, triton_mode.log_text()
    entries = json.loads(new[-1].read_text())
    heads = [e for e in entries if "model_name" in e]
    assert len(heads) == 2 and {h["model_name"] for h in heads} == {"cls"}
    assert heads[0]["model_version"] == 1 and heads[0]["id"] < heads[1]["id"]
    assert heads[1]["traceparent"] == TRACEPARENT
    for head in heads:
        stamps = [
            e["timestamps"][0] for e in entries if e["id"] == head["id"] and "timestamps" in e
        ]
        assert [s["name"] for s in stamps] == TRITON_ORDER
        ns = [s["ns"] for s in stamps]
        assert ns == sorted(ns) and ns[-1] - ns[0] < 10e9  # monotonic, one request's time


def test_settings_round_trip_over_http(triton_mode: Daemon) -> None:
    client = th.InferenceServerClient(triton_mode.address)
    assert "trace" in client.get_server_metadata()["extensions"]
    settings = client.get_trace_settings()
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "1"
    assert settings["trace_mode"] == "triton" and settings["trace_file"].endswith("trace.json")
    # A model's own setting, then cleared back to the global one.
    own = client.update_trace_settings("cls", {"trace_rate": "7", "trace_level": ["OFF"]})
    assert own["trace_rate"] == "7" and own["trace_level"] == ["OFF"]
    assert client.get_trace_settings()["trace_rate"] == "1"  # the global one is unchanged
    cleared = client.update_trace_settings("cls", {"trace_rate": None, "trace_level": None})
    assert cleared["trace_rate"] == "1" and cleared["trace_level"] == ["TIMESTAMPS"]
    bad = {
        "trace_file": "/etc/passwd",
        "trace_rate": "fast",
        "trace_level": ["LOUD"],
        "trace_count": "-2",
        "nonsense": "1",
    }
    for key, value in bad.items():
        with pytest.raises(InferenceServerException) as err:
            client.update_trace_settings(settings={key: value})
        assert key in str(err.value) or "can not be updated" in str(err.value), key
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_trace_settings("nope")
    assert client.get_trace_settings() == settings  # no refused change changed anything
    client.close()


def test_settings_round_trip_over_grpc(triton_mode: Daemon) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port(triton_mode)}")
    settings = client.get_trace_settings(as_json=True)["settings"]
    assert settings["trace_level"]["value"] == ["TIMESTAMPS"]
    answer = client.update_trace_settings("cls", {"trace_count": "3"}, as_json=True)
    assert answer["settings"]["trace_count"]["value"] == ["3"]
    answer = client.update_trace_settings("cls", {"trace_count": None}, as_json=True)
    assert answer["settings"]["trace_count"]["value"] == ["-1"]
    with pytest.raises(InferenceServerException, match="trace_level"):
        client.update_trace_settings(settings={"trace_level": ["OFF", "TIMESTAMPS"]})
    client.close()


def test_trace_count_stops_tracing(models_dir: Path, tmp_path: Path) -> None:
    """count 1: one trace, written at once to trace.json.0; then nothing more is traced,
    and the settings say count 0."""
    trace = '\n[trace]\nlevel = ["TIMESTAMPS", "TENSORS"]\nrate = 1\ncount = 1\n'
    daemon = Daemon(write_config(tmp_path, cls_table(models_dir) + trace)).wait_ready()
    try:
        infer_grpc(daemon)
        infer_http(daemon)
        first = tmp_path / "state" / "trace.json.0"
        deadline = time.monotonic() + 10
        while not first.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        entries = json.loads(first.read_text())
        names = [e["timestamps"][0]["name"] for e in entries if "timestamps" in e]
        assert names[0] == "GRPC_WAITREAD_START" and names[-1] == "GRPC_SEND_END"
        tensors = [e for e in entries if "activity" in e]
        assert [t["activity"] for t in tensors] == ["TENSOR_QUEUE_INPUT", "TENSOR_BACKEND_OUTPUT"]
        assert (
            tensors[0]["tensor"]["shape"] == "1,3,48,192"
            and tensors[0]["tensor"]["dtype"] == "FP32"
        )
        assert len(tensors[1]["tensor"]["data"].split(",")) == 2
        client = th.InferenceServerClient(daemon.address)
        assert client.get_trace_settings()["trace_count"] == "0"
        # No tcp_control: reading is open, a change is for the Unix sockets.
        with pytest.raises(InferenceServerException, match="tcp_control"):
            client.update_trace_settings(settings={"trace_count": "5"})
        assert client.get_trace_settings()["trace_count"] == "0"
    finally:
        assert daemon.stop() == 0, daemon.log_text()
    assert not (tmp_path / "state" / "trace.json").exists()  # nothing was left to write


# -- OpenTelemetry ------------------------------------------------------------------------------


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on a free loopback port: keeps every span it is sent
    (protobuf, decoded with opentelemetry-proto's ExportTraceServiceRequest)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        spans = self.spans = []
        resources = self.resources = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        resources.append(attrs)
                        spans.extend(ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, count: int, timeout: float = 20.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.spans if s.trace_id.hex() == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        return [s for s in self.spans if s.trace_id.hex() == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def otel_daemon(models_dir: Path, folder: Path, url: str) -> Daemon:
    trace = (
        f'\n[trace]\nmode = "opentelemetry"\nlevel = ["TIMESTAMPS"]\nrate = 1000\n'
        f'url = "{url}"\nresource = {{ "deployment.environment" = "test" }}\n'
        f'\n[telemetry.mqtt]\nurl = "mqtt://127.0.0.1:1"\ndevice_id = "cam-7"\ngroup = "lab"\n'
    )
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the batch span processor sends at once
    return Daemon(write_config(folder, cls_table(models_dir) + trace), env=env).wait_ready()


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_traceparent_continues_the_callers_trace(
    models_dir: Path, tmp_path: Path, transport
) -> None:
    """rate 1000, so only the request carrying the caller's context is traced: its spans
    arrive as one trace under the caller's span, with edged's steps and the batch's
    attributes, and the device's telemetry id as resource attributes."""
    receiver = OtlpReceiver()
    daemon = otel_daemon(models_dir, tmp_path, receiver.url)
    try:
        infer = infer_http if transport == "http" else infer_grpc
        infer(daemon)  # not sampled (1 in 1000), no traceparent
        infer(daemon, {"traceparent": TRACEPARENT})
        spans = receiver.trace(PARENT_TRACE, 6)
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        receiver.close()
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted(
        ["InferRequest", "cls", "decode", "queue", "compute", "encode"]
    )
    assert len(receiver.spans) == 6  # the unsampled request sent nothing
    top = by_name["InferRequest"]
    assert top.parent_span_id.hex() == PARENT_SPAN
    assert by_name["cls"].parent_span_id == top.span_id
    for step in ("decode", "queue", "compute", "encode"):
        assert by_name[step].parent_span_id == by_name["cls"].span_id
    compute = {a.key: a.value for a in by_name["compute"].attributes}
    assert compute["edged.batch.requests"].int_value == 1
    assert compute["edged.backend"].string_value and compute["edged.variant"].string_value
    events = [e.name for e in top.events]
    first = "HTTP_RECV_START" if transport == "http" else "GRPC_WAITREAD_START"
    assert events[0] == first and "COMPUTE_START" in events and "QUEUE_START" in events
    ordered = [by_name[n] for n in ("decode", "queue", "compute", "encode")]
    assert all(
        a.end_time_unix_nano <= b.start_time_unix_nano + 1000
        for a, b in itertools.pairwise(ordered)
    )
    assert abs(top.start_time_unix_nano / 1e9 - time.time()) < 120  # wall clock, not steady
    resource = receiver.resources[0]
    assert resource["service.name"] == "edged" and resource["service.instance.id"] == "cam-7"
    assert resource["edged.group"] == "lab" and resource["deployment.environment"] == "test"


def test_no_collector_breaks_nothing(models_dir: Path, tmp_path: Path) -> None:
    """The collector's port refuses: requests are answered as ever, the daemon stops cleanly
    and in time."""
    from tests.support.broker import free_port

    daemon = otel_daemon(models_dir, tmp_path, f"http://127.0.0.1:{free_port()}/v1/traces")
    try:
        for _ in range(3):
            assert infer_http(daemon, {"traceparent": TRACEPARENT}).shape == (1, 2)
    finally:
        start = time.monotonic()
        assert daemon.stop() == 0, daemon.log_text()
    assert time.monotonic() - start < 20
