"""Complete block I/O on the CPU that submitted it: each block device's queue/rq_affinity set
to 2, the answer to outliers telemetry blamed on "softirq:BLOCK". With 1 (the default) a
completion may run its BLOCK softirq on any CPU of the submitter's group, the inference core
included, even when the I/O comes from work pinned elsewhere and the device's IRQ itself is
kernel-managed and cannot move. Measured on a 2-vCPU VM: 6,547 -> 80 BLOCK softirqs/s on the
inference core (docs/BENCHMARKS.md, jitter)."""

from __future__ import annotations

from sysconf.actions import Evidence, Proposal
from sysconf.changes import Change, same_value
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot

NAME = "block-rq-affinity"
ANSWERS = ("softirq:BLOCK",)
RISK = "low"


def propose(root: SysRoot, plan: CpuPlan, evidence: Evidence) -> Proposal | None:
    proposal = Proposal(NAME, evidence.cause, RISK)
    devices = sorted(root.listdir("/sys/block"))
    for device in devices:
        if device.startswith(("loop", "ram", "zram")):
            continue  # no hardware completion to steer
        path = f"/sys/block/{device}/queue/rq_affinity"
        current = root.read_line(path)
        if current is None or same_value(current, "2"):
            continue
        why = (
            f"{device}'s completions (BLOCK softirq) may run on any CPU of the submitter's "
            "group, the inference cores included; 2 completes them on the submitting CPU"
        )
        proposal.changes.append(Change("rq_affinity", path, current, "2", why))
    if proposal.changes:
        proposal.expected = "BLOCK softirqs follow the I/O to the CPUs that submit it"
    else:
        proposal.blocked = (
            "every block device already completes on the submitting CPU (rq_affinity 2)"
            if devices
            else "no block device in /sys/block"
        )
    return proposal
