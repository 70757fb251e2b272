"""Per-model latency statistics and the attribution of slow requests to what hit their core.

The worker thread calls `LatencyRecorder.record` once per request: three HdrHistogram
`record_value`s (integer microseconds, 1 µs – 60 s, 3 significant digits) under a lock that
the telemetry thread only holds to swap two histogram sets, plus, for a request among the
window's slowest so far, a push on a small bounded heap of candidate spans. Measured on the
dev VM: ~3 µs a call (see tests/test_latency.py, which prints the figure).

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

Attribution resolution is the sampling period: an outlier's [start, end] is widened to the
last sample before it and the first after it, so a cause seen up to one period (20 ms at
50 Hz) before or after the request is counted too. On a core without nohz_full the timer tick
is a hard interrupt and a TIMER softirq, so "irq" and "softirq:TIMER" show up on most outliers
longer than a tick; the rarer causes (NET_RX, preemption, frequency) are the informative ones.

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

from sysconf.intrusions import interrupts_per_cpu, softirqs_per_cpu
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

Outlier = tuple[float, float, int]  # (start, end, involuntary switches during the request)


def thread_involuntary_switches() -> int:
    """Involuntary context switches of the calling thread so far (one getrusage, ~0.4 µs).

    The worker reads it before and after a request; a difference > 0 means the scheduler
    took the core away from it while the request ran."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


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
    def from_counts(cls, counts: np.ndarray) -> PhaseStats:
        total = int(counts.sum())
        if total == 0:
            return cls()
        highest, median = _bucket_values()
        cumulative = np.cumsum(counts)
        # hdrh's rule: the first bucket whose cumulative count reaches round(p% of total).
        targets = [max(int(p * total / 100 + 0.5), 1) for p in PERCENTILES]
        at = np.searchsorted(cumulative, targets, side="left")
        p50, p90, p99, p999 = (_ms(highest[i]) for i in at)
        weights = counts.astype(np.float64)
        # Elementwise products and sums, not `@`: a matrix product goes through OpenBLAS,
        # whose worker threads then spin for a while after every call (10 % of a core at one
        # rotation a second, measured in the daemon).
        mean = float(np.sum(weights * median)) / total
        stdev = math.sqrt(float(np.sum(weights * (median - mean) ** 2)) / total)
        last = int(np.flatnonzero(counts)[-1])
        return cls(total, p50, p90, p99, p999, _ms(highest[last]), round(mean / 1e3, 3),
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
        # Min-heap of the window's slowest spans: (total_s, start, end, switches).
        self._candidates: list[tuple[float, float, float, int]] = []
        self._window_count = 0
        self._last_count = 0  # the previous window's, to size the heap from the start
        self._opened = time.perf_counter()
        self._stats_lock = threading.Lock()  # rotate vs since_start (telemetry side only)
        self._since_start = [np.zeros(self._active[0].counts_len, np.uint64) for _ in PHASES]
        self._started = self._opened

    def record(self, total_s: float, queue_s: float, compute_s: float, start: float,
               end: float, switches: int = 0) -> None:
        """One request: its phases in seconds, its span (perf_counter) and the involuntary
        context switches of the worker thread while it ran."""
        total_us = min(int(total_s * 1e6 + 0.5), HIGHEST_US)
        queue_us = min(int(queue_s * 1e6 + 0.5), HIGHEST_US)
        compute_us = min(int(compute_s * 1e6 + 0.5), HIGHEST_US)
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
                heapq.heappush(heap, (total_s, start, end, switches))
            elif total_s > heap[0][0]:
                heapq.heapreplace(heap, (total_s, start, end, switches))

    def rotate(self, sampler: CoreSampler | None = None) -> WindowStats:
        """Close the current window, open the next, and return the closed one's stats (its
        outliers attributed when `sampler` is given)."""
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
            for histogram, totals in zip(closed, self._since_start, strict=True):
                counts = _counts(histogram)
                phases.append(PhaseStats.from_counts(counts))
                if len(phases) == 1 and phases[0].p99_ms is not None:
                    top = round(phases[0].p99_ms * 1e3)  # p99's bucket's highest value, µs
                    above = int(counts[_bucket_values()[0] > top].sum())
                totals += counts
                counts[:] = 0  # and the histogram's own bookkeeping, for its next use:
                histogram.total_count, histogram.max_value = 0, 0
                histogram.min_value = sys.maxsize  # hdrh's "no value yet"
            self._spare = closed
        threshold_ms = phases[0].p99_ms
        outliers: list[Outlier] = []
        if threshold_ms is not None:
            # Slowest first, so the kept spans are the worst when the cap bites.
            outliers = [(start, end, switches) for total_s, start, end, switches
                        in sorted(candidates, reverse=True) if total_s * 1e3 > threshold_ms]
        stats = WindowStats(
            self.model, opened, closed_at, *phases, outlier_threshold_ms=threshold_ms,
            outlier_count=max(above, len(outliers)), outlier_spans=outliers)
        if sampler is not None and outliers:
            stats.outliers = attribute(outliers, self.cores, sampler.samples())
        return stats

    def since_start(self, include_open: bool = True) -> WindowStats:
        """Totals over every request so far, the open window included unless `include_open`
        is false: then up to the last `rotate`, so that a payload's since-start count is
        exactly the sum of the windows published so far."""
        with self._stats_lock:
            if not include_open:
                phases = [PhaseStats.from_counts(totals) for totals in self._since_start]
                return WindowStats(self.model, self._started, self._opened, *phases)
            with self._lock:  # a copy of 3 × 17 k counters: some µs
                open_counts = [_counts(h).copy() for h in self._active]
            phases = [PhaseStats.from_counts(totals + counts)
                      for totals, counts in zip(self._since_start, open_counts, strict=True)]
        return WindowStats(self.model, self._started, time.perf_counter(), *phases)


# -- what happened on the cores --------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """Counters of the watched CPUs, read between `t` and `t_done` (perf_counter)."""

    t: float
    t_done: float
    irqs: dict[int, int]  # cpu -> hard interrupts since boot
    softirqs: dict[int, dict[str, int]]  # cpu -> kind -> count since boot
    freq: dict[int, tuple[int, int]] | None = None  # cpu -> (cur kHz, max kHz)
    throttled: bool | None = None


FreqReader = Callable[[Sequence[int]], dict[int, tuple[int, int]]]


def cpufreq_reader(root: SysRoot | None = None) -> FreqReader:
    """Reads scaling_cur_freq and scaling_max_freq of the given CPUs (CPUs without cpufreq,
    as in most VMs, are left out)."""
    root = root or SysRoot()

    def read(cpus: Sequence[int]) -> dict[int, tuple[int, int]]:
        result = {}
        for cpu in cpus:
            base = f"/sys/devices/system/cpu/cpu{cpu}/cpufreq"
            cur, top = root.read_line(f"{base}/scaling_cur_freq"), \
                root.read_line(f"{base}/scaling_max_freq")
            if cur and top and cur.isdigit() and top.isdigit():
                result[cpu] = (int(cur), int(top))
        return result

    return read


class CoreSampler:
    """Samples per-CPU interrupt and softirq counters (and optionally cpufreq and a throttle
    flag) at a fixed rate into a ring buffer, on a housekeeping thread.

    One sample reads /proc/interrupts and /proc/softirqs: ~150 µs on the dev VM (36 rows,
    2 CPUs), so 0.75 % of a core at 50 Hz, more with many IRQ rows. The sampler's thread should
    run on a housekeeping core: it holds the GIL while it parses."""

    def __init__(self, cpus: Iterable[int] | None = None, rate_hz: float = 50.0,
                 horizon_s: float = 10.0, root: SysRoot | None = None,
                 freq: FreqReader | None = None,
                 throttled: Callable[[], bool] | None = None,
                 cpu_affinity: Iterable[int] | None = None) -> None:
        if rate_hz <= 0 or horizon_s <= 0:
            raise ValueError("rate_hz and horizon_s must be positive")
        self.cpus = frozenset(cpus) if cpus is not None else None  # None: every CPU
        self.period_s = 1.0 / rate_hz
        self.root = root or SysRoot()
        self._freq = freq
        self._throttled = throttled
        self._affinity = set(cpu_affinity) if cpu_affinity else None
        self._ring: collections.deque[Sample] = collections.deque(
            maxlen=max(2, math.ceil(horizon_s * rate_hz)))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0  # samples that failed to read; the sampler keeps going

    def sample_once(self) -> Sample:
        t = time.perf_counter()
        irqs = interrupts_per_cpu(self.root)
        softirqs = softirqs_per_cpu(self.root)
        if self.cpus is not None:
            irqs = {cpu: n for cpu, n in irqs.items() if cpu in self.cpus}
            softirqs = {cpu: k for cpu, k in softirqs.items() if cpu in self.cpus}
        freq = self._freq(sorted(irqs)) if self._freq else None
        throttled = bool(self._throttled()) if self._throttled else None
        sample = Sample(t, time.perf_counter(), irqs, softirqs, freq, throttled)
        self._ring.append(sample)
        return sample

    @property
    def horizon_s(self) -> float:
        """How far back the ring reaches once full."""
        return (self._ring.maxlen or 0) * self.period_s

    def ensure_horizon(self, seconds: float) -> float:
        """Grow the ring to reach back at least `seconds` (a telemetry window and a margin,
        so `rotate` can attribute the window's first outliers too), up to MAX_SAMPLER_RING
        samples; returns the horizon now kept. Outliers older than it count as "unsampled"."""
        want = min(MAX_SAMPLER_RING, math.ceil(seconds / self.period_s))
        if want > (self._ring.maxlen or 0):
            self._ring = collections.deque(self._ring, maxlen=want)  # one swap, GIL-atomic
        return self.horizon_s

    def latest(self) -> Sample | None:
        """The newest sample, if any (no copy of the ring)."""
        try:
            return self._ring[-1]
        except IndexError:
            return None

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
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _loop(self) -> None:
        if self._affinity:
            os.sched_setaffinity(0, self._affinity)  # this thread only
        next_at = time.perf_counter()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # a read that fails once must not end sampling
                self.errors += 1
            # Fixed-rate schedule: a late sample does not shift the ones after it.
            next_at += self.period_s
            delay = next_at - time.perf_counter()
            if delay < 0:
                next_at = time.perf_counter()
                delay = 0
            self._stop.wait(delay)


def attribute(outliers: Iterable[Outlier], cores: Iterable[int] | None,
              samples: Sequence[Sample]) -> dict[str, int]:
    """For each outlier, the causes seen on `cores` while it ran; returns cause -> outliers.

    An outlier's [start, end] is bracketed by the last sample read wholly before `start` and
    the first begun after `end` (so the resolution is the sampling period). Causes: "irq"
    (hard interrupts), "softirq:KIND" (per softirq kind: NET_RX, TIMER, ...), "preempted"
    (the worker was switched out involuntarily), "freq_drop" (a core below its max frequency
    in a sample of the bracket), "throttle" (the throttle flag set in one). An outlier with
    none of them is "unexplained"; one the samples do not bracket (sampler not running, or
    the ring buffer has moved past it) and not preempted is "unsampled". `cores` None: every
    sampled CPU (for an unpinned worker; coarse)."""
    counts: collections.Counter[str] = collections.Counter()
    wanted = None if cores is None else set(cores)
    done_times = [s.t_done for s in samples]
    start_times = [s.t for s in samples]
    for start, end, switches in outliers:
        causes: set[str] = set()
        if switches > 0:
            causes.add("preempted")
        before = bisect.bisect_right(done_times, start) - 1
        after = bisect.bisect_left(start_times, end)
        if before < 0 or after >= len(samples):
            counts.update(causes or {"unsampled"})
            continue
        first, last = samples[before], samples[after]
        on = wanted if wanted is not None else set(last.irqs)
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
    return dict(counts.most_common())
