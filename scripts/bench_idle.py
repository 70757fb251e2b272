#!/usr/bin/env python3
"""What an idle daemon costs: wake-ups per second and CPU, thread by thread, with telemetry
on and off (issue 30: an idle daemon must let the core sleep).

The daemon serves the cls model (ppocr_cls.onnx) on TCP, the Unix socket and gRPC, and gets
no request. After a settle period, every thread's context switches (voluntary: it slept
and was woken; involuntary: preempted) and CPU ticks are read from /proc/<pid>/task/*/
twice, --seconds apart. A wake-up is a voluntary switch: the thread went to sleep and
something woke it (a timer, a poll's timeout, another thread). The configurations run one
after the other, --rounds times, alternating; figures are medians over rounds, per thread
name summed over the threads of that name.

Goal (issue 30): below 5 wake-ups per second and below 0.1 % of one core, idle.

    .venv/bin/python scripts/bench_idle.py [--seconds 30] [--settle 5] [--rounds 2] [--json]

Exit codes: 0 measured (goal met or not: the report says), 2 cannot run (no test data).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
from bench_serving import Edged
from benchlib import log
from fetch_test_data import models_dir

# name -> (telemetry, gRPC)
CONFIGS = {"telemetry on": (True, True), "telemetry off": (False, True), "gRPC off": (True, False)}
TICK = os.sysconf("SC_CLK_TCK")
GOAL_WAKEUPS = 5.0
GOAL_CPU_PERCENT = 0.1


def write_config(folder: Path, model: Path, telemetry: bool, grpc: bool) -> Path:
    config = folder / "edged.toml"
    config.write_text(
        f"""[server]
listen = "127.0.0.1:0"
grpc_listen = "{"127.0.0.1:0" if grpc else ""}"
{"" if grpc else 'grpc_socket = ""'}
socket = "{folder / "edged.sock"}"
state_dir = "{folder / "state"}"

[telemetry]
enabled = {"true" if telemetry else "false"}

[[models]]
name = "cls"
path = "{model}"
backend = "onnxruntime"
"""
    )
    return config


def read_threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, voluntary switches, CPU ticks)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = f.read()
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # ended between the listing and the read
        fields = stat.rpartition(b")")[2].split()
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        voluntary = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        found[int(tid)] = (name, voluntary, int(fields[11]) + int(fields[12]))
    return found


def measure(pid: int, seconds: float) -> dict[str, Any]:
    before = read_threads(pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = read_threads(pid)
    span = time.monotonic() - t0
    wakeups: dict[str, float] = collections.defaultdict(float)
    ticks: dict[str, int] = collections.defaultdict(int)
    for tid, (name, voluntary, cpu) in after.items():
        old = before.get(tid, (name, 0, 0))
        wakeups[name] += (voluntary - old[1]) / span
        ticks[name] += cpu - old[2]
    total_ticks = sum(ticks.values())
    return {
        "threads": len(after),
        "wakeups_per_s": round(sum(wakeups.values()), 2),
        "cpu_percent": round(100.0 * total_ticks / TICK / span, 3),
        "by_thread": {
            name: {"wakeups_per_s": round(wakeups[name], 2), "cpu_ticks": ticks[name]}
            for name in sorted(wakeups, key=lambda n: -wakeups[n])
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        model = models_dir(["ppocr_cls.onnx"]) / "ppocr_cls.onnx"
    except Exception as exc:  # no test data: say so, exit 2
        log(f"no test data: {exc}")
        return 2
    started = time.perf_counter()
    report: dict[str, Any] = {
        **benchlib.report_header("idle"),
        "loadavg_1min_start": benchlib.loadavg(),
    }
    if not args.json:
        print(benchlib.machine_line(report["machine"]), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="edged-bench-idle-") as tmp:
        for r in range(args.rounds):
            for name, (telemetry, grpc) in CONFIGS.items():
                folder = Path(tmp) / f"{name.replace(' ', '-')}-{r}"
                folder.mkdir()
                config = write_config(folder, model, telemetry, grpc)
                daemon = Edged(folder, config).wait_ready()
                try:
                    time.sleep(args.settle)
                    result = measure(daemon.proc.pid, args.seconds)
                finally:
                    benchlib.stop_child(daemon.proc)
                runs[name].append(result)
                log(
                    f"round {r + 1} {name}: {result['wakeups_per_s']} wake-ups/s, "
                    f"{result['cpu_percent']} % of a core, {result['threads']} threads"
                )
    summary = {}
    for name, results in runs.items():
        names = {n for res in results for n in res["by_thread"]}
        summary[name] = {
            "wakeups_per_s": benchlib.median(r["wakeups_per_s"] for r in results),
            "cpu_percent": benchlib.median(r["cpu_percent"] for r in results),
            "threads": benchlib.median(r["threads"] for r in results),
            "by_thread": {
                n: benchlib.median(
                    r["by_thread"].get(n, {"wakeups_per_s": 0.0})["wakeups_per_s"] for r in results
                )
                for n in names
            },
        }
    report["settings"] = vars(args)
    report["summary"] = summary
    report["goal"] = {"wakeups_per_s": GOAL_WAKEUPS, "cpu_percent": GOAL_CPU_PERCENT}
    if not args.json:
        for name, fig in summary.items():
            met = fig["wakeups_per_s"] < GOAL_WAKEUPS and fig["cpu_percent"] < GOAL_CPU_PERCENT
            print(
                f"{name}: {fig['wakeups_per_s']:.1f} wake-ups/s, {fig['cpu_percent']:.3f} % of a "
                f"core, {fig['threads']:.0f} threads (goal < {GOAL_WAKEUPS:g}/s and "
                f"< {GOAL_CPU_PERCENT:g} %: {'met' if met else 'missed'})"
            )
            top = sorted(fig["by_thread"].items(), key=lambda item: -item[1])[:8]
            print("  " + ", ".join(f"{n} {w:.1f}/s" for n, w in top if w > 0))
    benchlib.finish(report, started, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
