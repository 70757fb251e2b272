"""What the worker thread tells telemetry around every batch, and what the sampler follows.

Around every batch the worker reads its context switches (getrusage(RUSAGE_THREAD)) and its
CPU clock, and at its end the run queue's wait (`batch_begin` / `batch_end`, ≈6 µs a
batch): the exact figures that
edged.telemetry.attribution asks first when it attributes an outlier ("preempted"). The same
two calls keep the process's `Activity` (batches in flight, the last one's end), which the
CoreSampler (edged.telemetry.sampler) follows so that it samples only while a batch is in
flight (and two periods after): an idle daemon does not wake it at all.

All times are `time.perf_counter()` seconds (CLOCK_MONOTONIC on Linux, as the engine uses).
"""

from __future__ import annotations

import math
import os
import resource
import threading
import time
from collections.abc import Callable


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

# Per worker thread: (perf_counter, involuntary, voluntary switches, run-queue wait in ns or
# None) at its last batch's end, and its open schedstat file.
_last_batch = threading.local()
_getrusage, _RUSAGE_THREAD, _thread_time = (
    resource.getrusage,
    resource.RUSAGE_THREAD,
    time.thread_time,
)  # looked up once: these run twice a batch

# At a batch's start: (involuntary switches, voluntary switches, CPU seconds, _last_batch).
BatchUsage = tuple[int, int, float, tuple[float, int, int, int | None] | None]
# How the worker got to the batch: (free since: the previous batch's end, perf_counter;
# involuntary switches since then; voluntary switches since then; seconds it spent runnable
# but waiting for a core since then, wake-up and batch both: None where not known).
Waking = tuple[float, int, int, float | None]


def run_delay_ns() -> int | None:
    """The calling thread's time spent runnable on a run queue, waiting for a core, so far
    (the second field of /proc/thread-self/schedstat, kept by the scheduler whatever its
    policy: CFS or EEVDF). The file stays open per thread and is read with one pread
    (≈2 µs). None where the kernel has no schedstat (CONFIG_SCHED_INFO off).

    Why: a core shared with a busy thread may delay the worker before a batch rather than
    during it (EEVDF lets a woken thread wait for the other's slice to end, with no
    involuntary switch to count), and a delay every request has is the window's usual
    queue time, so neither switches nor queue times name it. The run queue's own clock does."""
    fd = getattr(_last_batch, "schedstat", None)
    if fd == -1:  # not on this kernel: asked once per thread
        return None
    try:
        if fd is None:
            fd = _last_batch.schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(fd, 96, 0).split()[1])
    except (OSError, ValueError, IndexError):
        _last_batch.schedstat = -1 if fd is None else fd
        return None


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


def batch_end(
    begun: BatchUsage, wall_s: float, activity: Activity = ACTIVITY
) -> tuple[int, float | None, Waking | None]:
    """After the batch: (involuntary switches during it, its off-CPU seconds, how the worker
    got to it) for `LatencyRecorder.record`. Off-CPU is `wall_s` minus the thread's CPU time:
    waiting for a core, a lock, the GIL or a runtime's own threads; without
    IRQ_TIME_ACCOUNTING never interrupt handling, which the kernel charges to the thread it
    interrupted. It only matters for a batch that was switched out involuntarily, so the
    clock is read again only then (None otherwise). Then the run queue's wait so far
    (`run_delay_ns`), for how the next batch was got to. Both ends together: four syscalls
    in the common case, ≈6 µs a batch on the dev VM (≈3 µs without the schedstat read,
    ≈1.1 µs for the two getrusage calls alone; tests/telemetry/test_latency.py prints it)."""
    usage = _getrusage(_RUSAGE_THREAD)
    involuntary, voluntary, cpu_before, last = begun
    switches = usage.ru_nivcsw - involuntary
    off_cpu = max(0.0, wall_s - (_thread_time() - cpu_before)) if switches else None
    delay = run_delay_ns()
    activity.end()
    _last_batch.end = (activity.last_end, usage.ru_nivcsw, usage.ru_nvcsw, delay)
    waking = None
    if last is not None:
        waited = None if delay is None or last[3] is None else (delay - last[3]) / 1e9
        waking = (last[0], involuntary - last[1], voluntary - last[2], waited)
    return switches, off_cpu, waking
