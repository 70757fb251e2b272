"""Confine the kernel's unbound workqueues (and writeback) to the housekeeping cores: the
workqueue cpumask files, as `edgectl apply` sets them, here as the answer to "preempted"
outliers whose named intruders are unbound kernel workers (kworker/u*: filesystem, crypto
and block completion work), which move-intruder cannot move (kernel threads). Per-CPU
kworkers (kworker/N:M) are bound to their CPU: no mask moves them, and the proposal says so."""

from __future__ import annotations

from sysconf.actions import Evidence, Proposal
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot
from sysconf.tuning import workqueue_changes

NAME = "workqueue-mask"
ANSWERS = ("preempted",)
RISK = "low"


def propose(root: SysRoot, plan: CpuPlan, evidence: Evidence) -> Proposal | None:
    workers = [str(t.get("comm", "")) for t in evidence.intruders]
    unbound = [w for w in workers if w.startswith("kworker/u")]
    if not unbound:
        bound = [w for w in workers if w.startswith("kworker/")]
        if not bound:
            return None  # no kernel worker named: not this action's cause
        proposal = Proposal(NAME, evidence.cause, RISK)
        proposal.blocked = (
            f"{', '.join(bound[:3])}: per-CPU kernel workers, bound to their CPU; only "
            "isolcpus/nohz_full at boot (edgectl apply --boot) keeps their work away"
        )
        return proposal
    proposal = Proposal(NAME, evidence.cause, RISK)
    proposal.changes = workqueue_changes(root, list(plan.housekeeping))
    if proposal.changes:
        proposal.expected = (
            f"unbound kernel work ({', '.join(unbound[:3])}) leaves the inference cores"
        )
    else:
        proposal.blocked = (
            "the workqueue masks already hold only the housekeeping cores (or this kernel has none)"
        )
    return proposal
