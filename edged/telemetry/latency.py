"""Per-model latency statistics and the attribution of slow requests to what hit their core.

The worker thread calls `LatencyRecorder.record` once per request: three HdrHistogram
`record_value`s (integer microseconds, 1 µs – 60 s, 3 significant digits) under a lock that
the telemetry thread only holds to swap two histogram sets, plus, for a request among the
window's slowest so far, a push on a small bounded heap of candidate spans. Measured on the
dev VM: 3-8 µs a call, as loaded as the shared VM is (tests/test_latency.py prints it).

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

Attribution asks the worker's own exact figures first. Around every batch the worker reads
its context switches (getrusage(RUSAGE_THREAD)) and its CPU clock (`batch_begin` /
`batch_end`, ≈3 µs a batch): an outlier during which it was switched out involuntarily and
spent a large share of its compute time off the CPU, or that waited after arrival for a core
the worker could not get, was "preempted", whatever the interrupt counters say; the telemetry
loop then names the threads that ran on the model's cores (telemetry.IntruderWatch). Only the
other outliers are matched against per-CPU counters, whose resolution is the sampling period:
an outlier's [start, end] is widened to the last sample before it and the first after it, so
a cause seen up to one period (50 ms at 20 Hz) before or after the request is counted too. On
a core without nohz_full the timer tick is a hard interrupt and a TIMER softirq, so "irq" and
"softirq:TIMER" show up on most outliers longer than a tick; the rarer causes (NET_RX,
frequency, throttling) are the informative ones. The counter sampler runs only while a batch
is in flight (and two periods after): an idle daemon does not wake it at all (`Activity`).

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

import bisect
import collections
import contextlib
import heapq
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram

from sysconf.intrusions import CounterTable, interrupt_table, softirq_table
from sysconf.sysroot import SysRoot

LOWEST_US = 1
HIGHEST_US = 60_000_000  # 60 s; slower requests are recorded as 60 s, not dropped
SIGNIFICANT_DIGITS = 3
MAX_OUTLIERS = 1000  # spans kept per window; more are counted, not attributed
MIN_CANDIDATES = 16  # slowest spans kept per window at least ...
CANDIDATE_FRACTION = 0.02  # ... or this fraction of the window's count, up to max_outliers
MAX_SAMPLER_RING = 2400  # CoreSampler samples at most (2 min at 20 Hz; ~2 KB each)
PHASES = ("total", "queue", "compute")
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
# scaling_cur_freq is an estimate on intel_pstate and wobbles a little below the cap at full
# load; only a drop of more than this fraction counts as a frequency drop.
FREQ_DROP_TOLERANCE = 0.05
# An outlier whose worker was switched out involuntarily and spent at least this share of its
# compute time off the CPU was preempted: a tick's worth of kworker does not make 4 ms slow.
PREEMPTED_SHARE = 0.2
SAMPLER_TAIL_PERIODS = 2  # the sampler keeps going this many periods after the last batch
# With a CPU budget, the sampler measures its own thread's CPU time over this much busy time
# and lengthens its period to stay within the budget, down to MIN_SAMPLER_HZ.
BUDGET_WINDOW_S = 1.0
MIN_SAMPLER_HZ = 5.0
MAX_GAP_PERIODS = 3  # a bracketing sample further than this from the request is too coarse
# A sample the first batch woke the sampler for may begin this late after the batch began
# (or a quarter of the batch's time, if more): the counters then miss at most that much of it.
WAKE_SLACK_S = 0.002

# One slow request: (start, end) of its compute span, the worker's involuntary switches and
# off-CPU seconds during it, and its wake-up delay kept off the core, beyond the usual
# (None: not measured). Shorter tuples (start, end, switches) are accepted too.
Outlier = tuple[float, ...] | tuple[float, float, int, float | None, float | None]


def thread_involuntary_switches() -> int:
    """Involuntary context switches of the calling thread so far (one getrusage, ~0.5 µs)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class Activity:
    """Batches in flight in this process, and when the last one ended: what the CoreSampler
    follows, so that it samples only while some model has work (and a short tail after) and
    an idle daemon has no sampler wake-ups at all. Workers reach it through `batch_begin` /
    `batch_end`: one uncontended lock each; the parked sampler is notified only then.

    A worker abandoned inside a hung runtime never ends its batch: the sampler then keeps
    sampling, as it always did before it learnt to park."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.inflight = 0
        self.batches = 0  # begun so far
        self.last_end = -math.inf  # perf_counter() of the last batch's end
        self._parked = 0

    def begin(self) -> None:
        with self._lock:  # the plain lock's C-level enter/exit: ≈0.2 µs
            self.inflight += 1
            self.batches += 1
            if self._parked:
                self._cond.notify_all()

    def end(self) -> None:
        with self._lock:
            self.inflight = max(0, self.inflight - 1)
            self.last_end = time.perf_counter()

    def park_if_idle(self, tail_s: float, stopped: Callable[[], bool]) -> bool:
        """When no batch is in flight and none ended in the last `tail_s`, block until one
        begins (or `stopped()`, after `wake`); True if it blocked. The check and the wait
        are under the lock `begin` takes, so no batch can slip between them."""
        with self._cond:
            if self.inflight or time.perf_counter() - self.last_end <= tail_s:
                return False
            seen = self.batches
            self._parked += 1
            try:
                while self.batches == seen and not stopped():
                    self._cond.wait()
            finally:
                self._parked -= 1
            return True

    def wake(self) -> None:
        """Let parked samplers look at their stop flag."""
        with self._cond:
            self._cond.notify_all()


ACTIVITY = Activity()  # this process's models (one daemon per process)

# Per worker thread: (perf_counter, involuntary, voluntary switches) at its last batch's end.
_last_batch = threading.local()
_getrusage, _RUSAGE_THREAD, _thread_time = resource.getrusage, resource.RUSAGE_THREAD, \
    time.thread_time  # looked up once: these run twice a batch

# At a batch's start: (involuntary switches, voluntary switches, CPU seconds, _last_batch).
BatchUsage = tuple[int, int, float, tuple[float, int, int] | None]
# How the worker got to the batch: (free since: the previous batch's end, perf_counter;
# involuntary switches since then; voluntary switches since then).
Waking = tuple[float, int, int]


def batch_begin(activity: Activity = ACTIVITY) -> BatchUsage:
    """On the worker thread as a batch starts: wakes a parked CoreSampler, and returns the
    thread's context switches and CPU time so far (for `batch_end`).

    CPU time comes from CLOCK_THREAD_CPUTIME_ID (`time.thread_time`), not from getrusage's
    ru_utime + ru_stime: the kernel brings the running thread's runtime up to date only at a
    tick or a switch, so getrusage read by the thread itself lags by up to a tick (0-4 ms
    measured on a 3.7 ms busy loop at HZ=250: no use against a 4 ms request), while the
    clock is exact. getrusage gives the switch counts."""
    activity.begin()
    usage = _getrusage(_RUSAGE_THREAD)
    return usage.ru_nivcsw, usage.ru_nvcsw, _thread_time(), getattr(_last_batch, "end", None)


def batch_end(begun: BatchUsage, wall_s: float, activity: Activity = ACTIVITY
              ) -> tuple[int, float | None, Waking | None]:
    """After the batch: (involuntary switches during it, its off-CPU seconds, how the worker
    got to it) for `LatencyRecorder.record`. Off-CPU is `wall_s` minus the thread's CPU time:
    waiting for a core, a lock, the GIL or a runtime's own threads; without
    IRQ_TIME_ACCOUNTING never interrupt handling, which the kernel charges to the thread it
    interrupted. It only matters for a batch that was switched out involuntarily, so the
    clock is read again only then (None otherwise). Both ends together: three syscalls in
    the common case, ≈3 µs a batch on the dev VM against ≈1.1 µs for the two getrusage
    calls alone (tests/test_latency.py prints it)."""
    usage = _getrusage(_RUSAGE_THREAD)
    involuntary, voluntary, cpu_before, last = begun
    switches = usage.ru_nivcsw - involuntary
    off_cpu = max(0.0, wall_s - (_thread_time() - cpu_before)) if switches else None
    activity.end()
    _last_batch.end = (activity.last_end, usage.ru_nivcsw, usage.ru_nvcsw)
    waking = None if last is None else (last[0], involuntary - last[1], voluntary - last[2])
    return switches, off_cpu, waking


# -- statistics ------------------------------------------------------------------------------

def _new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)


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
        return cls(total, p50, p90, p99, p999, _ms(highest[-1]), round(mean / 1e3, 3),
                   round(stdev / 1e3, 3))

    def to_payload(self) -> dict[str, Any]:
        return {"count": self.count, "p50_ms": self.p50_ms, "p90_ms": self.p90_ms,
                "p99_ms": self.p99_ms, "p999_ms": self.p999_ms, "max_ms": self.max_ms,
                "mean_ms": self.mean_ms, "stdev_ms": self.stdev_ms,
                "jitter_ms": self.jitter_ms}


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
        payload["outlier_preemption"] = {"switches": self.preempted_switches,
                                         "off_cpu_ms": round(self.preempted_off_cpu_ms, 3),
                                         "wake_delay_ms": round(self.preempted_wake_ms, 3)}
        return payload


class LatencyRecorder:
    """Latency histograms of one model: the current window, and totals since start.

    `record` is for the worker thread, `rotate`/`since_start` for the telemetry thread. The
    lock they share is held for three histogram increments or for swapping two references,
    never while statistics are computed."""

    def __init__(self, model: str, cores: Sequence[int] | None = None,
                 max_outliers: int = MAX_OUTLIERS, period_s: float | None = None) -> None:
        if period_s is not None and not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"LatencyRecorder({model!r}): period_s must be a positive "
                             f"number of seconds, not {period_s!r}")
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
        # wake_s), the last two -1.0 when not known (floats, so tied entries still compare).
        self._candidates: list[tuple[float, float, float, int, float, float]] = []
        self._window_count = 0
        self._last_count = 0  # the previous window's, to size the heap from the start
        self._opened = time.perf_counter()
        self._stats_lock = threading.Lock()  # rotate vs since_start (telemetry side only)
        self._since_start = [np.zeros(self._active[0].counts_len, np.uint64) for _ in PHASES]
        # The counts indexes in use since start, per phase: [low, high), so statistics scan
        # that range, not all 17 k counters (np.flatnonzero over them is ≈50 µs each).
        self._since_range = [(0, 0) for _ in PHASES]
        self._started = self._opened

    def record(self, total_s: float, queue_s: float, compute_s: float, start: float,
               end: float, switches: int = 0, off_cpu_s: float | None = None,
               waking: Waking | None = None) -> None:
        """One request: its phases in seconds, its compute span (perf_counter), and what
        `batch_end` said of the worker thread: its involuntary context switches and time off
        the CPU during that span (None: not measured), and how it got to the batch.

        From `waking`, the request's wake-up delay: the part of its queue time after the
        worker was free (its previous batch had ended), i.e. from max(arrival, free) to
        start. It counts as time kept off the core only if the worker did not sleep again
        on the way (at most the one sleep waiting for work, or an involuntary switch): a
        second sleep is the GIL, a lock or a batching delay, not a busy core."""
        total_us = min(int(total_s * 1e6 + 0.5), HIGHEST_US)
        queue_us = min(int(queue_s * 1e6 + 0.5), HIGHEST_US)
        compute_us = min(int(compute_s * 1e6 + 0.5), HIGHEST_US)
        off = -1.0 if off_cpu_s is None else off_cpu_s
        wake = -1.0
        if waking is not None:
            free_at, involuntary, voluntary = waking
            if involuntary > 0 or voluntary <= 1:
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
            keep = min(self.max_outliers, max(MIN_CANDIDATES, int(
                max(self._window_count, self._last_count) * CANDIDATE_FRACTION)))
            if len(heap) < keep:
                heapq.heappush(heap, (total_s, start, end, switches, off, wake))
            elif total_s > heap[0][0]:
                heapq.heapreplace(heap, (total_s, start, end, switches, off, wake))

    def rotate(self, sampler: CoreSampler | None = None, batch_delay_s: float = 0.0
               ) -> WindowStats:
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
            for index, (histogram, totals) in enumerate(zip(closed, self._since_start,
                                                            strict=True)):
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
                self._since_range[index] = (min(low, was[0]) if was[1] else low,
                                            max(high, was[1]))
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
            outliers = [(start, end, switches, None if off < 0 else off,
                         None if wake < 0 else max(0.0, wake - usual))
                        for total_s, start, end, switches, off, wake
                        in sorted(candidates, reverse=True) if total_s * 1e3 > threshold_ms]
        stats = WindowStats(
            self.model, opened, closed_at, *phases, outlier_threshold_ms=threshold_ms,
            outlier_count=max(above, len(outliers)), outlier_spans=outliers)
        if sampler is not None and outliers:
            found = attribution(outliers, self.cores, sampler.samples(),
                                max_gap=sampler.max_gap_s)
            stats.outliers = found.causes
            stats.preempted_switches = found.preempted_switches
            stats.preempted_off_cpu_ms = round(found.preempted_off_cpu_s * 1e3, 3)
            stats.preempted_wake_ms = round(found.preempted_wake_s * 1e3, 3)
        return stats

    def since_start(self, include_open: bool = True, total_only: bool = False
                    ) -> WindowStats:
        """Totals over every request so far, the open window included unless `include_open`
        is false: then up to the last `rotate`, so that a payload's since-start count is
        exactly the sum of the windows published so far. `total_only`: queue and compute
        are left empty (telemetry publishes only the total since start)."""
        with self._stats_lock:
            if not include_open:
                phases = [_range_stats(totals, *self._since_range[i])
                          if not total_only or i == 0 else PhaseStats()
                          for i, totals in enumerate(self._since_start)]
                return WindowStats(self.model, self._started, self._opened, *phases)
            with self._lock:  # a copy of 3 × 17 k counters: some µs
                open_counts = [_counts(h).copy() for h in self._active]
            phases = [PhaseStats.from_counts(totals + counts)
                      for totals, counts in zip(self._since_start, open_counts, strict=True)]
        return WindowStats(self.model, self._started, time.perf_counter(), *phases)


# -- what happened on the cores --------------------------------------------------------------

@dataclass(slots=True)
class Sample:
    """Counters of the watched CPUs, read between `t` and `t_done` (perf_counter). Not
    frozen: a frozen dataclass's __init__ costs 3x, and the sampler makes 20 a second."""

    t: float
    t_done: float
    irqs: dict[int, int]  # cpu -> hard interrupts since boot
    softirqs: dict[int, dict[str, int]]  # cpu -> kind -> count since boot
    freq: dict[int, tuple[int, int]] | None = None  # cpu -> (cur kHz, max kHz)
    throttled: bool | None = None
    woke: bool = False  # the first sample after the sampler was parked: a batch had begun


