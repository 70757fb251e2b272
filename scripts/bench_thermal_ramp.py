#!/usr/bin/env python3
"""Thermal admission under a steady request stream: a fake board's CPU zone that the bench
heats into the cheaper step (not the limit one, nor the trip) and lets cool, while a real
daemon serves the cls model on two threads ([thermal] admission = "on", issue 30).

No board is heating here: the zone is a file the bench writes (passive trip 70 °C, band
20 °C, so the cheaper step starts at 66 °C), and the daemon reads it as it reads sysfs. The
figures are edged's own: how fast it acts, what the switch costs the stream, and how much
CPU an inference takes on each step (the heat it can save). Each cycle, interleaved:

* steady (cool, 40 °C), then a ramp of 1 °C every 0.2 s from 56 to 67 °C, held there;
* then back to 45 °C, held until the model is back on its pick.

Reported (medians over cycles): requests sent and lost (goal 0: the cheaper step refuses
nothing), the stream's p99 through each switch against its steady p99 in the same cycle
(the ratio), the time from the zone crossing 66 °C to the switch and from cooling to the
switch back (the hold is 2 s), and the daemon's CPU time per request on two threads and on
one (from its /proc stat, while each step serves the same stream).

Usage: bench_thermal_ramp.py [--cycles N] [--rate HZ] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import benchlib
import psutil
from benchlib import log

TEMP = "sys/class/thermal/thermal_zone0/temp"
CROSS_C = 66.0  # headroom 0.8 against the passive trip at 70 °C, band 20
HOLD_S = 2.0


class Stream:
    """Requests at a fixed rate on one connection: (sent perf_counter, latency s, status)."""

    def __init__(self, address: str, body, rate_hz: float) -> None:
        self.address, self.body, self.gap = address, body, 1.0 / rate_hz
        self.answers: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.address, timeout=30)
        body, headers = self.body
        due = time.perf_counter()
        while not self._stop.is_set():
            sent = time.perf_counter()
            conn.request("POST", "/v2/models/cls/infer", body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            self.answers.append((sent, time.perf_counter() - sent, response.status))
            due += self.gap
            time.sleep(max(0.0, due - time.perf_counter()))
        conn.close()

    def between(self, start: float, end: float) -> list[tuple[float, float, int]]:
        return [a for a in self.answers if start <= a[0] < end]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.rate <= 0:
        parser.error("--cycles >= 1, --rate > 0")

    from fetch_test_data import models_dir

    from tests.support.daemon_harness import CLS_BODY, Daemon, cls_table, write_config
    from tests.support.thermal_roots import thermal_root

    folder = models_dir(["ppocr_cls.onnx"])
    report: dict[str, Any] = {
        **benchlib.report_header("thermal_ramp"),
        "settings": {"cycles": args.cycles, "rate_hz": args.rate, "hold_s": HOLD_S},
        "loadavg_1min_start": benchlib.loadavg(),
        "board": "a fake thermal zone the bench writes (no board heats here)",
    }
    if not args.json:
        print(benchlib.machine_line(report["machine"]), flush=True)
    started = time.perf_counter()
    cycles = []
    with tempfile.TemporaryDirectory(prefix="edged-bench-thermal-") as tmp:
        work = Path(tmp)
        board = thermal_root(work / "board", {"cpu-thermal": 40000})
        table = cls_table(folder).replace("threads = 1", "threads = 2")
        thermal = f"""
