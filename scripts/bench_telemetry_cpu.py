#!/usr/bin/env python3
"""Daemon CPU with telemetry at 1 Hz (MQTT to a local Mosquitto, counter sampling at 20 Hz)
against telemetry off, in one run: two real daemons on the same model under the same light
request load (a client at 50 Hz each), their CPU time measured over the same windows,
alternating which one is measured first. Target (issue 6): telemetry costs ≤ 1 % of a core.

    .venv/bin/python scripts/bench_telemetry_cpu.py [--seconds S] [--rounds R] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from fetch_test_data import models_dir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from broker import Broker  # noqa: E402  (tests/broker.py: a real mosquitto on loopback)
from daemon_harness import Daemon, write_config  # noqa: E402

from edged.client import Client  # noqa: E402


def daemon_config(folder: Path, telemetry: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_config(folder, f"""
{telemetry}

[[models]]
name = "face"
path = "{models_dir() / 'face_detection_short_range.tflite'}"
backend = "litert:XNNPACK"
threads = 1
""")


def load(address: str, stop: threading.Event, hz: float = 50.0) -> None:
    x = {"input": np.zeros((1, 128, 128, 3), np.float32)}
    with Client(address) as client:
        next_at = time.monotonic()
        while not stop.is_set():
            client.infer("face", x)
            next_at += 1 / hz
            stop.wait(max(0.0, next_at - time.monotonic()))


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per measured window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Broker(Path(tmp) / "broker") as broker:
        daemons = {
            "off": Daemon(daemon_config(Path(tmp) / "off", "[telemetry]\nenabled = false")),
            "on": Daemon(daemon_config(Path(tmp) / "on", f"""
[telemetry]
interval_s = 1
[telemetry.mqtt]
url = "{broker.url}"
group = "bench"
device_id = "cpu"
""")),
        }
        for d in daemons.values():
            d.wait_ready()
        stop = threading.Event()
        loaders = [threading.Thread(target=load, args=(d.address, stop), daemon=True)
                   for d in daemons.values()]
        for t in loaders:
            t.start()
        time.sleep(2)  # warm-up: first windows, MQTT connect
        per_round: dict[str, list[float]] = {"on": [], "off": []}
        try:
            for r in range(args.rounds):
                # Both measured over the same window (they run side by side); the order of
                # the reads alternates so neither is always read first.
                order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
                before = {k: cpu_seconds(daemons[k].proc.pid) for k in order}
                start = time.monotonic()
                time.sleep(args.seconds)
                wall = time.monotonic() - start
                for k in order:
                    per_round[k].append((cpu_seconds(daemons[k].proc.pid) - before[k]) / wall)
                print(f"bench_telemetry_cpu: round {r + 1}/{args.rounds}: on "
                      f"{per_round['on'][-1] * 100:.2f} %, off {per_round['off'][-1] * 100:.2f} "
                      f"% of a core", file=sys.stderr)
        finally:
            stop.set()
            for t in loaders:
                t.join(5)
            for d in daemons.values():
                d.stop()
    diff = [on - off for on, off in zip(per_round["on"], per_round["off"], strict=True)]
    result = {
        "seconds": args.seconds, "rounds": args.rounds,
        "cpu_on_pct": round(statistics.median(per_round["on"]) * 100, 3),
        "cpu_off_pct": round(statistics.median(per_round["off"]) * 100, 3),
        "telemetry_cost_pct": round(statistics.median(diff) * 100, 3),
        "per_round_cost_pct": [round(d * 100, 3) for d in diff],
    }
    result["target_met"] = result["telemetry_cost_pct"] <= 1.0
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"daemon CPU, face model at 50 Hz: telemetry on (1 Hz, MQTT) "
              f"{result['cpu_on_pct']:.2f} % of a core, off {result['cpu_off_pct']:.2f} %")
        print(f"{'PASS' if result['target_met'] else 'FAIL'}  telemetry costs "
              f"{result['telemetry_cost_pct']:.2f} % of a core (median of per-round "
              f"differences {result['per_round_cost_pct']}); target <= 1 %")
    return 0 if result["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