FreqReader = Callable[[Sequence[int]], dict[int, tuple[int, int]]]


def cpufreq_reader(root: SysRoot | None = None) -> FreqReader:
    """Reads scaling_cur_freq and scaling_max_freq of the given CPUs (CPUs without cpufreq,
    as in most VMs, are left out). The files stay open on a live root (a pread from 0 reads
    them anew), as the sampler calls this 20 times a second."""
    root = root or SysRoot()
    files: dict[str, int] = {}

    def value(path: str) -> int | None:
        if not root.is_live:
            line = root.read_line(path)
            return int(line) if line and line.isdigit() else None
        try:
            fd = files.get(path)
            if fd is None:
                fd = files[path] = os.open(root.path(path), os.O_RDONLY | os.O_CLOEXEC)
            text = os.pread(fd, 64, 0).strip()
        except OSError:
            fd = files.pop(path, None)
            if fd is not None:
                os.close(fd)
            return None
        return int(text) if text.isdigit() else None

    def read(cpus: Sequence[int]) -> dict[int, tuple[int, int]]:
        result = {}
        for cpu in cpus:
            base = f"/sys/devices/system/cpu/cpu{cpu}/cpufreq"
            cur, top = value(f"{base}/scaling_cur_freq"), value(f"{base}/scaling_max_freq")
            if cur is not None and top is not None:
                result[cpu] = (cur, top)
        return result

    return read


