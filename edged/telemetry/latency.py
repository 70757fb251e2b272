"""Per-model latency statistics: HDR histograms per telemetry window, jitter, and the window's
outliers (attributed by edged.telemetry.attribution).

The worker thread calls `LatencyRecorder.record` once per request: three HdrHistogram
`record_value`s (integer microseconds, 1 µs – 60 s, 3 significant digits) under a lock that
the telemetry thread only holds to swap two histogram sets, plus, for a request among the
window's slowest so far, a push on a small bounded heap of candidate spans. Measured on the
dev VM: 3-8 µs a call, as loaded as the shared VM is (tests/telemetry/test_latency.py prints it).

Outliers are the requests above the window's *own* p99, which is only known when the window
closes; so the worker keeps the top-K slowest spans of the window in a min-heap (K = max(16,
2 % of the larger of this window's count so far and the previous window's count), at most
`max_outliers`) and `rotate` attributes those above the p99 it has just computed. A p99 tail
is 1 % of the count, so with steady traffic the heap holds all of it, from the window's first
request on; what can escape it is a burst of slow requests early in a window that then gets
far busier than the last one, or a tail past the cap. Those are still counted (from the
histogram), just not attributed.

Everything slow happens on the telemetry side: `rotate` computes the closed window's
percentiles with numpy over the histogram's counts array (the pure-Python mean/stdev of hdrh
walk every bucket and take ~50 ms — GIL time the worker would wait for), adds it to the
since-start totals and, given a `CoreSampler`, attributes the window's outliers. The sampler's
ring must reach back over the whole window for that: `CoreSampler.ensure_horizon`, which the
telemetry loop calls with its interval.

All times are `time.perf_counter()` seconds (CLOCK_MONOTONIC on Linux, as the engine uses).

Coordinated omission: a periodic model (a camera at 30 fps) whose worker stalls for 1 s does
not submit the 30 requests it would have in that second, so a histogram of the requests that
did run hides the stall behind one slow sample. With `period_s` set, the total time is
recorded with hdrh's `record_corrected_value(value, expected_interval)`, which also records
value − period, value − 2·period, … down to the period: the requests the stall delayed, as
HdrHistogram does it. Only the total phase is corrected (the count then includes those
back-filled requests); queue and compute stay what the requests that ran measured.
"""

from __future__ import annotations

import heapq
import math
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram

from edged.telemetry.attribution import Outlier, attribution
from edged.telemetry.batches import Waking
from edged.telemetry.sampler import CoreSampler

LOWEST_US = 1
HIGHEST_US = 60_000_000  # 60 s; slower requests are recorded as 60 s, not dropped
SIGNIFICANT_DIGITS = 3
MAX_OUTLIERS = 1000  # spans kept per window; more are counted, not attributed
MIN_CANDIDATES = 16  # slowest spans kept per window at least ...
CANDIDATE_FRACTION = 0.02  # ... or this fraction of the window's count, up to max_outliers
PHASES = ("total", "queue", "compute")
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def _new_histogram() -> HdrHistogram:
    """An HdrHistogram that its owner's last reference frees. hdrh's encoder points back at
    its histogram, a reference cycle that holds the 139 KB counts array (a ctypes buffer)
    until the garbage collector's oldest generation runs; six per model made every model
    load/unload leave ~0.8 MB behind for tens of seconds, and the heap's high-water mark
    crept up with it. A weak back-reference keeps encode() working while the histogram
    lives."""
    h = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)
    h.encoder.histogram = weakref.proxy(h)
    return h


@cache
def _bucket_values() -> tuple[np.ndarray, np.ndarray]:
    """(highest equivalent value, median equivalent value) of every counts index, in µs —
    the values hdrh's get_value_at_percentile and get_mean_value use, as arrays."""
    h = _new_histogram()
    index = np.arange(h.counts_len, dtype=np.int64)
    half_mag = h.sub_bucket_half_count_magnitude
    bucket = (index >> half_mag) - 1
    sub = (index & (h.sub_bucket_half_count - 1)) + h.sub_bucket_half_count
    first = bucket < 0  # the first half-bucket: unit resolution from 0
    sub = np.where(first, sub - h.sub_bucket_half_count, sub)
    bucket = np.where(first, 0, bucket)
    lowest = sub << (bucket + h.unit_magnitude)
    size = np.int64(1) << (bucket + h.unit_magnitude)
    # float64 for the weighted sums below.
    return lowest + size - 1, (lowest + (size >> 1)).astype(np.float64)


