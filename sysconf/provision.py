"""Provision an image root: the whole tuned configuration an image needs at its first boot.

`provision_plan` is `sysconf.isolation.plan(root, cpus, trim=True)` (IRQs, kernel noise, the
boot command line, the irqbalance ban list, the service masks) plus what survives a reboot:

- `/etc/sysctl.d/90-edged.conf`: the latency sysctls (`sysconf.tuning.SYSCTLS`), read by
  systemd-sysctl at every boot;
- `/etc/systemd/system.conf.d/90-edged-cpuaffinity.conf`: `[Manager] CPUAffinity=` the
  housekeeping cores, so every service starts off the inference cores;
- edged.service and edged-tune.service enabled (a symlink in multi-user.target.wants to the
  unit file, as `systemctl enable` makes it), after copying them from the repo's `systemd/`
  folder into `/etc/systemd/system` when the image does not carry them.

The plan's runtime changes (/proc, /sys) are kept, not dropped: a fixture or image root that
has those files gets them written too, so `edgectl audit --root` of the result is clean; on a
real image they are whatever the image holds and edged-tune.service re-applies them at boot.

Every change is a `Change` for the `Journal` (file content, or an "enable" symlink), so
`edgectl revert --root DIR` undoes provisioning exactly, and provisioning an already
provisioned root plans nothing. Folders that do not exist in the root are created by the
journal, which records them so revert removes them again.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import cast

from sysconf.changes import Change, read_current
from sysconf.cpulist import format_cpulist
from sysconf.cpusets import CpuPlan
from sysconf.isolation import IsolationPlan, plan
from sysconf.services import AFFINITY_DROPIN
from sysconf.sysroot import SysRoot
from sysconf.tuning import RT_THROTTLING, SYSCTLS

SYSCTL_CONF = "/etc/sysctl.d/90-edged.conf"
WANTS = "/etc/systemd/system/multi-user.target.wants"
UNITS = ("edged.service", "edged-tune.service")
# Where systemd finds a unit, first wins (/etc overrides the vendor folders).
UNIT_DIRS = ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system")
REPO_UNITS = Path(__file__).resolve().parent.parent / "systemd"


def sysctl_conf(realtime: bool = False) -> str:
    """The latency sysctls; with `realtime` (a model has rt_priority) RT throttling off too."""
    lines = ["# Written by edgectl provision: latency sysctls for the inference cores.\n"]
    for name, value, _why in (*SYSCTLS, *((RT_THROTTLING,) if realtime else ())):
        lines.append(f"{name} = {value}\n")
    return "".join(lines)


def affinity_dropin(cpus: CpuPlan) -> str:
    return (
        "# Written by edgectl provision: services start on the housekeeping cores.\n"
        # The empty assignment first: systemd merges CPUAffinity= lines across system.conf
        # and its drop-ins, so without it the image's own setting would stay allowed.
        f"[Manager]\nCPUAffinity=\nCPUAffinity={format_cpulist(sorted(cpus.housekeeping))}\n"
    )


# The image's files are read through `root.files`, links resolved inside the image (never the
# host's), as the journal that writes them resolves them.


def _file(root: SysRoot, kind: str, path: str, new: str, reason: str) -> list[Change]:
    old = root.files.read(path)
    return [] if old == new else [Change(kind, path, old, new, reason)]


def _unit_path(root: SysRoot, unit: str) -> str | None:
    return next((f"{d}/{unit}" for d in UNIT_DIRS if root.files.is_file(f"{d}/{unit}")), None)


def _units(root: SysRoot, units_dir: Path) -> list[Change]:
    changes = []
    for unit in UNITS:
        target = _unit_path(root, unit)
        if target is None:
            source = units_dir / unit
            if not source.is_file():
                continue
            target = f"/etc/systemd/system/{unit}"
            text = cast(str, read_current(source))  # a file: is_file() above
            changes.append(
                Change(
                    "unit",
                    target,
                    None,
                    text,
                    f"{unit} is not in the image: installed from {source}",
                )
            )
        link = f"{WANTS}/{unit}"
        current = root.files.readlink(link) if root.files.is_link(link) else None
        if current != target:
            changes.append(
                Change(
                    "enable",
                    f"{WANTS}/{unit}",
                    current,
                    target,
                    f"enable {unit} (systemctl enable: WantedBy=multi-user."
                    "target) so it starts at boot",
                )
            )
    return changes


def provision_plan(
    root: SysRoot,
    cpus: CpuPlan,
    keep: Iterable[str] = (),
    extra: Iterable[str] = (),
    units_dir: Path = REPO_UNITS,
    realtime: bool = False,
) -> IsolationPlan:
    """The isolation plan with trim, plus the persistent configuration (see the module doc).
    Image roots only: on the live system it raises ValueError."""
    if root.is_live:
        raise ValueError(
            "provision writes an image root; give --root DIR (on the live system "
            "use edgectl apply and systemctl)"
        )
    base = plan(
        root, cpus, boot_on_live=False, trim=True, keep=keep, extra=extra, realtime=realtime
    )
    persistent = [
        *_file(
            root,
            "sysctl-conf",
            SYSCTL_CONF,
            sysctl_conf(realtime),
            "the latency sysctls at every boot (systemd-sysctl reads /etc/sysctl.d)",
        ),
        *_file(
            root,
            "systemd-conf",
            AFFINITY_DROPIN,
            affinity_dropin(cpus),
            "systemd starts every service on the housekeeping cores "
            f"{format_cpulist(sorted(cpus.housekeeping))}",
        ),
        *_units(root, units_dir),
    ]
    return IsolationPlan(base.cpus, [*base.changes, *persistent], base.unmovable)


def provision_changes(
    root: SysRoot,
    cpus: CpuPlan,
    keep: Iterable[str] = (),
    extra: Iterable[str] = (),
    units_dir: Path = REPO_UNITS,
) -> list[Change]:
    return provision_plan(root, cpus, keep, extra, units_dir).changes