class CoreSampler:
    """Samples per-CPU interrupt and softirq counters (and optionally cpufreq and a throttle
    flag) at a fixed rate into a ring buffer, on a housekeeping thread, while some model has
    a batch in flight and for a short tail after the last one (`SAMPLER_TAIL_PERIODS`, so the
    last request's end is bracketed). Between bursts it is parked on the process's `Activity`
    and not woken at all: an idle daemon pays nothing for it. `activity=None`: sample all
    the time (tests, benchmarks).

    One sample is a pread of /proc/interrupts and /proc/softirqs on files kept open, and
    parsing only the rows that changed since the last one (sysconf.intrusions.CounterTable):
    ≈60 µs on the dev VM (36 rows, 2 CPUs) in a tight loop, but ≈200 µs when the thread
    wakes with cold caches every 50 ms, plus 50-80 µs for the sleep and wake-up themselves;
    so with `cpu_budget` (a fraction of a core, the daemon's is 0.2 %) the sampler measures
    its own thread's CPU time and lengthens its period to stay within it, down to
    MIN_SAMPLER_HZ: `rate_hz` where samples are cheap, fewer where not (`period_s` is the
    period in effect, the attribution's resolution). The sampler's thread should run on a
    housekeeping core: it holds the GIL while it parses.

    The first sample after parking is taken as the waking batch starts, so that batch's
    counters are bracketed from the sampler's wake-up (`WAKE_SLACK_S`, or a quarter of the
    batch, at most after it began) rather than from the last busy spell."""

    def __init__(self, cpus: Iterable[int] | None = None, rate_hz: float = 50.0,
                 horizon_s: float = 10.0, root: SysRoot | None = None,
                 freq: FreqReader | None = None,
                 throttled: Callable[[], bool] | None = None,
                 cpu_affinity: Iterable[int] | None = None,
                 activity: Activity | None = ACTIVITY,
                 cpu_budget: float | None = None) -> None:
        if rate_hz <= 0 or horizon_s <= 0:
            raise ValueError("rate_hz and horizon_s must be positive")
        if cpu_budget is not None and not cpu_budget > 0:
            raise ValueError("cpu_budget must be a positive fraction of a core")
        self.cpus = frozenset(cpus) if cpus is not None else None  # None: every CPU
        self.base_period_s = self.period_s = 1.0 / rate_hz
        self.max_period_s = max(self.base_period_s, 1.0 / MIN_SAMPLER_HZ)
        self.cpu_budget = cpu_budget
        self.cpu_used = 0.0  # the sampler thread's CPU, fraction of a core, last measured
        self.root = root or SysRoot()
        self._freq = freq
        self._throttled = throttled
        self._affinity = set(cpu_affinity) if cpu_affinity else None
        self.activity = activity
        self._ring: collections.deque[Sample] = collections.deque(
            maxlen=max(2, math.ceil(horizon_s * rate_hz)))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._irq_table: CounterTable | None = None
        self._soft_table: CounterTable | None = None
        self.errors = 0  # samples that failed to read; the sampler keeps going
        self.iterations = 0  # times the sampling thread woke up to sample
        self.parks = 0  # times it parked because no batch was in flight

    def sample_once(self, woke: bool = False) -> Sample:
        if self._irq_table is None or self._soft_table is None:
            self._irq_table, self._soft_table = interrupt_table(self.root), \
                softirq_table(self.root)
        t = time.perf_counter()
        irqs = self._irq_table.totals() if self._irq_table.read() else {}
        softirqs = self._soft_table.by_key(self.cpus) if self._soft_table.read() else {}
        if self.cpus is not None:
            irqs = {cpu: n for cpu, n in irqs.items() if cpu in self.cpus}
        freq = self._freq(sorted(irqs)) if self._freq else None
        throttled = bool(self._throttled()) if self._throttled else None
        sample = Sample(t, time.perf_counter(), irqs, softirqs, freq, throttled, woke)
        self._ring.append(sample)
        return sample

    @property
    def tail_s(self) -> float:
        return SAMPLER_TAIL_PERIODS * self.period_s

    @property
    def max_gap_s(self) -> float:
        """How far a bracketing sample may be from a request (see `attribution`)."""
        return MAX_GAP_PERIODS * self.period_s

    @property
    def horizon_s(self) -> float:
        """How far back the ring reaches once full, at the base rate (in sampled time:
        parked spells and a slower rate make it reach further back in wall time)."""
        return (self._ring.maxlen or 0) * self.base_period_s

    def ensure_horizon(self, seconds: float) -> float:
        """Grow the ring to reach back at least `seconds` (a telemetry window and a margin,
        so `rotate` can attribute the window's first outliers too), up to MAX_SAMPLER_RING
        samples; returns the horizon now kept. Outliers older than it count as "unsampled"."""
        want = min(MAX_SAMPLER_RING, math.ceil(seconds / self.base_period_s))
        if want > (self._ring.maxlen or 0):
            self._ring = collections.deque(self._ring, maxlen=want)  # one swap, GIL-atomic
        return self.horizon_s

    def latest(self, max_age_s: float | None = None) -> Sample | None:
        """The newest sample, if any (no copy of the ring); with `max_age_s`, only if it
        began at most that long ago (a parked sampler's last sample is old)."""
        try:
            sample = self._ring[-1]
        except IndexError:
            return None
        if max_age_s is not None and time.perf_counter() - sample.t > max_age_s:
            return None
        return sample

    def samples(self) -> list[Sample]:
        """The ring buffer, oldest first (a copy; deque → list is atomic under the GIL)."""
        return list(self._ring)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="edged-coresampler",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.activity is not None:
            self.activity.wake()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        for table in (self._irq_table, self._soft_table):
            if table is not None:
                table.close()

    def _loop(self) -> None:
        name_thread("edged-sampler")
        if self._affinity:
            os.sched_setaffinity(0, self._affinity)  # this thread only
        next_at = mark_wall = time.perf_counter()
        mark_cpu = time.thread_time()
        while not self._stop.is_set():
            woke = False
            if self.activity is not None and self.activity.park_if_idle(
                    self.tail_s, self._stop.is_set):
                if self._stop.is_set():
                    break
                self.parks += 1
                woke = True
                next_at = mark_wall = time.perf_counter()  # parked time is not busy time
                mark_cpu = time.thread_time()
            self.iterations += 1
            try:
                self.sample_once(woke)
            except Exception:  # a read that fails once must not end sampling
                self.errors += 1
            now = time.perf_counter()
            if self.cpu_budget is not None and now - mark_wall >= BUDGET_WINDOW_S:
                cpu = time.thread_time()
                self._fit_budget((cpu - mark_cpu) / (now - mark_wall))
                mark_wall, mark_cpu = now, cpu
            # Fixed-rate schedule: a late sample does not shift the ones after it.
            next_at += self.period_s
            delay = next_at - time.perf_counter()
            if delay < 0:
                next_at = time.perf_counter()
                delay = 0
            # A plain sleep: cheaper to wake from than Event.wait (53 against 85 µs of CPU
            # measured for 50 ms); stop() waits for it, at most one period.
            time.sleep(delay)

    def _fit_budget(self, used: float) -> None:
        """`used`: the thread's CPU over the last busy stretch, fraction of a core. The
        period that spends the budget at this cost a sample, between the base period and
        MIN_SAMPLER_HZ's; 10 % headroom, so it settles instead of hovering at the edge."""
        assert self.cpu_budget is not None
        self.cpu_used = used
        per_sample = used * self.period_s
        self.period_s = min(self.max_period_s,
                            max(self.base_period_s, per_sample / self.cpu_budget * 1.1))


@cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def name_thread(name: str) -> None:
    """Name the calling OS thread (comm, 15 bytes: what top -H, ps -L and the intruder scan
    show) with prctl(PR_SET_NAME); cosmetic, so any failure is ignored."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


@dataclass
class Attribution:
    causes: dict[str, int]  # cause -> outliers it touched, most first
    preempted_switches: int = 0  # involuntary switches during the "preempted" outliers
    preempted_off_cpu_s: float = 0.0  # and the worker's time off the CPU during them
    preempted_wake_s: float = 0.0  # and their wake-up delays (beyond the usual)


def attribute(outliers: Iterable[Outlier], cores: Iterable[int] | None,
              samples: Sequence[Sample], max_gap: float | None = None) -> dict[str, int]:
    """cause -> outliers it touched; see `attribution`."""
    return attribution(outliers, cores, samples, max_gap).causes


def attribution(outliers: Iterable[Outlier], cores: Iterable[int] | None,
                samples: Sequence[Sample], max_gap: float | None = None) -> Attribution:
    """For each outlier, what took its time; returns cause -> outliers, and the preemption
    figures.

    First the worker's own exact figures: an outlier is "preempted" when the worker was
    switched out involuntarily and spent at least `PREEMPTED_SHARE` of its compute time off
    the CPU (for a 3-tuple outlier, without an off-CPU figure: any involuntary switch), or
    when its wake-up delay kept off the core (see `LatencyRecorder.record`) was at least
    that share of its time: woken for the request, the worker waited for a core another
    thread held. The interrupt counters are then not consulted for it: on a core with a
    timer tick they move during nearly every request, and would name the tick instead of
    the thread that took the core. For the rest, the counters on `cores`: the outlier's
    [start, end] is bracketed by the last sample read wholly before `start` and the first
    begun after `end` (so the resolution is the sampling period); causes "irq" (hard
    interrupts), "softirq:KIND" (NET_RX, TIMER, ...). For every outlier, "freq_drop" (a core
    below its max frequency in a sample of the bracket) and "throttle" (the throttle flag
    set in one). An outlier with none of them is "unexplained"; one the samples do not
    bracket (sampler parked or stopped, the ring moved past it, or, with `max_gap`, the
    nearest samples further than that from it) and not preempted is "unsampled". Where the
    sample before is too old, the sample the sampler took on waking for this batch stands in
    for it if it began within `WAKE_SLACK_S` (or a quarter of the outlier) of `start`.
    `cores` None: every sampled CPU (for an unpinned worker; coarse)."""
    counts: collections.Counter[str] = collections.Counter()
    result = Attribution({})
    wanted = None if cores is None else set(cores)
    done_times = [s.t_done for s in samples]
    start_times = [s.t for s in samples]
    for outlier in outliers:
        start, end, switches = outlier[0], outlier[1], outlier[2]
        off_cpu = outlier[3] if len(outlier) > 3 else None
        wake = outlier[4] if len(outlier) > 4 else None
        causes: set[str] = set()
        computing = switches > 0 and (off_cpu is None
                                      or off_cpu >= PREEMPTED_SHARE * (end - start))
        waking = wake is not None and wake >= PREEMPTED_SHARE * (wake + end - start)
        preempted = computing or waking
        if preempted:
            causes.add("preempted")
            result.preempted_switches += switches
            result.preempted_off_cpu_s += off_cpu or 0.0
            result.preempted_wake_s += wake or 0.0
        before = bisect.bisect_right(done_times, start) - 1
        if max_gap is not None and (before < 0 or start - done_times[before] > max_gap):
            woke = bisect.bisect_left(start_times, start)
            before = woke if (woke < len(samples) and samples[woke].woke
                              and start_times[woke] - start
                              <= max(WAKE_SLACK_S, (end - start) / 4)
                              and done_times[woke] < end) else -1
        after = bisect.bisect_left(start_times, end)
        if before < 0 or after >= len(samples) or (
                max_gap is not None and start_times[after] - end > max_gap):
            counts.update(causes or {"unsampled"})
            continue
        first, last = samples[before], samples[after]
        on = wanted if wanted is not None else set(last.irqs)
        if not preempted:
            if any(last.irqs.get(cpu, 0) > first.irqs.get(cpu, 0) for cpu in on):
                causes.add("irq")
            for cpu in on:
                old = first.softirqs.get(cpu, {})
                for kind, n in last.softirqs.get(cpu, {}).items():
                    if n > old.get(kind, 0):
                        causes.add(f"softirq:{kind}")
        for sample in samples[before : after + 1]:
            if sample.throttled:
                causes.add("throttle")
            if sample.freq and any(
                    cur < top * (1 - FREQ_DROP_TOLERANCE)
                    for cpu, (cur, top) in sample.freq.items() if cpu in on):
                causes.add("freq_drop")
        counts.update(causes or {"unexplained"})
    result.causes = dict(counts.most_common())
    return result
