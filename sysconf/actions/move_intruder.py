"""Move the threads that took the inference cores to the housekeeping cores
(sched_setaffinity, through the journal: sysconf.task_affinity), the answer to outliers
telemetry blamed on "preempted" and whose intruders it named. Every thread of a named
process whose affinity reaches the inference cores moves (its other threads would land there
next). Never edged's own threads, never a kernel thread: those are per-CPU work (ksoftirqd,
kworker) that the workqueue mask and nohz_full answer, and the proposal says so.

RISK medium: another program's threads run elsewhere afterwards (its own pinning is
overridden until revert or its restart). Live threads only: an image has none, and a
CPUAffinity= drop-in for the intruder's unit is not built yet."""

from __future__ import annotations

import os

from sysconf.actions import Evidence, Proposal
from sysconf.change_records import Change
from sysconf.cpulist import format_cpulist, parse_cpulist
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot
from sysconf.task_affinity import KIND, TaskGone, current, is_kernel_thread, task_path

NAME = "move-intruder"
ANSWERS = ("preempted",)
RISK = "medium"


def _threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit())
    except OSError:
        return []


def propose(root: SysRoot, plan: CpuPlan, evidence: Evidence) -> Proposal | None:
    proposal = Proposal(NAME, evidence.cause, RISK)
    if not (root.is_live or evidence.live):
        proposal.blocked = (
            "the intruders are threads of a running system, and this is an image: "
            "move them on the device (the daemon's loop, or edgectl tune on it)"
        )
        return proposal
    if not evidence.intruders:
        proposal.blocked = "telemetry named no thread on the inference cores for these outliers"
        return proposal
    housekeeping = format_cpulist(plan.housekeeping)
    if not housekeeping:
        proposal.blocked = "no housekeeping core to move them to"
        return proposal
    inference = set(plan.inference)
    kernel, gone, moved = [], [], []
    for pid in dict.fromkeys(int(t["pid"]) for t in evidence.intruders):
        name = next(str(t.get("comm")) for t in evidence.intruders if int(t["pid"]) == pid)
        if pid == os.getpid():
            continue
        if is_kernel_thread(pid):
            kernel.append(f"{name}[{pid}]")
            continue
        for tid in _threads(pid) or [pid]:
            try:
                old, _ = current(pid, tid)
            except TaskGone:
                gone.append(f"{name}[{pid}]")
                break
            if not inference & set(parse_cpulist(old)):
                continue
            why = (
                f"{name}[{pid}] thread {tid} took the inference cores "
                f"{format_cpulist(inference)}: it moves to the housekeeping cores"
            )
            proposal.changes.append(Change(KIND, task_path(pid, tid), old, housekeeping, why))
            moved.append(f"{name}[{pid}]")
    if proposal.changes:
        proposal.expected = (
            f"{', '.join(dict.fromkeys(moved))} leave(s) the inference cores: "
            "the preempted outliers should go"
        )
    else:
        reasons = []
        if kernel:
            reasons.append(
                f"kernel threads {', '.join(kernel)} are per-CPU kernel work (the workqueue "
                "mask and nohz_full answer them, not a move)"
            )
        if gone:
            reasons.append(f"{', '.join(dict.fromkeys(gone))} ended")
        proposal.blocked = "; ".join(reasons) or "the named threads no longer reach these cores"
    return proposal
