#!/usr/bin/env python3
"""Warm standby under a steady request stream: an NPU that is unplugged and plugged back, and
one that hangs and comes back, while requests arrive at a fixed rate (issue 13).

The NPU is an RK3588's (the RKNN backend, serving the cls model's real .rknn variant) with
the RKNNLite stand-in at the driver boundary (tests/support/failover.py): no NPU is on this
machine, so the figures are edged's own cost of switching (fail-over, re-verification,
switch-back), not a board's. The model keeps a warm standby (the original on onnxruntime's
CPU path). Each cycle, interleaved:

* unplug: the driver's node goes and the runtime's calls fail; the hot-plug path
  (`ServedModel.adapt`) runs as the daemon's udev handler would; then plug, and adapt again;
* hang: the runtime's inference blocks; the supervisor (as the daemon's, every 0.1 s) takes
  over after `watchdog_ms`; then the hang ends and `recover` runs, as the supervisor does
  every 30 s.

Reported per scenario (medians over cycles, and the worst): requests sent and lost (goal 0),
the longest request around the switch, against the stream's steady p99 on the NPU measured in
the same run (the ratio), the time from the fault to the standby's first answer, and from the
device's return until the NPU's first answer.

Usage: bench_failover.py [--cycles N] [--rate HZ] [--watchdog-ms MS] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import benchlib
from benchlib import log

NPU = "rknn:NPU:model"
STANDBY = "onnxruntime:CPU:model"
PHASE_S = 0.6  # each phase of a cycle: steady, faulted, back


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=5, help="unplug and hang cycles each")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument("--watchdog-ms", type=int, default=200, help="the model's watchdog_ms")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.rate <= 0 or args.watchdog_ms < 1:
        parser.error("--cycles >= 1, --rate > 0, --watchdog-ms >= 1")

    from fetch_test_data import models_dir

    from edged.config import BatchingConfig
    from edged.selection.policy import Policy
    from edged.serving.models import load_model
    from tests.support.failover import CLS, RKNN, SHAPES, Board, Stream, stand_in

    folder = models_dir([CLS, RKNN])
    report: dict[str, Any] = {
        **benchlib.report_header("failover"),
        "settings": {"cycles": args.cycles, "rate_hz": args.rate, "watchdog_ms": args.watchdog_ms},
        "loadavg_1min_start": benchlib.loadavg(),
        "standin": "RKNNLite stand-in at the driver boundary (no NPU here)",
    }
    if not args.json:
        print(benchlib.machine_line(report["machine"]), flush=True)
    started = time.perf_counter()
    policy = Policy(runs=50, warmup=5, time_budget_s=2.0, threads=1, shapes=SHAPES, backend="rknn")
    batching = BatchingConfig(timeout_ms=2000, watchdog_ms=args.watchdog_ms, max_queue_size=1024)
    cycles: dict[str, list[dict[str, Any]]] = {"unplug": [], "hang": []}
    with tempfile.TemporaryDirectory(prefix="edged-bench-failover-") as tmp:
        board = Board(Path(tmp), folder)
        with stand_in(board) as npu:
            served = load_model(
                "cls",
                board.original,
                policy,
                batching,
                board.facts(),
                Path(tmp) / "state",
                variants=(board.variant,),
            )
            stop = threading.Event()
            supervisor = threading.Thread(target=_supervise, args=(served.worker, stop))
            supervisor.start()
            stream = Stream(served.worker, rate_hz=args.rate)
            stream.start()
            try:
                marks = []
                for index in range(args.cycles):
                    for kind in ("unplug", "hang"):
                        log(f"cycle {index + 1}/{args.cycles}: {kind}")
                        marks.append((kind, _cycle(kind, served, board, npu)))
            finally:
                stream.stop()
                stop.set()
                supervisor.join()
                if npu.hold is not None:
                    npu.hold.set()
                served.worker.stop(1.0)
    for kind, mark in marks:  # measured once every answer is in
        cycles[kind].append(_measure(mark, stream))
    report["scenarios"] = {kind: _summary(found) for kind, found in cycles.items()}
    report["cycles"] = cycles
    report["requests"] = {
        "sent": len(stream.outcomes),
        "lost": sum(o.error is not None or o.latency_s is None for o in stream.outcomes),
        "errors": sorted({o.error for o in stream.outcomes if o.error})[:5],
    }
    if not args.json:
        print(_format(report), flush=True)
    return benchlib.finish(report, started, args.json)


def _supervise(worker, stop: threading.Event) -> None:
    """What the daemon's supervisor task does for a stalled backend, every 0.1 s."""
    while not stop.is_set():
        if worker.stalled(worker.batching.watchdog_ms / 1000.0):
            worker.take_over_if_stalled()
        stop.wait(0.1)


