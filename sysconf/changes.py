"""Planned changes to a system and the journal that applies and reverts them.

Every change is "this file gets this exact content": IRQ affinities, sysctls under /proc/sys,
workqueue masks and governors under /sys, the irqbalance defaults file and the boot command
line alike. That one shape makes revert exact: the journal records the old content, fsynced,
before each write, so `revert` restores what was there (or removes a file that was not),
also after a crash half-way through `apply`.

Journal: JSON lines, append-only, in the state dir. Records: {"op": "set", "path", "old",
"new"} before a write, {"op": "skipped", "path", "reason"} when the kernel refused it (EIO
from a managed IRQ, EINVAL), {"op": "done"} when an apply finished. `revert` walks the records
backwards and writes every `old` of a `set` that was not skipped, then moves the journal
aside, so a second revert finds nothing to do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sysconf.sysroot import SysRoot

JOURNAL_NAME = "tuning-journal.jsonl"
# Errors that mean "the kernel will not take this value here", not "edged is broken".
REFUSED = {errno.EIO: "EIO", errno.EINVAL: "EINVAL", errno.EPERM: "EPERM",
           errno.EACCES: "EACCES", errno.EBUSY: "EBUSY", errno.ENOTSUP: "ENOTSUP"}


@dataclass(frozen=True)
class Change:
    kind: str  # "irq", "irq-default", "irqbalance", "workqueue", "governor", "sysctl", "thp",
    #            "cmdline"
    path: str  # as on the device, e.g. /proc/irq/24/smp_affinity_list
    old: str | None  # current content (None: the file does not exist)
    new: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ApplyResult:
    applied: list[Change] = field(default_factory=list)
    unchanged: list[Change] = field(default_factory=list)
    skipped: list[tuple[Change, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "applied": [c.to_dict() for c in self.applied],
            "unchanged": [c.to_dict() for c in self.unchanged],
            "skipped": [{**c.to_dict(), "why": why} for c, why in self.skipped],
        }


Writer = Callable[[Path, str, bool], None]


def is_kernel_file(device_path: str) -> bool:
    """/proc and /sys files are kernel interfaces: written in place, one write()."""
    return device_path.startswith(("/proc/", "/sys/"))


def write_file(path: Path, content: str, kernel: bool) -> None:
    """For kernel files the write itself is the change. Regular files (boot config,
    irqbalance defaults) go through a temporary file, fsync and rename, so a crash never
    leaves them half-written."""
    if kernel:
        with open(path, "w") as f:
            f.write(content)
        return
    tmp = path.with_name(f".{path.name}.edged-tmp")
    with open(tmp, "w") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    with contextlib.suppress(OSError):
        os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def same_value(current: str | None, new: str) -> bool:
    """Kernel files echo values with a trailing newline and sometimes other spacing."""
    return current is not None and current.strip() == new.strip()


class Journal:
    def __init__(self, root: SysRoot, state_dir: str = "/var/lib/edged",
                 writer: Writer = write_file) -> None:
        """`state_dir` is as seen on the device: with an image root the journal lives inside
        that root, so the image carries its own journal."""
        self.root = root
        self.path = root.path(state_dir) / JOURNAL_NAME
        self._write = writer

    # -- recording ---------------------------------------------------------------------------
    def _append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # the old value is on disk before the new one is written

    def records(self) -> list[dict]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except ValueError:
                if number == len(lines):
                    break  # a crash mid-append: the last line is partial, its write never ran
                raise ValueError(f"{self.path}: line {number} is not a journal record") from None
        return records

    # -- apply / revert ----------------------------------------------------------------------
    def apply(self, changes: Iterable[Change]) -> ApplyResult:
        result = ApplyResult()
        for change in changes:
            target = self.root.path(change.path)
            current = self.root.read_text(change.path)
            if same_value(current, change.new):
                result.unchanged.append(change)
                continue
            if current is None and not target.parent.is_dir():
                why = f"{target.parent} does not exist"
                result.skipped.append((change, why))
                continue
            self._append({"op": "set", "path": change.path, "old": current,
                          "new": change.new, "kind": change.kind, "ts": time.time()})
            try:
                self._write(target, change.new, is_kernel_file(change.path))
            except OSError as exc:
                why = f"{REFUSED.get(exc.errno, errno.errorcode.get(exc.errno, '?'))}: " \
                      f"{exc.strerror or exc}"
                self._append({"op": "skipped", "path": change.path, "reason": why})
                result.skipped.append((change, why))
                continue
            result.applied.append(change)
        self._append({"op": "done", "ts": time.time()})
        return result

    def revert(self) -> list[tuple[str, str]]:
        """Restore every recorded old value, newest first. Returns (path, action) pairs."""
        records = self.records()
        done: list[tuple[str, str]] = []
        for index in range(len(records) - 1, -1, -1):
            record = records[index]
            if record.get("op") != "set":
                continue
            following = records[index + 1] if index + 1 < len(records) else {}
            if following.get("op") == "skipped" and following.get("path") == record["path"]:
                continue  # the write was refused: nothing to undo
            target = self.root.path(record["path"])
            old = record.get("old")
            try:
                if old is None:
                    target.unlink(missing_ok=True)
                    done.append((record["path"], "removed"))
                else:
                    self._write(target, old, is_kernel_file(record["path"]))
                    done.append((record["path"], "restored"))
            except OSError as exc:
                done.append((record["path"], f"failed: {exc.strerror or exc}"))
        if records:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            self.path.rename(self.path.with_name(f"{JOURNAL_NAME}.reverted-{stamp}"))
        return done

    def pending(self) -> bool:
        """True while an apply is recorded and not reverted."""
        return any(r.get("op") == "set" for r in self.records())


def plan_summary(changes: Sequence[Change]) -> dict:
    return {"changes": [c.to_dict() for c in changes]}
