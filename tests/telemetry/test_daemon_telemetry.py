"""The real daemon reporting to a real Mosquitto: birth, telemetry with latency windows,
events, the offline state on a clean stop and the Will after kill -9, a 30 s broker outage
(seen by mosquitto_sub); every payload checked against docs/schema."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from edged.client import Client
from sysconf.intrusions import thread_switches
from tests.support.broker import Broker, Message, SubProcess, first_seen, sub_once
from tests.support.daemon_harness import Daemon, write_config
from tests.support.schema import check

pytestmark = pytest.mark.integration

BASE = "edged/v1/line-3/cam-7"


def config(tmp_path: Path, models_dir: Path, broker: Broker, interval_s: float = 0.5) -> Path:
    return write_config(
        tmp_path,
        f"""
[telemetry]
interval_s = {interval_s}
[telemetry.mqtt]
url = "{broker.url}"
group = "line-3"
device_id = "cam-7"
keepalive_s = 2

[[models]]
name = "face"
path = "{models_dir / "face_detection_short_range.tflite"}"
threads = 1
""",
    )


@pytest.mark.needs_broker
def test_birth_telemetry_events_and_offline(tmp_path: Path, models_dir: Path) -> None:
    with Broker(tmp_path / "broker") as broker:
        sub = SubProcess(broker.port, f"{BASE}/#", tmp_path / "sub.txt").ready()
        try:
            d = Daemon(config(tmp_path, models_dir, broker)).wait_ready()
            with Client(d.address) as client:
                for _ in range(20):
                    client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
            messages = sub.wait_for(
                lambda ms: any(
                    m.topic == f"{BASE}/telemetry" and m.payload["models"]["face"]["count"]
                    for m in ms
                ),
                timeout=20,
            )
            [birth] = [m for m in messages if m.topic == f"{BASE}/state"][:1]
            assert birth.payload["online"] is True and "face" in birth.payload["models"]
            assert birth.payload["hardware"]["cpu_count"] >= 1
            busy = next(
                m
                for m in messages
                if m.topic == f"{BASE}/telemetry" and m.payload["models"]["face"]["count"]
            )
            face = busy.payload["models"]["face"]
            assert face["p99_ms"] >= face["p50_ms"] > 0 and "jitter_ms" in face
            assert {"ts", "seq", "bdSeq"} <= set(busy.payload)
            assert busy.payload["bdSeq"] == birth.payload["bdSeq"]
            assert busy.expiry is not None  # MQTT 5 message expiry on telemetry
            seqs = [
                m.payload["seq"]
                for m in messages
                if m.topic in (f"{BASE}/telemetry", f"{BASE}/event")
            ]
            assert seqs == sorted(seqs)
            # A reload is reported as an event.
            d.signal(signal.SIGHUP)
            sub.wait_for(
                lambda ms: any(
                    m.topic == f"{BASE}/event" and m.payload.get("kind") == "reload" for m in ms
                ),
                timeout=20,
            )
            assert d.stop() == 0
            [state] = sub_once(broker.port, f"{BASE}/state")  # retained, fresh client
            assert state["online"] is False and state["bdSeq"] == birth.payload["bdSeq"]
            messages = sub.messages()
        finally:
            sub.close()
        # Every payload the real daemon sent matches its schema file.
        kinds = {f"{BASE}/{kind}": kind for kind in ("state", "telemetry", "event", "audit")}
        seen = set()
        for message in messages:
            check(kinds[message.topic], message.payload)
            seen.add(kinds[message.topic])
        assert seen >= {"state", "telemetry", "event"}
        assert {"since_start", "outliers"} <= set(face)
        assert face["since_start"]["count"] >= face["count"]
        intrusions = busy.payload["system"]["intrusions"]
        assert "face" in intrusions["workers"] and intrusions["cpus"]


@pytest.mark.needs_broker
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
            messages = sub.wait_for(lambda ms: any(not m.payload["online"] for m in ms), timeout=15)
        finally:
            sub.close()
        will = next(m for m in messages if not m.payload["online"])
        assert will.retained and will.payload["bdSeq"] == online["bdSeq"]


def _telemetry_and_events(messages: list[Message]) -> list[dict]:
    return [m.payload for m in messages if m.topic in (f"{BASE}/telemetry", f"{BASE}/event")]


@pytest.mark.slow
@pytest.mark.needs_broker
def test_broker_down_30_s_while_the_daemon_runs_loses_nothing(
    tmp_path: Path, models_dir: Path
) -> None:
    """The issue's outage: the broker stopped for 30 s under a running daemon. After the
    restart every telemetry/event message reaches an independent persistent subscriber, in
    order, with a continuous seq, those made during the outage marked historical."""
    broker = Broker(tmp_path / "broker", persistence=True).start()
    try:
        # A persistent session (-c -i) so the broker queues what the daemon replays even if
        # the daemon reconnects before mosquitto_sub does.
        sub = SubProcess(
            broker.port,
            [f"{BASE}/telemetry", f"{BASE}/event"],
            tmp_path / "sub.txt",
            "-c",
            "-i",
            "edged-test-daemon-outage",
        ).ready()
    except BaseException:
        broker.stop()
        raise
    d = None
    try:
        d = Daemon(config(tmp_path, models_dir, broker, interval_s=0.5)).wait_ready()
        sub.wait_for(lambda ms: len(_telemetry_and_events(ms)) >= 3, timeout=20)
        broker.stop()
        down_at = time.time()
        time.sleep(30.0)
        up_at = time.time()
        broker.start()
        # Until a message made after the restart arrives: everything before it is replayed.
        messages = sub.wait_for(
            lambda ms: any(
                p["ts"] > up_at + 2.0 and not p.get("historical") for p in _telemetry_and_events(ms)
            ),
            timeout=60,
        )
        assert d.proc.poll() is None, d.log_text()[-2000:]
    finally:
        if d is not None:
            d.stop()
        sub.close()
        broker.stop()
    payloads = _telemetry_and_events(messages)
    arrival = first_seen([p["seq"] for p in payloads])  # QoS 1 may resend a few
    assert arrival == list(range(arrival[0], arrival[-1] + 1)), "lost or out of order"
    by_seq = {p["seq"]: p for p in payloads}
    outage = [p for p in by_seq.values() if down_at + 0.6 < p["ts"] < up_at - 0.1]
    assert len(outage) >= 50, f"only {len(outage)} made during the 30 s outage"  # ~60 at 2 Hz
    assert all(p.get("historical") is True for p in outage)
    assert [p["ts"] for p in (by_seq[s] for s in arrival)] == sorted(
        p["ts"] for p in by_seq.values()
    )  # arrival order is production order
    for p in outage[:3] + outage[-3:]:
        check("telemetry" if "models" in p else "event", p)


def _thread_named(pid: int, name: str) -> int | None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                return int(tid)
        except OSError:
            continue
    return None


def _wakeups(pid: int, tid: int) -> int:
    counts = thread_switches(tid, pid)
    assert counts is not None
    return counts.voluntary + counts.involuntary


def test_without_a_broker_idle_sampler_sleeps_and_the_log_gets_summaries(
    tmp_path: Path, models_dir: Path
) -> None:
    """Issue 16: an idle daemon's counter sampler does not wake up at all (its thread's
    context switches stand still: each sample is one sleep), and without a broker the log
    gets one summary line per payload while the payloads go to [telemetry] payload_file,
    each valid against the schema."""
    out = tmp_path / "telemetry.jsonl"
    d = Daemon(
        write_config(
            tmp_path,
            f"""
