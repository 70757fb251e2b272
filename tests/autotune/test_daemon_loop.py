"""The daemon's tuning loop end to end: a real daemon (auto = "apply", its journal in a
temporary root), a real Mosquitto, and four CPU hogs the test pins on the model's core. The
loop names them, moves them (only them: [tuning] movable), verifies and keeps the move; the
steps are MQTT events (checked against the schema), log events, the loop's record that
`edgectl tune` lists, and the status; `edgectl revert --root` puts the hogs back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edged.client import Client
from tests.support.broker import Broker, SubProcess
from tests.support.cpu_hog import HOG_NAME, HOGS, start_hog
from tests.support.daemon_harness import Daemon, cls_input, write_config
from tests.support.schema import check

pytestmark = pytest.mark.integration
BASE = "edged/v1/line-3/cam-7"
REPO = Path(__file__).resolve().parents[2]


def edgectl(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.needs_broker
@pytest.mark.needs_cpus(2, reason="one for the model and the hogs, one for the client")
@pytest.mark.timing
@pytest.mark.alone
def test_the_daemons_loop_moves_a_pinned_hog_and_says_so(tmp_path: Path, models_dir: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    cpu, other = cpus[-1], cpus[0]
    root = tmp_path / "root"
    root.mkdir()
    stop = threading.Event()

    def client(address: str) -> None:
        os.sched_setaffinity(0, {other})
        with Client(address) as c:
            while not stop.wait(0.01):
                c.infer("cls", {"x": cls_input()})

    with Broker(tmp_path / "broker") as broker:
        sub = SubProcess(broker.port, f"{BASE}/event", tmp_path / "sub.txt").ready()
        hogs = [start_hog(cpu, seconds=150) for _ in range(HOGS)]
        d = None
        try:
            d = Daemon(
                write_config(
                    tmp_path,
                    f"""
[telemetry]
interval_s = 1.5
[telemetry.mqtt]
url = "{broker.url}"
group = "line-3"
device_id = "cam-7"

[tuning]
auto = "apply"
windows = 7
settle_windows = 1
worse_tolerance = 0.3
movable = ["{HOG_NAME}"]
root = "{root}"

[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
backend = "onnxruntime"
threads = 1
cpus = [{cpu}]
shapes = {{ x = [1, 3, 48, 192] }}
""",
                )
            ).wait_ready()
            feeder = threading.Thread(target=client, args=(d.address,), daemon=True)
            feeder.start()
            messages = sub.wait_for(
                lambda ms: any(
                    m.payload.get("kind") == "tuning"
                    and m.payload.get("state") in ("kept", "reverted")
                    for m in ms
                ),
                timeout=90,
            )
            stop.set()
            feeder.join(10)
            with Client(d.address) as c:
                status = c.status()
            moved = [os.sched_getaffinity(hog.pid) for hog in hogs]
            listed = edgectl("tune", "--state-dir", str(tmp_path / "state"))
            edgectl("revert", "--root", str(root))
            back = [os.sched_getaffinity(hog.pid) for hog in hogs]
        finally:
            stop.set()
            sub.close()
            for hog in hogs:
                hog.kill()
                hog.wait()
            if d is not None:
                d.stop()
    steps = [m.payload for m in messages if m.payload.get("kind") == "tuning"]
    for payload in steps:
        check("event", payload)
    print("\n" + listed)
    assert [(s["state"], s["action"]) for s in steps][:2] == [
        ("applied", "move-intruder"),
        ("kept", "move-intruder"),
    ], [(s["state"], s["action"], s["reason"]) for s in steps]
    kept = steps[1]
    assert kept["cause"] == "preempted" and kept["reason"].startswith("helped")
    assert kept["after"]["p999_ms"] < kept["before"]["p999_ms"]
    paths = {c["path"] for c in kept["changes"]}
    assert {f"/proc/{hog.pid}/task/{hog.pid}" for hog in hogs} <= paths
    assert all(HOG_NAME in c["reason"] for c in kept["changes"])  # nothing else moved
    assert moved == [{other}] * HOGS and back == [{cpu}] * HOGS
    assert status["tuning"]["auto"] == "apply"
    assert status["tuning"]["steps"][0]["state"] == "kept"
    assert "KEPT move-intruder for preempted" in listed
    log = d.log_text()
    assert "tuning: applied move-intruder for preempted" in log
    assert "tuning: kept move-intruder for preempted" in log
