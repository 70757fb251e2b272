"""What the change journal records and decides by: a planned `Change`, the result of
applying a plan, which errors mean "the kernel will not take this value", which kinds of
change outlive the tuning (go to the persistent journal), and the small checks on paths and
values both journals and their unit links share (sysconf.changes, sysconf.unit_links)."""

from __future__ import annotations

import errno
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sysconf.confined import temp_name

# Errors that mean "the kernel will not take this value here", not "edged is broken".
REFUSED = {
    errno.EIO: "EIO",
    errno.EINVAL: "EINVAL",
    errno.EPERM: "EPERM",
    errno.EACCES: "EACCES",
    errno.EBUSY: "EBUSY",
    errno.ENOTSUP: "ENOTSUP",
}


@dataclass(frozen=True)
class Change:
    kind: str  # "irq", "irq-default", "irqbalance", "workqueue", "governor", "sysctl", "thp",
    #            "cmdline", "mask" (a symlink to `new`, e.g. /dev/null: systemctl mask),
    #            "enable" (a symlink to the unit file `new`: systemctl enable)
    path: str  # as on the device, e.g. /proc/irq/24/smp_affinity_list
    old: str | None  # current content (None: the file does not exist)
    new: str
    reason: str
    # The file lists its choices with the current one in brackets ("always [madvise] never":
    # transparent hugepages, I/O schedulers) and takes one bare word on write. Writing the
    # whole listing back fails (EINVAL), so for such a file `old`, what the journal records and
    # what it compares with `new` are the bracketed word. The journal derives that word from
    # what it reads at apply time, not from the plan, so a stale plan cannot misrecord it.
    selector: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> Change:
        """A change from `to_dict`'s fields (a proposal's, a record's)."""
        return cls(data["kind"], data["path"], data["old"], data["new"], data["reason"])

    def to_dict(self) -> dict:
        """The plan JSON's fields (scripts rely on exactly these)."""
        return {
            "kind": self.kind,
            "path": self.path,
            "old": self.old,
            "new": self.new,
            "reason": self.reason,
        }


class UntrustedJournal(ValueError):
    """The journal (or a record in it) could have been written by someone other than the user
    who would act on it: reverting it could write anything anywhere as that user."""


@dataclass
class ApplyResult:
    applied: list[Change] = field(default_factory=list)
    unchanged: list[Change] = field(default_factory=list)
    skipped: list[tuple[Change, str]] = field(default_factory=list)
    # (path, action) of a stale journal from an older boot, handled before this apply.
    stale: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "applied": [c.to_dict() for c in self.applied],
            "unchanged": [c.to_dict() for c in self.unchanged],
            "skipped": [{**c.to_dict(), "why": why} for c, why in self.skipped],
            "stale": [{"path": p, "action": a} for p, a in self.stale],
        }


# A test's stand-in for the kernel: called with the host path of the file (every link on the
# way already resolved inside the root) instead of the journal's own confined write.
Writer = Callable[[Path, str, bool], None]


def is_kernel_file(device_path: str) -> bool:
    """/proc and /sys files are kernel interfaces: written in place, one write()."""
    return device_path.startswith(("/proc/", "/sys/"))


def selected_choice(text: str | None) -> str | None:
    """The bracketed word of a selector file ("always [madvise] never" -> "madvise"), or None
    when the text is not one (no or several bracketed words)."""
    if text is None:
        return None
    chosen = [w[1:-1] for w in text.split() if len(w) > 2 and w[0] == "[" and w[-1] == "]"]
    return chosen[0] if len(chosen) == 1 else None


# Changes whose `new` is a symlink target, not file content: "mask" (-> /dev/null) and
# "enable" (a *.wants/ link to the unit file, systemctl enable; edgectl provision).
LINK_KINDS = frozenset({"mask", "enable"})

# The kinds `outlives_tuning` sends to the persistent journal.
PERSISTENT_KINDS = frozenset(
    {
        "cmdline",  # the boot command line (cmdline.txt, extlinux.conf, /etc/default/grub)
        "mask",
        "enable",
        "unit",  # service masks, enable links and installed unit files
        "sysctl-conf",
        "systemd-conf",  # edgectl provision's /etc/sysctl.d and CPUAffinity drop-in
    }
)


def outlives_tuning(change: Change) -> bool:
    """Whether `change` goes to the persistent journal, not the tuning journal: the one rule.

    edged-tune.service applies the tuning at every start and reverts it at every stop
    (`edgectl revert --runtime`), and `retire_stale` reverts an older boot's tuning journal
    after a power cut. That is right for IRQ affinities, sysctls, governors, workqueue masks
    and the irqbalance ban list, which the service re-applies at the next start. It is wrong
    for the boot command line (isolcpus, nohz_full ... take effect only at the next boot, so
    reverting it at shutdown throws it away before the reboot that would use it), for service
    masks (`apply --trim`: meant to keep the units off across reboots) and for what
    `edgectl provision` writes for the first boot (units, enable links, sysctl.d, the
    CPUAffinity drop-in). Those kinds (`PERSISTENT_KINDS`) are undone only by a plain
    `edgectl revert`. The rule goes by kind alone, so a path is always in the same journal."""
    return change.kind in PERSISTENT_KINDS


def same_value(current: str | None, new: str) -> bool:
    """Kernel files echo values with a trailing newline and sometimes other spacing."""
    return current is not None and current.strip() == new.strip()


def _error_name(exc: OSError) -> str:
    name = REFUSED.get(exc.errno or 0) or errno.errorcode.get(exc.errno or 0, "?")
    return f"{name}: {exc.strerror or exc}"


def _target(path: str, target: str) -> dict:
    """The "target" field of a set record: the file a link on `path` led to, when it did."""
    return {} if target == path else {"target": target}


def _temp_device_path(device_path: str) -> str:
    folder, name = posixpath.split(device_path)
    return posixpath.join(folder, temp_name(name))


def _plain_path(path: object) -> bool:
    """An absolute device path without `..` or `.` parts: root.path() of anything else could
    reach outside the root it is joined to."""
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        return False
    return all(part not in ("..", ".") for part in path.split("/"))
