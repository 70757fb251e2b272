"""The whole core-isolation plan for a root: IRQs, kernel noise, and the boot command line."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from sysconf.changes import Change
from sysconf.cpusets import CpuPlan
from sysconf.irq import Unmovable, plan_irqs
from sysconf.services import plan_trim
from sysconf.sysroot import SysRoot
from sysconf.tuning import plan_isolation


@dataclass(frozen=True)
class IsolationPlan:
    cpus: CpuPlan
    changes: list[Change]
    unmovable: list[Unmovable]

    def to_dict(self) -> dict:
        return {
            "cpus": self.cpus.to_dict(),
            "changes": [c.to_dict() for c in self.changes],
            "unmovable": [asdict(u) for u in self.unmovable],
        }


def plan(
    root: SysRoot,
    cpus: CpuPlan,
    boot_on_live: bool = False,
    trim: bool = False,
    keep: Iterable[str] = (),
    extra: Iterable[str] = (),
    realtime: bool = False,
) -> IsolationPlan:
    """IRQ moves first (they matter at once), then workqueues, governor, sysctls (with
    `realtime`, a SCHED_FIFO inference thread will run: RT throttling off too), THP, the
    boot command line (only into an image root, or live with `boot_on_live`), and last, with
    `trim`, the service masks (`sysconf.services.plan_trim`; `keep`/`extra` from [audit])."""
    irq_changes, unmovable = plan_irqs(root, cpus)
    masks = plan_trim(root, keep, extra) if trim else []
    tuning = plan_isolation(root, cpus, boot_on_live, realtime)
    return IsolationPlan(cpus, [*irq_changes, *tuning, *masks], unmovable)
