#!/usr/bin/env python3
"""What handing a request to the pinned worker thread and back costs, with nothing else.

A no-op session (returns its input) behind a real `ModelWorker`; the event loop awaits
`worker.infer` in a loop. This is the part of edged's added latency that a bare ASGI endpoint
calling the session on the event-loop thread does not pay (see docs/BENCHMARKS.md, Serving).
Runs the stdlib asyncio loop and uvloop alternately, several rounds; prints medians.

Most of the cost is waking the other thread on another CPU, so it depends on where the two
threads run. With more than one CPU, uvloop is also measured in the daemon's layout ("split":
worker pinned to the last CPU, event loop on the others, as the default CPU plan does) and
with both threads on the last CPU ("shared": no cross-CPU wake-up, no isolation either).

    .venv/bin/python scripts/bench_handoff.py [--calls N] [--rounds R] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import benchlib
import numpy as np

from backends.base import Candidate
from backends.tensors import TensorSpec
from edged.config import BatchingConfig
from edged.serving.engine import ModelWorker


class NoopSession:
    def __init__(self) -> None:
        self.candidate = Candidate("noop", "CPU", "model")
        self.inputs = [TensorSpec("x", "float32", (1, 4))]
        self.outputs = [TensorSpec("y", "float32", (1, 4))]

    def run(self, feeds):
        return {"y": feeds["x"]}

    def info(self):
        return {"precision": "fp32"}

    def close(self) -> None:
        pass


def measure(runner, worker: ModelWorker, calls: int) -> float:
    feeds = {"x": np.zeros((1, 4), np.float32)}

    async def main() -> float:
        for _ in range(100):
            await worker.infer(feeds)
        start = time.perf_counter()
        for _ in range(calls):
            await worker.infer(feeds)
        return (time.perf_counter() - start) / calls * 1e6  # s -> µs per round trip

    return runner(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import uvloop

    cpus = sorted(os.sched_getaffinity(0))
    last, rest = cpus[-1:], cpus[:-1]
    # name -> (runner, event-loop thread CPUs, worker CPUs)
    layouts = {"asyncio": (asyncio.run, cpus, None), "uvloop": (uvloop.run, cpus, None)}
    if rest:
        layouts["uvloop, split"] = (uvloop.run, rest, last)
        layouts["uvloop, shared"] = (uvloop.run, last, last)
    workers = {
        name: ModelWorker("noop", NoopSession(), BatchingConfig(), cpus=worker_cpus)
        for name, (_, _, worker_cpus) in layouts.items()
    }
    for worker in workers.values():
        worker.start()
    rounds: dict[str, list[float]] = {name: [] for name in layouts}
    try:
        for _ in range(args.rounds):
            for name, (runner, loop_cpus, _) in layouts.items():
                os.sched_setaffinity(0, loop_cpus)  # this (the event-loop) thread only
                rounds[name].append(measure(runner, workers[name], args.calls))
    finally:
        os.sched_setaffinity(0, cpus)
        for worker in workers.values():
            worker.stop()
    result = {name: round(statistics.median(v), 1) for name, v in rounds.items()}
    if args.json:
        benchlib.write_json(
            {
                **benchlib.report_header("handoff"),
                "us_per_round_trip_median": result,
                "rounds": rounds,
            }
        )
    else:
        for name, value in result.items():
            print(
                f"{name:14} {value:6.1f} µs per request handed to the worker and back "
                f"(median of {args.rounds} rounds x {args.calls} calls)"
            )
        print(f"uvloop / asyncio: {result['uvloop'] / result['asyncio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
