"""Structured logs: the daemon's decisions as events with fields, in JSON lines and in the
journal. The journal test receives what the daemon sends on a socket of its own (never the
machine's journald), writes it into a real journal file with systemd-journal-remote and
filters it with journalctl, as an operator would (`journalctl MODEL=cls`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from edged import logs
from scripts.fetch_test_data import tools_dir
from tests.support.daemon_harness import Daemon, cls_input, cls_table, write_config
from tests.support.journal import JournalSocket

TOOLS = tools_dir()
JOURNAL_REMOTE = TOOLS / "journal-remote" / "systemd-journal-remote"


def test_fields_and_a_record_too_large_for_a_datagram(tmp_path: Path) -> None:
    journal = JournalSocket(tmp_path / "journal.sock")
    handler = logs.JournalHandler(str(journal.path))
    logger = logging.getLogger("edged.test-journal")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        logs.event(logger, "failover", "two\nlines", model="det", backend="rknn:NPU", ignored=None)
        logger.warning("big %s", "x" * 2**21)  # 2 MiB: over any datagram limit
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("it failed")
        deadline = time.monotonic() + 10
        while len(journal.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        logger.removeHandler(handler)
        handler.close()
        journal.close()
    first, big, failed = journal.records
    assert first["MESSAGE"] == b"two\nlines" and first["EVENT"] == b"failover"
    assert first["MODEL"] == b"det" and first["BACKEND"] == b"rknn:NPU" and "IGNORED" not in first
    assert first["PRIORITY"] == b"6" and first["SYSLOG_IDENTIFIER"] == b"edged"
    assert first["CODE_FILE"].endswith(b"test_logs.py") and first["LOGGER"] == b"edged.test-journal"
    assert len(big["MESSAGE"]) == 4 + 2**21 and big["PRIORITY"] == b"4"  # all of it, via memfd
    assert b"ValueError: boom" in failed["MESSAGE"] and failed["PRIORITY"] == b"3"
    assert logs.journal_field("trace-id") == "TRACE_ID" and logs.journal_field("_x") == "X"
    assert logs.journal_field("9lives") == "X9LIVES"


def test_json_lines_and_the_formats(tmp_path: Path, capsys) -> None:
    record = logging.LogRecord("edged", logging.INFO, __file__, 1, "a %s", ("b",), None)
    setattr(record, logs.FIELDS, {"event": "reload", "models": ["cls"]})
    doc = json.loads(logs.JsonFormatter().format(record))
    assert doc["message"] == "a b" and doc["event"] == "reload" and doc["models"] == ["cls"]
    assert doc["level"] == "info" and doc["ts"].endswith("Z")
    assert logs.setup("info", "auto") == "text"  # stderr is not the journal here
    os.environ["EDGED_JOURNAL_SOCKET"] = str(tmp_path / "absent.sock")
    try:
        with pytest.raises(OSError, match="no journald socket"):
            logs.setup("info", "journal")
    finally:
        del os.environ["EDGED_JOURNAL_SOCKET"]
        logs.setup("warning", "text")


def test_throttle() -> None:
    throttle = logs.Throttle(0.2)
    assert throttle.due("a") == 1
    assert [throttle.due("a") for _ in range(3)] == [None, None, None]
    assert throttle.due("b") == 1
    time.sleep(0.25)
    assert throttle.due("a") == 4  # the three held back and this one


def unrunnable_model(path: Path) -> None:
    """A valid ONNX file whose one op no runtime has: the config takes it, loading fails."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="edged.test")
    model = helper.make_model(
        helper.make_graph([node], "gone", [x], [y]),
        opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("edged.test", 1)],
    )
    onnx.save(model, path)


def post_with_timeout(port: int, timeout_us: int) -> int:
    import http.client

    x = cls_input()
    body = json.dumps(
        {
            "parameters": {"timeout": timeout_us},
            "inputs": [
                {
                    "name": "x",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ],
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v2/models/cls/infer", body, {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


@pytest.mark.integration
def test_json_format_daemon(models_dir: Path, tmp_path: Path) -> None:
    """Every line the daemon writes is one JSON object; the selection is an event with its
    inputs, and a flood of refusals is one line with its count."""
    daemon = Daemon(write_config(tmp_path, cls_table(models_dir)), args=("--log-format", "json"))
    daemon.wait_ready()
    try:
        statuses = [post_with_timeout(daemon.port, 1) for _ in range(5)]
    finally:
        assert daemon.stop() == 0, daemon.log_text()
    assert statuses == [504] * 5
    lines = [json.loads(line) for line in daemon.log_text().splitlines()]
    selection = next(doc for doc in lines if doc.get("event") == "selection")
    assert selection["model"] == "cls" and selection["backend"] and "p99_ms" in selection
    assert selection["quantized"] is False and selection["message"].startswith("model cls:")
    refused = [doc for doc in lines if doc.get("event") == "refused"]
    assert len(refused) == 1 and refused[0]["status"] == 504 and refused[0]["count"] == 1
    assert refused[0]["level"] == "warning"


@pytest.mark.integration
@pytest.mark.skipif(
    not JOURNAL_REMOTE.exists(), reason="systemd-journal-remote not fetched (make data; amd64 only)"
)
@pytest.mark.skipif(shutil.which("journalctl") is None, reason="no journalctl")
def test_journal_fields_filter_with_journalctl(models_dir: Path, tmp_path: Path) -> None:
    journal = JournalSocket(tmp_path / "journal.sock")
    models = (
        cls_table(models_dir) + f'\n[[models]]\nname = "gone"\npath = "{tmp_path / "gone.onnx"}"\n'
    )
    unrunnable_model(tmp_path / "gone.onnx")
    daemon = Daemon(
        write_config(tmp_path, models),
        env={"EDGED_JOURNAL_SOCKET": str(journal.path)},
        args=("--log-format", "journal"),
    )
    try:
        daemon.wait_ready()
        journal.wait_for("serving 1 model(s) on http://127.0.0.1:")
        daemon.signal(signal.SIGHUP)
        journal.wait_for("reloaded:")
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        time.sleep(0.2)
        journal.close()
    assert daemon.log_text() == ""  # nothing went to stderr
    # The records as journald's export format, into a real journal file.
    now = time.time_ns() // 1000
    export = b"".join(
        raw + f"__REALTIME_TIMESTAMP={now + i}\n__MONOTONIC_TIMESTAMP={i + 1}\n\n".encode()
        for i, raw in enumerate(journal.raw)
    )
    out = tmp_path / "edged.journal"
    env = {**os.environ, "LD_LIBRARY_PATH": str(JOURNAL_REMOTE.parent)}
    run = subprocess.run(
        [str(JOURNAL_REMOTE), "-o", str(out), "-"], input=export, capture_output=True, env=env
    )
    assert run.returncode == 0, run.stderr.decode()

    def query(*matches: str) -> list[dict]:
        cmd = ["journalctl", "--file", str(out), "-o", "json", "--no-pager", *matches]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return [json.loads(line) for line in done.stdout.splitlines()]

    assert len(query()) == len(journal.records) > 5
    cls = query("MODEL=cls")
    assert cls and all(e["MODEL"] == "cls" for e in cls)
    assert [e["EVENT"] for e in query("MODEL=cls", "EVENT=selection")] == [
        "selection"
    ]  # kept at reload
    failed = query("EVENT=load_failed")
    assert len(failed) == 2 and failed[0]["MODEL"] == "gone" and failed[0]["PRIORITY"] == "3"
    reload = query("SYSLOG_IDENTIFIER=edged", "EVENT=reload")
    assert len(reload) == 1 and "gone" in reload[0]["MESSAGE"]
