"""Steer received-packet processing off the inference cores: each network queue's rps_cpus
set to the housekeeping cores, the answer to outliers blamed on "softirq:NET_RX" (the NIC's
IRQ may be managed or shared, but the protocol work RPS moves is not)."""

from __future__ import annotations

from sysconf.actions import Evidence, Proposal
from sysconf.changes import Change
from sysconf.cpulist import format_cpumask, parse_cpumask
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot

NAME = "net-rps"
ANSWERS = ("softirq:NET_RX",)
RISK = "low"


def propose(root: SysRoot, plan: CpuPlan, evidence: Evidence) -> Proposal | None:
    proposal = Proposal(NAME, evidence.cause, RISK)
    mask = format_cpumask(plan.housekeeping)
    for iface in sorted(root.listdir("/sys/class/net")):
        if iface == "lo":
            continue
        for queue in sorted(root.listdir(f"/sys/class/net/{iface}/queues")):
            if not queue.startswith("rx-"):
                continue
            path = f"/sys/class/net/{iface}/queues/{queue}/rps_cpus"
            current = root.read_line(path)
            if current is None:
                continue
            try:
                if set(parse_cpumask(current)) == set(plan.housekeeping):
                    continue
            except ValueError:
                pass
            why = (
                f"{iface} {queue}: packets' protocol work (NET_RX) runs where the interrupt "
                "came, the inference cores included; RPS hands it to the housekeeping cores"
            )
            proposal.changes.append(Change("rps", path, current, mask, why))
    if proposal.changes:
        proposal.expected = "NET_RX softirqs move to the housekeeping cores"
    else:
        proposal.blocked = "no receive queue to steer (or all already on housekeeping)"
    return proposal