[telemetry]
interval_s = 0.5
payload_file = "{out}"

[[models]]
name = "face"
path = "{models_dir / "face_detection_short_range.tflite"}"
threads = 1
""",
        )
    ).wait_ready()
    try:
        pid = d.proc.pid
        deadline = time.monotonic() + 10
        while (tid := _thread_named(pid, "edged-sampler")) is None:
            assert time.monotonic() < deadline, "no edged-sampler thread"
            time.sleep(0.05)
        idle = _wakeups(pid, tid)
        time.sleep(1.5)
        assert _wakeups(pid, tid) == idle  # three payloads made, not one sample taken
        with Client(d.address) as client:
            for _ in range(40):
                client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
                time.sleep(0.02)
        busy = _wakeups(pid, tid)
        assert busy - idle >= 10  # sampled while requests came (20 Hz for ~1.5 s)
        # The tail, then parked: on a loaded machine the last samples may come late, so wait
        # (bounded) until the count stands still; then it must stay still.
        settled, deadline = _wakeups(pid, tid), time.monotonic() + 10
        while True:
            time.sleep(0.5)
            now = _wakeups(pid, tid)
            if now == settled:
                break
            assert time.monotonic() < deadline, "the sampler never parked"
            settled = now
        time.sleep(1.5)
        assert _wakeups(pid, tid) == settled
        assert settled - busy <= 6
    finally:
        assert d.stop() == 0
    log = d.log_text()
    summaries = [line for line in log.splitlines() if "edged.telemetry.loop: telemetry: " in line]
    assert len(summaries) >= 5, log[-3000:]
    assert any(re.search(r"face n=\d+ p50 [\d.]+ p99 [\d.]+ ms", line) for line in summaries)
    assert all(len(line) < 400 for line in summaries)
    assert '"topic":"telemetry"' not in log  # the payloads are not in the log at info
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(summaries)
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert sum(r["models"]["face"]["count"] for r in records) == 40
    for record in records:
        check("telemetry", record)
