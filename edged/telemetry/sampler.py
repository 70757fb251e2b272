"""The counter sampler: per-CPU interrupt and softirq counters (and cpufreq and throttle
state) of the inference cores, sampled into a ring while a batch is in flight, so that
edged.telemetry.attribution can blame an outlier on what hit its core. `SAMPLER_HZ` is the
daemon's rate (and the default); with a CPU budget it samples less where a sample is dear.

All times are `time.perf_counter()` seconds (CLOCK_MONOTONIC on Linux, as the engine uses).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from edged.telemetry.batches import ACTIVITY, Activity
from sysconf.intrusions import CounterTable, interrupt_table, softirq_table
from sysconf.sysroot import SysRoot

# The daemon's sampler: per-CPU counter samples for outlier attribution, while a batch is in
# flight, at this rate ...
SAMPLER_HZ = 20
SAMPLER_CPU_BUDGET = 0.002  # ... fewer where a sample costs more than this share of a core
MAX_SAMPLER_RING = 120 * SAMPLER_HZ  # samples at most (2 min at SAMPLER_HZ; ~2 KB each)
SAMPLER_TAIL_PERIODS = 2  # the sampler keeps going this many periods after the last batch
# With a CPU budget, the sampler measures its own thread's CPU time over this much busy time
# and lengthens its period to stay within the budget, down to MIN_SAMPLER_HZ.
BUDGET_WINDOW_S = 1.0
MIN_SAMPLER_HZ = 5.0
MAX_GAP_PERIODS = 3  # a bracketing sample further than this from the request is too coarse


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


def throttle_reader(root: SysRoot) -> Callable[[], bool] | None:
    """Is performance being cut right now: the Raspberry Pi firmware's throttle word says the
    ARM is slowed, or a cpufreq cooling device is engaged (a thermal cap; scaling_cur_freq
    may still equal the capped scaling_max_freq, so "freq_drop" alone would miss it).
    Where the files are is found once; each call reads a few small files (the sampler runs it
    at SAMPLER_HZ). None: this root has neither."""
    from sysconf.thermal import THERMAL_DIR, THROTTLED_GLOBS, THROTTLED_PATH, Throttled

    firmware = (
        THROTTLED_PATH
        if root.exists(THROTTLED_PATH)
        else next((path for pattern in THROTTLED_GLOBS for path in root.glob(pattern)), None)
    )
    cooling = [
        f"{THERMAL_DIR}/{name}/cur_state"
        for name in root.listdir(THERMAL_DIR)
        if name.startswith("cooling_device")
        and (root.read_line(f"{THERMAL_DIR}/{name}/type") or "").startswith(
            ("cpufreq-", "thermal-cpufreq-", "Processor")
        )
    ]
    if firmware is None and not cooling:
        return None

    def throttled() -> bool:
        if firmware is not None:
            word = root.read_line(firmware) or ""
            try:
                if Throttled(int(word, 16)).slowing_now:
                    return True
            except ValueError:
                pass  # unreadable this time: not known, not throttled
        for path in cooling:
            state = root.read_line(path) or ""
            if state.lstrip("-").isdecimal() and int(state) > 0:
                return True
        return False

    return throttled


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
    so with `cpu_budget` (a fraction of a core, the daemon's is SAMPLER_CPU_BUDGET: 0.2 %)
    the sampler measures its own thread's CPU time and lengthens its period to stay within
    it, down to MIN_SAMPLER_HZ: `rate_hz` where samples are cheap, fewer where not
    (`period_s` is the period in effect, the attribution's resolution). The sampler's thread
    should run on a housekeeping core: it holds the GIL while it parses.

    The first sample after parking is taken as the waking batch starts, so that batch's
    counters are bracketed from the sampler's wake-up (`attribution.WAKE_SLACK_S`, or a
    quarter of the batch, at most after it began) rather than from the last busy spell."""

    def __init__(
        self,
        cpus: Iterable[int] | None = None,
        rate_hz: float = SAMPLER_HZ,
        horizon_s: float = 10.0,
        root: SysRoot | None = None,
        freq: FreqReader | None = None,
        throttled: Callable[[], bool] | None = None,
        cpu_affinity: Iterable[int] | None = None,
        activity: Activity | None = ACTIVITY,
        cpu_budget: float | None = None,
    ) -> None:
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
            maxlen=max(2, math.ceil(horizon_s * rate_hz))
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._irq_table: CounterTable | None = None
        self._soft_table: CounterTable | None = None
        self.errors = 0  # samples that failed to read; the sampler keeps going
        self.iterations = 0  # times the sampling thread woke up to sample
        self.parks = 0  # times it parked because no batch was in flight

    def sample_once(self, woke: bool = False) -> Sample:
        if self._irq_table is None or self._soft_table is None:
            self._irq_table, self._soft_table = interrupt_table(self.root), softirq_table(self.root)
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
        self._thread = threading.Thread(target=self._loop, name="edged-coresampler", daemon=True)
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
                self.tail_s, self._stop.is_set
            ):
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
        self.period_s = min(
            self.max_period_s, max(self.base_period_s, per_sample / self.cpu_budget * 1.1)
        )


def inference_sampler(
    cpus: Iterable[int] | None, root: SysRoot, housekeeping: Iterable[int] | None
) -> CoreSampler:
    """The daemon's sampler: interrupt/softirq counters of the inference cores `cpus` (None:
    every CPU), plus their cpufreq and the throttle state (read from `root`), so outliers
    can be blamed on "freq_drop" and "throttle" as well as on interrupts. It samples only
    while a model has a batch in flight (and a tail of two periods after): parked, an idle
    daemon pays nothing for it; busy, it stays within SAMPLER_CPU_BUDGET of a core
    (SAMPLER_HZ where a sample is cheap, down to MIN_SAMPLER_HZ). Its thread runs on the
    `housekeeping` CPUs."""
    has_cpufreq = any(
        root.exists(f"/sys/devices/system/cpu/{name}/cpufreq")
        for name in root.listdir("/sys/devices/system/cpu")
        if name.startswith("cpu") and name[3:].isdecimal()
    )
    return CoreSampler(
        cpus,
        rate_hz=SAMPLER_HZ,
        root=root,
        freq=cpufreq_reader(root) if has_cpufreq else None,
        throttled=throttle_reader(root),
        cpu_affinity=housekeeping,
        activity=ACTIVITY,
        cpu_budget=SAMPLER_CPU_BUDGET,
    )


@cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def name_thread(name: str) -> None:
    """Name the calling OS thread (comm, 15 bytes: what top -H, ps -L and the intruder scan
    show) with prctl(PR_SET_NAME); cosmetic, so any failure is ignored."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
