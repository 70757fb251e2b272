#!/usr/bin/env python3
"""How fast the telemetry spool takes messages in and gives them back (the spool's own side).

Per round, in a fresh folder: append N payloads (each one fsync'd, as the daemon does), then
replay them the way the MQTT thread does after a reconnect, `pending(limit=500)` and one
`ack` per message, until the spool is empty. Also: the per-append latency (what the
telemetry thread waits), appends into a full spool (each drops the oldest first), the file
size against the payload bytes, the time to reopen the full spool (quick_check and the totals
scan; warm page cache), and, for comparison, the same replay with every ack fsync'd too
(what the spool does not do; see edged/telemetry/spool.py).

Then the replay over MQTT, end to end (the issue's target: >= 1,000 msg/s): a real
`Publisher` spools --mqtt-items telemetry payloads while no broker listens on its port; then
a Mosquitto broker (tests/support/broker.py, a free loopback port) starts, `mosquitto_sub`
(QoS 1, a separate process: the independent client) subscribes, and the publisher is
started. Timed from `Publisher.start()` until mosquitto_sub has printed all N (connect, birth
and the whole replay, PUBACK-paced with the publisher's in-flight window); every seq checked
present, in order and marked historical. The publisher is started after the broker so that its
reconnect back-off (1-30 s by default) is not what is measured. Medians over rounds. The
append percentiles follow edged.selection.bench's rule (linear interpolation between ranks;
this script used to take the sample at rank int(q * n)).

    .venv/bin/python scripts/bench_spool.py [--items N] [--payload BYTES] [--batch N]
                                            [--rounds R] [--dir DIR] [--json]
                                            [--mqtt-items N] [--mqtt-window N] [--no-mqtt]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib  # also: tests/support/broker.py (the tests' Mosquitto, for the MQTT replay)

from edged.telemetry.spool import Spool

TOPIC = "edged/v1/bench/device/telemetry"


class FsyncEveryAck(Spool):
    """For comparison only: every commit fsync'd, acks included."""

    def _set_sync(self, db: sqlite3.Connection, level: str) -> None:
        super()._set_sync(db, "FULL")


def fill(spool: Spool, items: int, size: int) -> list[float]:
    """Append `items` payloads of `size` bytes; returns each append's seconds."""
    body = os.urandom(size)
    latencies = []
    for i in range(items):
        payload = b"%08d" % i + body[8:]
        start = time.perf_counter()
        spool.append(TOPIC, payload)
        latencies.append(time.perf_counter() - start)
    return latencies


def replay(spool: Spool, batch: int) -> tuple[int, float]:
    """Drain the spool like the MQTT thread after a reconnect; returns (messages, seconds)."""
    count = 0
    start = time.perf_counter()
    while items := spool.pending(limit=batch):
        for item in items:
            spool.ack(item.id)  # the publish would happen between these two
        count += len(items)
    return count, time.perf_counter() - start


