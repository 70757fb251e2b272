"""Intrusion counters: what takes a core away from inference, as the kernel counts it.

Per CPU: interrupts (all rows of /proc/interrupts) and softirqs by kind (/proc/softirqs); per
thread: voluntary and involuntary context switches (/proc/<pid>/task/<tid>/status). All are
monotonic kernel counters; rates come from deltas (Prometheus' rate(), or `rates` here for
the jitter benchmark and telemetry windows).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sysconf.irq import GLOBAL_COUNTERS
from sysconf.sysroot import SysRoot


def interrupts_per_cpu(root: SysRoot) -> dict[int, int]:
    """{cpu: interrupts so far}: the column sums of /proc/interrupts, without the system-wide
    ERR/MIS rows. Telemetry's sampler calls this 20 times a second, so it sums the count
    columns of each line directly instead of building sysconf.irq's full rows (chip, hwirq,
    trigger, actions): parsing went from ≈55 to ≈20 µs on the dev VM (the kernel takes
    ≈60 µs to produce the file); tests check both agree."""
    lines = (root.read_text("/proc/interrupts", "") or "").splitlines()
    if not lines:
        return {}
    cpus = [int(tok[3:]) for tok in lines[0].split() if tok.startswith("CPU") and tok[3:].isdigit()]
    totals = [0] * len(cpus)
    for line in lines[1:]:
        key, colon, rest = line.partition(":")
        key = key.strip()
        if not colon or not key or " " in key or key in GLOBAL_COUNTERS:
            continue
        for index, token in enumerate(rest.split(None, len(cpus))[:len(cpus)]):
            if not token.isdigit():
                break
            totals[index] += int(token)
    return dict(zip(cpus, totals, strict=True))


def softirqs_per_cpu(root: SysRoot) -> dict[int, dict[str, int]]:
    """{cpu: {"TIMER": n, "NET_RX": n, ...}} from /proc/softirqs."""
    text = root.read_text("/proc/softirqs", "") or ""
    lines = text.splitlines()
    if not lines:
        return {}
    cpus = [int(name[3:]) for name in lines[0].split() if name.startswith("CPU")]
    result: dict[int, dict[str, int]] = {cpu: {} for cpu in cpus}
    for line in lines[1:]:
        kind, _, counts = line.partition(":")
        for cpu, value in zip(cpus, counts.split(), strict=False):
            if value.isdigit():
                result[cpu][kind.strip()] = int(value)
    return result


@dataclass(frozen=True)
class Switches:
    voluntary: int
    involuntary: int  # preempted: something else wanted this core


def thread_switches(tid: int, pid: int | None = None, root: SysRoot | None = None
                    ) -> Switches | None:
    """Context switches of one thread (None when it has ended)."""
    root = root or SysRoot()
    status = root.read_text(f"/proc/{pid or os.getpid()}/task/{tid}/status")
    if status is None:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        return Switches(int(fields["voluntary_ctxt_switches"]),
                        int(fields["nonvoluntary_ctxt_switches"]))
    except (KeyError, ValueError):
        return None


def rates(before: dict[int, int], after: dict[int, int], seconds: float) -> dict[int, float]:
    """Per-second rates between two samples of a per-CPU counter."""
    return {cpu: (after[cpu] - before.get(cpu, 0)) / seconds for cpu in after} \
        if seconds > 0 else {}
