"""Attribution of slow requests (outliers) to what hit their core.

Attribution asks the worker's own exact figures first (edged.telemetry.batches: its context
switches and CPU clock around every batch): an outlier during which it was switched out
involuntarily and spent a large share of its compute time off the CPU, or that waited after
arrival for a core the worker could not get, was "preempted", whatever the interrupt counters
say; the telemetry loop then names the threads that ran on the model's cores
(edged.telemetry.loop.IntruderWatch). Only the other outliers are matched against per-CPU
counters (edged.telemetry.sampler.CoreSampler), whose resolution is the sampling period: an
outlier's [start, end] is widened to the last sample before it and the first after it, so a
cause seen up to one period (50 ms at 20 Hz) before or after the request is counted too. On a
core without nohz_full the timer tick is a hard interrupt and a TIMER softirq, so "irq" and
"softirq:TIMER" show up on most outliers longer than a tick; the rarer causes (NET_RX,
frequency, throttling) are the informative ones.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from edged.telemetry.sampler import Sample

# scaling_cur_freq is an estimate on intel_pstate and wobbles a little below the cap at full
# load; only a drop of more than this fraction counts as a frequency drop.
FREQ_DROP_TOLERANCE = 0.05
# An outlier whose worker was switched out involuntarily and spent at least this share of its
# compute time off the CPU was preempted: a tick's worth of kworker does not make 4 ms slow.
PREEMPTED_SHARE = 0.2
# A sample the first batch woke the sampler for may begin this late after the batch began
# (or a quarter of the batch's time, if more): the counters then miss at most that much of it.
WAKE_SLACK_S = 0.002

# One slow request: (start, end) of its compute span, the worker's involuntary switches and
# off-CPU seconds during it, and its wake-up delay kept off the core, beyond the usual
# (None: not measured). Shorter tuples (start, end, switches) are accepted too.
Outlier = tuple[float, ...] | tuple[float, float, int, float | None, float | None]


@dataclass
class Attribution:
    causes: dict[str, int]  # cause -> outliers it touched, most first
    preempted_switches: int = 0  # involuntary switches during the "preempted" outliers
    preempted_off_cpu_s: float = 0.0  # and the worker's time off the CPU during them
    preempted_wake_s: float = 0.0  # and their wake-up delays (beyond the usual)


def attribute(
    outliers: Iterable[Outlier],
    cores: Iterable[int] | None,
    samples: Sequence[Sample],
    max_gap: float | None = None,
) -> dict[str, int]:
    """cause -> outliers it touched; see `attribution`."""
    return attribution(outliers, cores, samples, max_gap).causes


def attribution(
    outliers: Iterable[Outlier],
    cores: Iterable[int] | None,
    samples: Sequence[Sample],
    max_gap: float | None = None,
) -> Attribution:
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
        start, end, switches = outlier[0], outlier[1], int(outlier[2])
        off_cpu = outlier[3] if len(outlier) > 3 else None
        wake = outlier[4] if len(outlier) > 4 else None
        causes: set[str] = set()
        computing = switches > 0 and (off_cpu is None or off_cpu >= PREEMPTED_SHARE * (end - start))
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
            before = (
                woke
                if (
                    woke < len(samples)
                    and samples[woke].woke
                    and start_times[woke] - start <= max(WAKE_SLACK_S, (end - start) / 4)
                    and done_times[woke] < end
                )
                else -1
            )
        after = bisect.bisect_left(start_times, end)
        if (
            before < 0
            or after >= len(samples)
            or (max_gap is not None and start_times[after] - end > max_gap)
        ):
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
                for cpu, (cur, top) in sample.freq.items()
                if cpu in on
            ):
                causes.add("freq_drop")
        counts.update(causes or {"unexplained"})
    result.causes = dict(counts.most_common())
    return result