def _cycle(kind: str, served, board, npu) -> dict[str, Any]:
    """One fault and return: steady on the NPU, the fault, then back on the NPU. Returns
    the moments (perf_counter) and what edged said at each switch."""
    steady_from = time.perf_counter()
    time.sleep(PHASE_S)
    fault = time.perf_counter()
    if kind == "unplug":
        board.unplug()
        outcome = served.adapt(board.facts())
    else:
        npu.hold = threading.Event()
        outcome = "hung"
    time.sleep(PHASE_S)
    returned = time.perf_counter()
    if kind == "unplug":
        board.plug()
        back = served.adapt(board.facts())
    else:
        hold, npu.hold = npu.hold, None
        hold.set()  # the stuck call returns; its late answer is dropped
        back = served.recover(board.facts())
    done = time.perf_counter()
    time.sleep(PHASE_S)
    return {
        "steady_from": steady_from,
        "fault": fault,
        "returned": returned,
        "done": done,
        "end": time.perf_counter(),
        "fault_outcome": outcome,
        "return_outcome": back,
        "degraded_after": served.worker.degraded,
    }


def _measure(mark: dict[str, Any], stream) -> dict[str, Any]:
    fault, returned = mark["fault"], mark["returned"]
    steady = [o.latency_s for o in stream.between(mark["steady_from"], fault) if o.latency_s]
    around = stream.between(fault, mark["end"])
    lost = [o for o in stream.between(mark["steady_from"], mark["end"]) if o.latency_s is None]
    # When the first answer from each came (sent + latency): the switch as a client sees it.
    standby_at = min((_answered(o) for o in around if o.backend == STANDBY), default=None)
    npu_again = min(
        (_answered(o) for o in around if o.backend == NPU and _answered(o) >= returned),
        default=None,
    )
    worst = max((o.latency_s for o in around if o.latency_s), default=None)
    steady_p99 = benchlib.latency_stats(steady).p99_ms if steady else None
    return {
        "fault_outcome": mark["fault_outcome"],
        "return_outcome": mark["return_outcome"],
        "steady_p99_ms": steady_p99,
        "worst_ms": round(worst * 1e3, 3) if worst else None,
        "worst_vs_steady_p99": round(worst * 1e3 / steady_p99, 1) if worst and steady_p99 else None,
        "to_standby_ms": round((standby_at - fault) * 1e3, 1) if standby_at else None,
        "switch_back_s": round(mark["done"] - returned, 3),
        "npu_serves_again_after_ms": round((npu_again - returned) * 1e3, 1) if npu_again else None,
        "lost": len(lost),
        "degraded_after": mark["degraded_after"],
    }


def _answered(outcome) -> float:
    return outcome.sent + (outcome.latency_s or 0.0)


def _summary(found: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float | None:
        values = [c[key] for c in found if c[key] is not None]
        return round(statistics.median(values), 3) if values else None

    worst = [c["worst_ms"] for c in found if c["worst_ms"] is not None]
    return {
        "cycles": len(found),
        "lost": sum(c["lost"] for c in found),
        "steady_p99_ms": median("steady_p99_ms"),
        "worst_ms_median": median("worst_ms"),
        "worst_ms_max": max(worst) if worst else None,
        "worst_vs_steady_p99_median": median("worst_vs_steady_p99"),
        "to_standby_ms_median": median("to_standby_ms"),
        "npu_serves_again_after_ms_median": median("npu_serves_again_after_ms"),
        "npu_serves_again_after_ms_max": max(
            (c["npu_serves_again_after_ms"] or 0 for c in found), default=None
        ),
        "all_back_on_npu": not any(c["degraded_after"] for c in found),
    }


def _format(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"stream {s['rate_hz']:g} req/s, watchdog_ms {s['watchdog_ms']}, {s['cycles']} cycles "
        f"per fault ({report['standin']})",
        f"{'fault':<8} {'lost':>5} {'steady p99':>11} {'worst':>9} {'worst/p99':>10} "
        f"{'to standby':>11} {'NPU again':>10} {'worst again':>12}",
    ]
    for kind, m in report["scenarios"].items():
        lines.append(
            f"{kind:<8} {m['lost']:>5} {_ms(m['steady_p99_ms']):>11} {_ms(m['worst_ms_max']):>9} "
            f"{m['worst_vs_steady_p99_median'] or '-':>9}x {_ms(m['to_standby_ms_median']):>11} "
            f"{_ms(m['npu_serves_again_after_ms_median']):>10} "
            f"{_ms(m['npu_serves_again_after_ms_max']):>12}"
        )
    r = report["requests"]
    lines.append(
        f"requests: {r['sent']} sent, {r['lost']} lost"
        + (f" ({'; '.join(r['errors'])})" if r["errors"] else "")
    )
    lines.append(
        "medians over cycles; worst = the longest request from the fault until the NPU serves "
        "again (max over cycles), its ratio to the steady p99 on the NPU in the same cycle"
    )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
