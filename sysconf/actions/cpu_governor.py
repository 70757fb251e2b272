"""Hold the inference cores at full clock: the cpufreq governor "performance" for their
policies, the answer to outliers telemetry blamed on "freq_drop" (the core ran slower for
them than for the rest). RISK medium: the policy may drive other cores too (said), and the
board runs hotter (watch the thermal figures)."""

from __future__ import annotations

from sysconf.actions import Evidence, Proposal
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot
from sysconf.tuning import governor_changes

NAME = "cpu-governor"
ANSWERS = ("freq_drop",)
RISK = "medium"


def propose(root: SysRoot, plan: CpuPlan, evidence: Evidence) -> Proposal | None:
    proposal = Proposal(NAME, evidence.cause, RISK)
    proposal.changes = governor_changes(root, sorted(plan.inference))
    if proposal.changes:
        proposal.expected = "the inference cores stop changing clock with load"
    else:
        proposal.blocked = (
            "no cpufreq policy here offers 'performance', or it is already in use: the clock "
            "drops come from elsewhere (thermal capping: see the thermal figures)"
        )
    return proposal
