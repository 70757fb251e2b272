"""Micro-benchmark: warm-up, then timed runs, interleaved across candidates.

Interleaving (a block of runs per candidate in turn) spreads a noisy neighbour's bursts over
every candidate instead of punishing whichever ran at that moment.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

BLOCK = 5  # runs per candidate per turn


@dataclass(frozen=True)
class LatencyStats:
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    mean_ms: float
    stdev_ms: float
    throughput_ips: float  # inferences per second of busy time

    @classmethod
    def from_ns(cls, samples_ns: Sequence[int]) -> LatencyStats:
        ms = np.asarray(samples_ns, dtype=np.float64) / 1e6  # ns -> ms for reporting
        p50, p90, p99, p999 = np.percentile(ms, [50, 90, 99, 99.9])
        return cls(
            runs=len(ms),
            p50_ms=round(float(p50), 4),
            p90_ms=round(float(p90), 4),
            p99_ms=round(float(p99), 4),
            p999_ms=round(float(p999), 4),
            max_ms=round(float(ms.max()), 4),
            mean_ms=round(float(ms.mean()), 4),
            stdev_ms=round(float(ms.std(ddof=1)) if len(ms) > 1 else 0.0, 4),
            throughput_ips=round(1000.0 * len(ms) / float(ms.sum()), 2) if ms.sum() else 0.0,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def pinned_thread(cpus: Sequence[int] | None) -> Iterator[None]:
    """Run the calling thread on `cpus` (runtimes pin their pools but not the caller)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def benchmark(
    runners: Mapping[str, Callable[[], Any]],
    runs: int,
    warmup: int,
    time_budget_s: float | None = None,
    min_runs: int = 10,
    progress: Callable[[int], None] | None = None,
) -> dict[str, LatencyStats]:
    """Time each runner `runs` times after `warmup` calls, interleaved in blocks.

    With a time budget, a candidate stops early once it has `min_runs` and has used its
    share of the budget, so one slow candidate cannot stall a selection.
    """
    for run in runners.values():
        for _ in range(warmup):
            run()
    samples: dict[str, list[int]] = {key: [] for key in runners}
    spent: dict[str, float] = dict.fromkeys(runners, 0.0)
    share = time_budget_s / max(1, len(runners)) if time_budget_s else None
    active = list(runners)
    while active:
        for key in list(active):
            run = runners[key]
            for _ in range(min(BLOCK, runs - len(samples[key]))):
                start = time.perf_counter_ns()
                run()
                elapsed = time.perf_counter_ns() - start
                samples[key].append(elapsed)
                spent[key] += elapsed / 1e9
                if progress:
                    progress(1)
            done = len(samples[key]) >= runs
            over = share is not None and spent[key] >= share and len(samples[key]) >= min_runs
            if done or over:
                active.remove(key)
                if progress and not done:
                    progress(runs - len(samples[key]))
    return {key: LatencyStats.from_ns(values) for key, values in samples.items()}
