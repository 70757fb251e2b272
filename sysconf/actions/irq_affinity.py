"""Move the hard interrupts that land on the inference cores to the housekeeping cores
(their smp_affinity_list), as `edgectl apply` does for all of them, here as the answer to
outliers telemetry blamed on "irq". A kernel-managed IRQ (a multi-queue device's) cannot be
moved: then the proposal says so and names the remedy sysconf.irq knows for it."""

from __future__ import annotations

from sysconf.actions import Evidence, Proposal
from sysconf.cpusets import CpuPlan
from sysconf.irq import plan_irqs
from sysconf.sysroot import SysRoot

NAME = "irq-affinity"
ANSWERS = ("irq",)
RISK = "low"


def propose(root: SysRoot, plan: CpuPlan, evidence: Evidence) -> Proposal | None:
    changes, unmovable = plan_irqs(root, plan)
    moves = [c for c in changes if c.kind == "irq"]
    proposal = Proposal(NAME, evidence.cause, RISK)
    if moves:
        proposal.changes = changes
        proposal.expected = (
            f"{len(moves)} IRQ(s) leave CPUs {','.join(map(str, plan.inference))}: "
            "the outliers blamed on irq should go"
        )
    if unmovable:
        named = "; ".join(f"IRQ {u.irq} ({u.name}): {u.why}; {u.remedy}" for u in unmovable[:5])
        if not moves:
            proposal.blocked = f"every IRQ left on the inference cores is unmovable ({named})"
        else:
            proposal.expected += f"; unmovable still: {named}"
    if not moves and not unmovable:
        proposal.blocked = "no IRQ is routed to the inference cores any more"
    return proposal