[thermal]
admission = "on"
zones = ["cpu-thermal"]
root = "{board}"
interval_s = 0.2
hold_s = {HOLD_S}
"""
        config = write_config(work, table + thermal, "[telemetry]\nenabled = false\n")
        daemon = Daemon(config).wait_ready()
        stream = Stream(daemon.address, CLS_BODY, args.rate)
        try:
            stream.start()
            for index in range(args.cycles):
                log(f"cycle {index + 1}/{args.cycles}")
                cycles.append(_cycle(daemon, board, stream))
        finally:
            stream.stop()
            daemon.stop()
    report["cycles"] = cycles
    report["requests"] = {
        "sent": len(stream.answers),
        "lost": sum(status != 200 for _, _, status in stream.answers),
    }
    report["summary"] = _summary(cycles)
    if not args.json:
        print(_format(report), flush=True)
    return benchlib.finish(report, started, args.json)


def _status(daemon) -> dict:
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    try:
        conn.request("GET", "/edged/status")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _cooling(daemon) -> bool:
    return _status(daemon)["models"][0]["cooling"] is not None


def _wait(daemon, cooling: bool, timeout: float = 30.0) -> float:
    deadline = time.perf_counter() + timeout
    while _cooling(daemon) != cooling:
        if time.perf_counter() > deadline:
            raise SystemExit(f"the model did not {'switch' if cooling else 'switch back'}")
        time.sleep(0.02)
    return time.perf_counter()


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _cycle(daemon, board: Path, stream: Stream) -> dict[str, Any]:
    pid = daemon.proc.pid
    temp = board / TEMP
    temp.write_text("40000\n")
    time.sleep(1.0)
    steady_from, cpu0 = time.perf_counter(), _cpu_s(pid)
    time.sleep(3.0)
    steady_to, cpu1 = time.perf_counter(), _cpu_s(pid)
    crossed = None
    for celsius in range(56, 68):  # to 67 °C: headroom 0.85, short of the limit step (0.9)
        temp.write_text(f"{celsius * 1000}\n")
        if crossed is None and celsius >= CROSS_C:
            crossed = time.perf_counter()
        time.sleep(0.2)
    switched = _wait(daemon, True)
    time.sleep(1.0)
    cheap_from, cpu2 = time.perf_counter(), _cpu_s(pid)
    time.sleep(3.0)
    cheap_to, cpu3 = time.perf_counter(), _cpu_s(pid)
    temp.write_text("45000\n")
    cooled = time.perf_counter()
    back = _wait(daemon, False)
    time.sleep(1.0)
    end = time.perf_counter()
    assert crossed is not None
    steady = [lat for _, lat, _ in stream.between(steady_from, steady_to)]
    through_on = [lat for _, lat, _ in stream.between(crossed - 0.5, switched + 1.0)]
    through_off = [lat for _, lat, _ in stream.between(back - 0.5, back + 1.0)]
    cheap = [lat for _, lat, _ in stream.between(cheap_from, cheap_to)]
    steady_p99 = benchlib.latency_stats(steady).p99_ms
    on_p99 = benchlib.latency_stats(through_on).p99_ms
    off_p99 = benchlib.latency_stats(through_off).p99_ms
    return {
        "lost": sum(s != 200 for _, _, s in stream.between(steady_from, end)),
        "steady_p50_ms": benchlib.latency_stats(steady).p50_ms,
        "steady_p99_ms": steady_p99,
        "cheaper_p50_ms": benchlib.latency_stats(cheap).p50_ms,
        "switch_p99_ms": on_p99,
        "switch_back_p99_ms": off_p99,
        "switch_p99_vs_steady": round(on_p99 / steady_p99, 2),
        "switch_back_p99_vs_steady": round(off_p99 / steady_p99, 2),
        "to_switch_s": round(switched - crossed, 3),
        "to_switch_back_s": round(back - cooled, 3),
        "cpu_ms_per_request_two_threads": _per_request(cpu1 - cpu0, steady),
        "cpu_ms_per_request_one_thread": _per_request(cpu3 - cpu2, cheap),
    }


def _per_request(cpu_s: float, answers: list[float]) -> float | None:
    return round(cpu_s * 1e3 / len(answers), 3) if answers else None


def _summary(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float | None:
        values = [c[key] for c in cycles if c[key] is not None]
        return round(statistics.median(values), 3) if values else None

    keys = [k for k in cycles[0] if k != "lost"]
    summary: dict[str, Any] = {"lost": sum(c["lost"] for c in cycles)}
    summary |= {key: median(key) for key in keys}
    two, one = summary["cpu_ms_per_request_two_threads"], summary["cpu_ms_per_request_one_thread"]
    summary["cpu_one_thread_vs_two"] = round(one / two, 2) if one and two else None
    return summary


def _format(report: dict[str, Any]) -> str:
    s = report["summary"]
    return "\n".join(
        [
            f"requests: {report['requests']['sent']} sent, {report['requests']['lost']} lost",
            f"steady p50 {s['steady_p50_ms']} ms (2 threads), cheaper p50 "
            f"{s['cheaper_p50_ms']} ms (1 thread)",
            f"p99 through the switch {s['switch_p99_ms']} ms = {s['switch_p99_vs_steady']}x "
            f"steady p99 {s['steady_p99_ms']} ms; through the switch back "
            f"{s['switch_back_p99_ms']} ms = {s['switch_back_p99_vs_steady']}x",
            f"switch {s['to_switch_s']} s after the zone crossed {CROSS_C:g} °C; back "
            f"{s['to_switch_back_s']} s after it cooled (hold {HOLD_S:g} s)",
            f"daemon CPU per request: {s['cpu_ms_per_request_two_threads']} ms on two threads, "
            f"{s['cpu_ms_per_request_one_thread']} ms on one ({s['cpu_one_thread_vs_two']}x)",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