def _range_stats(counts: np.ndarray, low: int, high: int) -> PhaseStats:
    """PhaseStats of `counts`, all of whose nonzero entries lie in [low, high)."""
    return PhaseStats.from_counts(counts, np.flatnonzero(counts[low:high]) + low)


def _counts(h: HdrHistogram) -> np.ndarray:
    """A view (no copy) of the histogram's counters."""
    return np.ctypeslib.as_array(h.counts)


@dataclass(frozen=True)
class PhaseStats:
    """One phase of one window. Times in ms; None when the window had no requests."""

    count: int = 0
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    max_ms: float | None = None
    mean_ms: float | None = None
    stdev_ms: float | None = None

    @property
    def jitter_ms(self) -> float | None:
        """p99 − p50: the spread of the tail."""
        if self.p99_ms is None or self.p50_ms is None:
            return None
        return round(self.p99_ms - self.p50_ms, 3)

    @classmethod
    def from_counts(cls, counts: np.ndarray, used: np.ndarray | None = None) -> PhaseStats:
        """`used`: np.flatnonzero(counts), when the caller has it."""
        # Over the buckets in use only: a window touches tens to hundreds of the 17 k, so
        # this is a few tens of µs instead of a few hundred (telemetry at 1 Hz makes four
        # of these a second per model, idle or not).
        if used is None:
            used = np.flatnonzero(counts)
        if not len(used):
            return cls()
        values = counts[used]
        total = int(values.sum())
        highest, median = _bucket_values()
        highest, median = highest[used], median[used]
        cumulative = np.cumsum(values)
        # hdrh's rule: the first bucket whose cumulative count reaches round(p% of total).
        targets = [max(int(p * total / 100 + 0.5), 1) for p in PERCENTILES]
        at = np.searchsorted(cumulative, targets, side="left")
        p50, p90, p99, p999 = (_ms(highest[i]) for i in at)
        weights = values.astype(np.float64)
        # Elementwise products and sums, not `@`: a matrix product goes through OpenBLAS,
        # whose worker threads then spin for a while after every call (10 % of a core at one
        # rotation a second, measured in the daemon).
        mean = float(np.sum(weights * median)) / total
        stdev = math.sqrt(float(np.sum(weights * (median - mean) ** 2)) / total)
        return cls(
            total,
            p50,
            p90,
            p99,
            p999,
            _ms(highest[-1]),
            round(mean / 1e3, 3),
            round(stdev / 1e3, 3),
        )

    def to_payload(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "p99_ms": self.p99_ms,
            "p999_ms": self.p999_ms,
            "max_ms": self.max_ms,
            "mean_ms": self.mean_ms,
            "stdev_ms": self.stdev_ms,
            "jitter_ms": self.jitter_ms,
        }


def _ms(us: Any) -> float:
    return round(int(us) / 1e3, 3)  # µs resolution is all the histogram holds


@dataclass
class WindowStats:
    """Stats of one telemetry window (or since start) of one model."""

    model: str
    start: float  # perf_counter() when the window opened
    end: float  # ... and closed
    total: PhaseStats
    queue: PhaseStats
    compute: PhaseStats
    outlier_threshold_ms: float | None = None  # this window's p99; None: empty window
    outlier_count: int = 0  # recorded values above the threshold (incl. back-filled ones)
    outlier_spans: list[Outlier] = field(default_factory=list)  # at most MAX_OUTLIERS
    outliers: dict[str, int] = field(default_factory=dict)  # cause -> outliers it touched
    # Over the outliers attributed to "preempted": the worker's involuntary switches and its
    # time off the CPU while they computed, and their wake-up delays.
    preempted_switches: int = 0
    preempted_off_cpu_ms: float = 0.0
    preempted_wake_ms: float = 0.0

    @property
    def count(self) -> int:
        return self.total.count

    @property
    def jitter_ms(self) -> float | None:
        return self.total.jitter_ms

    def to_payload(self) -> dict[str, Any]:
        """The model's entry under "models" in the telemetry payload."""
        payload = self.total.to_payload()
        payload["queue"] = self.queue.to_payload()
        payload["compute"] = self.compute.to_payload()
        payload["outlier_count"] = self.outlier_count
        payload["outliers"] = dict(self.outliers)
        payload["outlier_preemption"] = {
            "switches": self.preempted_switches,
            "off_cpu_ms": round(self.preempted_off_cpu_ms, 3),
            "wake_delay_ms": round(self.preempted_wake_ms, 3),
        }
        return payload


