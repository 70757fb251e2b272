"""The real daemon reporting to a real Mosquitto: birth, telemetry with latency windows,
events, the offline state on a clean stop and the Will after kill -9 (seen by mosquitto_sub)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from broker import Broker, SubProcess, sub_once
from daemon_harness import Daemon, write_config

from edged.client import Client

pytestmark = pytest.mark.skipif(shutil.which("mosquitto_sub") is None
                                and not Path("/usr/sbin/mosquitto").exists(),
                                reason="mosquitto not installed (apt-get install mosquitto "
                                       "mosquitto-clients)")

BASE = "edged/v1/line-3/cam-7"


def config(tmp_path: Path, models_dir: Path, broker: Broker) -> Path:
    return write_config(tmp_path, f"""
[telemetry]
interval_s = 0.5
[telemetry.mqtt]
url = "{broker.url}"
group = "line-3"
device_id = "cam-7"
keepalive_s = 2

[[models]]
name = "face"
path = "{models_dir / 'face_detection_short_range.tflite'}"
threads = 1
""")


def test_birth_telemetry_events_and_offline(tmp_path: Path, models_dir: Path) -> None:
    with Broker(tmp_path / "broker") as broker:
        sub = SubProcess(broker.port, f"{BASE}/#", tmp_path / "sub.txt").ready()
        try:
            d = Daemon(config(tmp_path, models_dir, broker)).wait_ready()
            with Client(d.address) as client:
                for _ in range(20):
                    client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
            messages = sub.wait_for(lambda ms: any(
                m.topic == f"{BASE}/telemetry" and m.payload["models"]["face"]["count"]
                for m in ms), timeout=20)
            [birth] = [m for m in messages if m.topic == f"{BASE}/state"][:1]
            assert birth.payload["online"] is True and "face" in birth.payload["models"]
            assert birth.payload["hardware"]["cpu_count"] >= 1
            busy = next(m for m in messages if m.topic == f"{BASE}/telemetry"
                        and m.payload["models"]["face"]["count"])
            face = busy.payload["models"]["face"]
            assert face["p99_ms"] >= face["p50_ms"] > 0 and "jitter_ms" in face
            assert {"ts", "seq", "bdSeq"} <= set(busy.payload)
            assert busy.payload["bdSeq"] == birth.payload["bdSeq"]
            assert busy.expiry is not None  # MQTT 5 message expiry on telemetry
            seqs = [m.payload["seq"] for m in messages
                    if m.topic in (f"{BASE}/telemetry", f"{BASE}/event")]
            assert seqs == sorted(seqs)
            # A reload is reported as an event.
            d.signal(signal.SIGHUP)
            sub.wait_for(lambda ms: any(m.topic == f"{BASE}/event"
                                        and m.payload.get("kind") == "reload" for m in ms),
                         timeout=20)
            assert d.stop() == 0
            [state] = sub_once(broker.port, f"{BASE}/state")  # retained, fresh client
            assert state["online"] is False and state["bdSeq"] == birth.payload["bdSeq"]
        finally:
            sub.close()


def test_kill_9_leaves_the_will(tmp_path: Path, models_dir: Path) -> None:
    with Broker(tmp_path / "broker") as broker:
        d = Daemon(config(tmp_path, models_dir, broker)).wait_ready()
        [online] = sub_once(broker.port, f"{BASE}/state")
        assert online["online"] is True
        d.proc.kill()
        d.proc.wait(10)
        d.log.close()
        d.notify.close()
        sub = SubProcess(broker.port, f"{BASE}/state", tmp_path / "will.txt").ready()
        try:
            messages = sub.wait_for(lambda ms: any(not m.payload["online"] for m in ms),
                                    timeout=15)
        finally:
            sub.close()
        will = next(m for m in messages if not m.payload["online"])
        assert will.retained and will.payload["bdSeq"] == online["bdSeq"]