def one_round(folder: Path, args: argparse.Namespace) -> dict:
    path = folder / "spool.db"
    spool = Spool(path)
    latencies = fill(spool, args.items, args.payload)
    payload_bytes = spool.stats()["bytes"]
    spool.close()
    file_bytes = path.stat().st_size  # close() checkpointed the WAL into the file
    start = time.perf_counter()
    spool = Spool(path)
    open_s = time.perf_counter() - start
    count, replay_s = replay(spool, args.batch)
    assert count == args.items and spool.stats()["count"] == 0, (count, spool.stats())
    spool.close()

    fsynced = FsyncEveryAck(folder / "fsync-every-ack.db")
    fill(fsynced, args.items, args.payload)
    count_f, replay_f_s = replay(fsynced, args.batch)
    assert count_f == args.items
    fsynced.close()

    # At the size bound: a spool a quarter of the size, so the last 3/4 of the appends each
    # drop the oldest item first (what a long outage does).
    bounded = Spool(folder / "bounded.db", max_bytes=args.items * args.payload // 4)
    at_bound = fill(bounded, args.items, args.payload)[args.items // 4 + 1 :]
    dropped = bounded.take_dropped()
    assert dropped >= len(at_bound), (dropped, len(at_bound))
    bounded.close()

    append = benchlib.latency_stats(latencies)
    return {
        "append_msg_per_s": args.items / sum(latencies),
        "append_p50_ms": append.p50_ms,
        "append_p99_ms": append.p99_ms,
        "append_max_ms": append.max_ms,
        "append_at_bound_msg_per_s": len(at_bound) / sum(at_bound),
        "replay_msg_per_s": count / replay_s,
        "replay_s": replay_s,
        "replay_fsync_every_ack_msg_per_s": count_f / replay_f_s,
        "reopen_ms": open_s * 1e3,
        "file_mb": file_bytes / 2**20,
        "payload_mb": payload_bytes / 2**20,
        "file_per_payload_byte": file_bytes / payload_bytes,
    }


def mqtt_round(folder: Path, args: argparse.Namespace) -> dict:
    """Spool N with the broker down, bring the broker up, time the replay to mosquitto_sub."""
    from edged.config import MqttSettings
    from edged.telemetry.mqtt.publisher import Publisher
    from tests.support.broker import MOSQUITTO_SUB, Broker, pub

    broker = Broker(folder / "broker")  # port chosen, not started: nobody listens there
    publisher = Publisher(
        MqttSettings(url=broker.url, group="bench", device_id="device"),
        Spool(folder / "mqtt-spool.db"),
        folder,
        owns_spool=True,
        window=args.mqtt_window,
        reconnect_min_s=0.2,
        reconnect_max_s=1.0,
    )
    publisher.set_birth({"version": "bench"})
    pad = "x" * max(0, args.payload - 60)  # ~ --payload bytes of JSON with ts/seq/bdSeq
    for i in range(args.mqtt_items):
        publisher.publish_telemetry({"models": {}, "i": i, "pad": pad})
    topic = "edged/v1/bench/device/telemetry"
    probe = "edged-bench/probe"
    broker.start()
    sub = None
    try:
        # A retained probe arrives as soon as the subscription is in place: then start.
        pub(broker.port, probe, "{}", "-r")
        sub = subprocess.Popen(
            [
                MOSQUITTO_SUB,
                "-h",
                "127.0.0.1",
                "-p",
                str(broker.port),
                "-t",
                topic,
                "-t",
                probe,
                "-q",
                "1",
                "-C",
                str(args.mqtt_items + 1),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sub.stdout is not None
        first_line = sub.stdout.readline()
        assert first_line.strip() == "{}", first_line
        start = time.perf_counter()
        publisher.start()
        lines = []
        first_at = None
        for line in sub.stdout:
            if first_at is None:
                first_at = time.perf_counter()
            lines.append(line)
        done = time.perf_counter()
        sub.wait(10)
    finally:
        if sub is not None and sub.poll() is None:
            sub.kill()
        publisher.stop(5)
        broker.stop()
    received = [json.loads(line) for line in lines]
    seqs = [m["seq"] for m in received]
    assert len(seqs) == args.mqtt_items, (len(seqs), args.mqtt_items)
    assert seqs == list(range(seqs[0], seqs[0] + args.mqtt_items)), "lost or out of order"
    assert all(m.get("historical") is True for m in received)
    assert first_at is not None
    return {
        "mqtt_replay_msg_per_s": args.mqtt_items / (done - start),
        "mqtt_replay_s": done - start,
        "mqtt_start_to_first_ms": (first_at - start) * 1e3,
        "mqtt_replay_stream_msg_per_s": (args.mqtt_items - 1) / (done - first_at),
        "mqtt_payload_bytes": statistics.median(len(line) - 1 for line in lines),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--payload", type=int, default=300, help="bytes per message")
    parser.add_argument("--batch", type=int, default=500, help="pending(limit=...)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the spool files go (default: the temp dir); use the "
        "device's state dir file system to measure its fsync",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--mqtt-items", type=int, default=5_000, help="messages replayed over MQTT per round"
    )
    parser.add_argument(
        "--mqtt-window",
        type=int,
        default=100,
        help="the publisher's in-flight QoS 1 window (edged's default: 100)",
    )
    parser.add_argument(
        "--no-mqtt", action="store_true", help="the spool alone (no mosquitto needed)"
    )
    args = parser.parse_args()
    if args.payload < 8:
        parser.error("--payload must be at least 8 bytes")

    load_before = benchlib.loadavg()
    rounds = []
    for _ in range(args.rounds):
        folder = Path(tempfile.mkdtemp(prefix="bench-spool-", dir=args.dir))
        try:
            result = one_round(folder, args)
            if not args.no_mqtt:
                result.update(mqtt_round(folder, args))
            rounds.append(result)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    load_after = benchlib.loadavg()
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    spread = {key: [min(r[key] for r in rounds), max(r[key] for r in rounds)] for key in rounds[0]}
    result = {
        **benchlib.report_header("spool"),
        "items": args.items,
        "payload_bytes": args.payload,
        "batch": args.batch,
        "mqtt_items": 0 if args.no_mqtt else args.mqtt_items,
        "mqtt_window": args.mqtt_window,
        "rounds": args.rounds,
        "dir": str(args.dir or tempfile.gettempdir()),
        "loadavg_1min": [load_before, load_after],
        "median": {k: round(v, 3) for k, v in median.items()},
        "min_max": {k: [round(v, 3) for v in mm] for k, mm in spread.items()},
        "per_round": [{k: round(v, 3) for k, v in r.items()} for r in rounds],
    }
    if args.json:
        benchlib.write_json(result)
        return 0
    print(
        f"spool: {args.items} x {args.payload} B, pending(limit={args.batch}) + ack, "
        f"{args.rounds} rounds in {result['dir']}; loadavg {load_before:.2f} -> "
        f"{load_after:.2f}; median (min-max)"
    )
    if not args.no_mqtt:
        print(
            f"MQTT replay: {args.mqtt_items} spooled with the broker down, window "
            f"{args.mqtt_window}; target >= 1000 msg/s"
        )
    for key, value in median.items():
        lo, hi = spread[key]
        print(f"  {key:34} {value:12.3f}  ({lo:.3f}-{hi:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