class LatencyRecorder:
    """Latency histograms of one model: the current window, and totals since start.

    `record` is for the worker thread, `rotate`/`since_start` for the telemetry thread. The
    lock they share is held for three histogram increments or for swapping two references,
    never while statistics are computed."""

    def __init__(
        self,
        model: str,
        cores: Sequence[int] | None = None,
        max_outliers: int = MAX_OUTLIERS,
        period_s: float | None = None,
    ) -> None:
        if period_s is not None and not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(
                f"LatencyRecorder({model!r}): period_s must be a positive "
                f"number of seconds, not {period_s!r}"
            )
        if max_outliers < 1:
            raise ValueError(f"LatencyRecorder({model!r}): max_outliers must be >= 1")
        self.model = model
        self.cores = tuple(cores) if cores else None  # where the worker runs; for attribution
        self.max_outliers = max_outliers
        self.period_s = period_s
        # hdrh's expected interval, in the histogram's unit (µs); at least 1 so the back-fill
        # loop ends.
        self._period_us = None if period_s is None else max(1, int(period_s * 1e6 + 0.5))
        self._lock = threading.Lock()
        self._active = [_new_histogram() for _ in PHASES]
        self._spare = [_new_histogram() for _ in PHASES]
        # Min-heap of the window's slowest spans: (total_s, start, end, switches, off_cpu_s,
        # wake_s, exact), the two times -1.0 when not known (floats, so tied entries still
        # compare); exact 1.0 when wake_s is the run queue's own figure (see `record`).
        self._candidates: list[tuple[float, float, float, int, float, float, float]] = []
        self._window_count = 0
        self._last_count = 0  # the previous window's, to size the heap from the start
        self._opened = time.perf_counter()
        self._stats_lock = threading.Lock()  # rotate vs since_start (telemetry side only)
        self._since_start = [np.zeros(self._active[0].counts_len, np.uint64) for _ in PHASES]
        # The counts indexes in use since start, per phase: [low, high), so statistics scan
        # that range, not all 17 k counters (np.flatnonzero over them is ≈50 µs each).
        self._since_range = [(0, 0) for _ in PHASES]
        self._started = self._opened

    def record(
        self,
        total_s: float,
        queue_s: float,
        compute_s: float,
        start: float,
        end: float,
        switches: int = 0,
        off_cpu_s: float | None = None,
        waking: Waking | None = None,
    ) -> None:
        """One request: its phases in seconds, its compute span (perf_counter), and what
        `batch_end` said of the worker thread: its involuntary context switches and time off
        the CPU during that span (None: not measured), and how it got to the batch.

        From `waking`, the time the request was kept off the core. Where the kernel says it
        (schedstat's run-queue wait since the previous batch ended, edged.telemetry.batches.
        run_delay_ns), that exact figure: the wake-up's wait for a core and any wait during
        the batch. Otherwise an estimate: the part of its queue time after the worker was
        free (its previous batch had ended), i.e. from max(arrival, free) to start, counted
        only if the worker did not sleep again on the way (at most the one sleep waiting for
        work, or an involuntary switch): a second sleep is the GIL, a lock or a batching
        delay, not a busy core; and only beyond the window's usual queue time."""
        total_us = min(int(total_s * 1e6 + 0.5), HIGHEST_US)
        queue_us = min(int(queue_s * 1e6 + 0.5), HIGHEST_US)
        compute_us = min(int(compute_s * 1e6 + 0.5), HIGHEST_US)
        off = -1.0 if off_cpu_s is None else off_cpu_s
        wake, exact = -1.0, 0.0
        if waking is not None:
            free_at, involuntary, voluntary, waited = waking
            if waited is not None:
                wake, exact = max(0.0, waited), 1.0
            elif involuntary > 0 or voluntary <= 1:
                wake = max(0.0, start - max(start - queue_s, free_at))
        with self._lock:
            total, queue, compute = self._active
            if self._period_us is None:
                total.record_value(total_us)
            else:
                total.record_corrected_value(total_us, self._period_us)
            queue.record_value(queue_us)
            compute.record_value(compute_us)
            self._window_count += 1
            heap = self._candidates
            keep = min(
                self.max_outliers,
                max(
                    MIN_CANDIDATES,
                    int(max(self._window_count, self._last_count) * CANDIDATE_FRACTION),
                ),
            )
            if len(heap) < keep:
                heapq.heappush(heap, (total_s, start, end, switches, off, wake, exact))
            elif total_s > heap[0][0]:
                heapq.heapreplace(heap, (total_s, start, end, switches, off, wake, exact))

    def rotate(self, sampler: CoreSampler | None = None, batch_delay_s: float = 0.0) -> WindowStats:
        """Close the current window, open the next, and return the closed one's stats (its
        outliers attributed when `sampler` is given). `batch_delay_s`: the worker's
        max_queue_delay, a wait that is meant and never counts as being kept off the core."""
        with self._stats_lock:
            spare = self._spare
            with self._lock:
                closed, self._active = self._active, spare
                candidates, self._candidates = self._candidates, []
                self._last_count, self._window_count = self._window_count, 0
                opened, self._opened = self._opened, time.perf_counter()
            closed_at = self._opened
            phases = []
            above = 0  # total-phase values in buckets above p99's
            for index, (histogram, totals) in enumerate(
                zip(closed, self._since_start, strict=True)
            ):
                if not histogram.total_count:  # an idle window: nothing to add or reset
                    phases.append(PhaseStats())
                    continue
                counts = _counts(histogram)
                # The buckets in use, between the indexes of its min and max: all the work
                # below. (hdrh's own index function; _bucket_values mirrors its layout too.)
                low = histogram._counts_index_for(histogram.min_value)
                high = histogram._counts_index_for(histogram.max_value) + 1
                used = np.flatnonzero(counts[low:high]) + low
                was = self._since_range[index]
                self._since_range[index] = (min(low, was[0]) if was[1] else low, max(high, was[1]))
                phases.append(PhaseStats.from_counts(counts, used))
                if len(phases) == 1 and phases[0].p99_ms is not None:
                    top = round(phases[0].p99_ms * 1e3)  # p99's bucket's highest value, µs
                    above = int(counts[used[_bucket_values()[0][used] > top]].sum())
                totals[used] += counts[used]
                counts[used] = 0  # and the histogram's own bookkeeping, for its next use:
                histogram.total_count, histogram.max_value = 0, 0
                histogram.min_value = sys.maxsize  # hdrh's "no value yet"
            self._spare = closed
        threshold_ms = phases[0].p99_ms
        outliers: list[Outlier] = []
        if threshold_ms is not None:
            # Slowest first, so the kept spans are the worst when the cap bites.
            # A wake-up delay counts above what the window's requests usually wait (the
            # cross-CPU wake-up, the batch forming) and any batching delay.
            usual = max(batch_delay_s, (phases[1].p50_ms or 0.0) / 1e3)
            outliers = [
                (
                    start,
                    end,
                    switches,
                    None if off < 0 else off,
                    None if wake < 0 else wake if exact else max(0.0, wake - usual),
                )
                for total_s, start, end, switches, off, wake, exact in sorted(
                    candidates, reverse=True
                )
                if total_s * 1e3 > threshold_ms
            ]
        stats = WindowStats(
            self.model,
            opened,
            closed_at,
            phases[0],
            phases[1],
            phases[2],
            outlier_threshold_ms=threshold_ms,
            outlier_count=max(above, len(outliers)),
            outlier_spans=outliers,
        )
        if sampler is not None and outliers:
            found = attribution(outliers, self.cores, sampler.samples(), max_gap=sampler.max_gap_s)
            stats.outliers = found.causes
            stats.preempted_switches = found.preempted_switches
            stats.preempted_off_cpu_ms = round(found.preempted_off_cpu_s * 1e3, 3)
            stats.preempted_wake_ms = round(found.preempted_wake_s * 1e3, 3)
        return stats

    def since_start(self, include_open: bool = True, total_only: bool = False) -> WindowStats:
        """Totals over every request so far, the open window included unless `include_open`
        is false: then up to the last `rotate`, so that a payload's since-start count is
        exactly the sum of the windows published so far. `total_only`: queue and compute
        are left empty (telemetry publishes only the total since start)."""
        with self._stats_lock:
            if not include_open:
                phases = [
                    _range_stats(totals, *self._since_range[i])
                    if not total_only or i == 0
                    else PhaseStats()
                    for i, totals in enumerate(self._since_start)
                ]
                return WindowStats(
                    self.model, self._started, self._opened, phases[0], phases[1], phases[2]
                )
            with self._lock:  # a copy of 3 × 17 k counters: some µs
                open_counts = [_counts(h).copy() for h in self._active]
            phases = [
                PhaseStats.from_counts(totals + counts)
                for totals, counts in zip(self._since_start, open_counts, strict=True)
            ]
        return WindowStats(
            self.model, self._started, time.perf_counter(), phases[0], phases[1], phases[2]
        )
