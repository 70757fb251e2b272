"""Planned changes to a system and the journal that applies and reverts them.

Every change is "this file gets this exact content": IRQ affinities, sysctls under /proc/sys,
workqueue masks and governors under /sys, the irqbalance defaults file and the boot command
line alike. That one shape makes revert exact: the journal records the old content, fsynced,
before each write, so `revert` restores what was there (or removes a file that was not),
also after a crash half-way through `apply`. The one exception is a "mask" (a symlink to
/dev/null, systemctl mask): its record also keeps `old_link` (a symlink that was there) and
`old_mode`, and revert puts back exactly the symlink, file or nothing that was there. On the
live root a mask is `systemctl mask --now` built from the same record: the journal writes the
symlink itself, and the runtime half goes through `sysconf.systemctl.Systemctl` (see
`_apply_link`); its record also keeps `unit` and `was_active`, so revert unmasks, reloads and
starts only the units that ran before. "enable" links are refused on the live root.

Journal: JSON lines, append-only, in the state dir. Records: {"op": "set", "path", "old",
"new"} (and "target" when a link led elsewhere, see below) before a write, {"op": "skipped",
"path", "reason"} when the kernel refused it (EIO from a managed IRQ, EINVAL), {"op":
"done"} when an apply finished, {"op": "mkdir", "path"} (fsynced) before creating a missing
parent folder (never under /proc or /sys). `revert` walks the records backwards and writes
every `old` of a `set` that was not skipped, removes the folders it made (newest first, only
when empty), then moves the journal aside, so a second revert finds nothing to do.

Every "set" and "mkdir" record carries the boot id it was written in
(/proc/sys/kernel/random/boot_id, read through the root). A journal from an older boot (power
lost before `edgectl revert` ran) is stale: see `Journal.retire_stale`.

Two journals share the state dir (`Journals`): the tuning journal for what edged-tune.service
applies at start and takes back at stop, and the persistent journal for changes meant to
outlive that service (the boot command line, service masks, provisioned files: see
`outlives_tuning`). Stopping the service (`edgectl revert --runtime`) and retiring an older
boot's journal touch only the tuning journal; a plain `edgectl revert` restores both.

Root trusts the journal: `revert` writes each record's `old` to its `path`. So `apply` and
`revert` refuse (`UntrustedJournal`) a journal file or folder that another user owns or that
is group/world-writable, and records whose path is not a plain absolute path; on the live
system the journal lives in a root-only folder (edgectl: /var/lib/edged-tune, not the
daemon's /var/lib/edged, which the unprivileged daemon user owns).

An image root is someone else's file system, and its symlinks are data. Every file operation
of the journal (the old value's read, the write, unlink, rename, mkdir, symlink, and the
journal file's own) goes through one `sysconf.confined.ConfinedRoot`, which resolves each
path inside the root as openat2(RESOLVE_IN_ROOT) would: an absolute link means the image's
file, `..` stops at its top, so nothing, a crafted journal's records included, is written
outside it. A link on the way to a file is followed inside the root: apply writes the file it
leads to, the "set" record names that file as `target` (besides `path`, as planned), and
revert restores it there, leaving the link a link. Under /proc and /sys of an image only the
kernel's own shape of link is followed (relative, staying in that folder); a root with any
other link there is refused (`PathRefused`, a ValueError like `UntrustedJournal`) by
`check_trusted`, and so is a change or record leading through one, before anything is
written. So is a change or record whose file is a FIFO, socket or device node of the image,
and, at apply, a root where the plan's own reads met one (`check_read`): those are never
opened (sysconf.regular_files). An image's /proc and /sys are no live kernel: a kernel file
there is written in place only if the image holds it as a regular file, never created (a
missing one is skipped, ENOENT). The live root is used by plain paths, as it always was.

Values are compared and recorded as exact text (bytes decoded as UTF-8 with surrogateescape,
no newline translation), so a CRLF cmdline.txt or a Latin-1 comment comes back byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import stat
import time
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath

from sysconf import task_affinity
from sysconf.change_records import (  # noqa: F401  (also this module's API)
    LINK_KINDS,
    PERSISTENT_KINDS,
    REFUSED,
    ApplyResult,
    Change,
    UntrustedJournal,
    Writer,
    _error_name,
    _plain_path,
    _target,
    _temp_device_path,
    is_kernel_file,
    outlives_tuning,
    same_value,
    selected_choice,
)
from sysconf.confined import (  # noqa: F401  (read_current, temp_path: part of this API)
    ConfinedRoot,
    PathRefused,
    read_current,
    temp_name,
    temp_path,
    write_file,
    write_symlink,
)
from sysconf.sysroot import SysRoot
from sysconf.systemctl import Systemctl
from sysconf.unit_links import UnitLinks

JOURNAL_NAME = "tuning-journal.jsonl"
PERSISTENT_JOURNAL_NAME = "persistent-journal.jsonl"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


class Journal(UnitLinks):
    def __init__(
        self,
        root: SysRoot,
        state_dir: str = "/var/lib/edged",
        writer: Writer | None = None,
        systemctl: Systemctl | None = None,
        persistent: bool = False,
    ) -> None:
        """`state_dir` is as seen on the device: with an image root the journal lives inside
        that root, so the image carries its own journal. `writer` replaces the journal's own
        write of file content (tests simulate the kernel with it; default: `ConfinedRoot.write`).
        `systemctl` runs the runtime half of a live mask (default: the real `systemctl`); it
        is never called for an image root, and tests pass one with a fake runner (with a root
        whose `is_live` is true). `persistent`: the journal of changes meant to survive reboots
        (PERSISTENT_JOURNAL_NAME; see `outlives_tuning`): `retire_stale` leaves it alone.

        Every file operation, the journal's own included, goes through `self.files` (a
        `ConfinedRoot`): in an image root no symlink leads out of it (see sysconf.confined)."""
        self.root = root
        self.persistent = persistent
        name = PERSISTENT_JOURNAL_NAME if persistent else JOURNAL_NAME
        self.path = root.path(state_dir) / name  # as the host names it (messages, reports)
        self._folder = "/" + state_dir.strip("/")
        self._file = posixpath.join(self._folder, name)  # the device path it is used by
        self.files = ConfinedRoot(root.root, live=root.is_live, refused=root.refused)
        self._writer = None if writer is write_file else writer
        self._systemctl = systemctl
        self._boot_id: str | None = None

    @property
    def boot_id(self) -> str | None:
        """This boot's id, read through the root (None: the root has none, as an image)."""
        if self._boot_id is None:
            try:
                text = self.files.read(BOOT_ID)
            except (OSError, PathRefused):
                text = None
            self._boot_id = (text or "").strip().rstrip("\x00") or None
        return self._boot_id

    def _write(self, device_path: str, content: str, kernel: bool) -> None:
        if self._writer is not None:
            self._writer(self.files.host(device_path), content, kernel)
        else:
            self.files.write(device_path, content, kernel)

    def _resolve(self, device_path: str, follow: bool = True) -> str:
        """Where `device_path` leads inside the root (`ConfinedRoot.resolve`)."""
        return self.files.resolve(device_path, follow)

    def check_paths(self, paths: Iterable[tuple[str, bool]]) -> None:
        """Raise PathRefused for the first (device path, follow last link) the root refuses,
        a FIFO, socket or device node of an image included (NotRegularFile), before anything
        is written. Other errors (a link loop) are left to the operation, which records them
        as refused like any failed write."""
        for path, follow in paths:
            if task_affinity.is_task(path):
                continue  # a live thread, not a file of the root
            with contextlib.suppress(OSError):
                self._resolve(path, follow)
            self.files.check_file(path, follow)

    def check_read(self) -> None:
        """Raise PathRefused when a read of this root (the plan's, through the same SysRoot)
        met a FIFO, socket or device node, or a file too large, where it wanted a file: the
        plan had to leave that file out, so applying it would apply a plan of a root that is
        not what it seems (sysconf.regular_files). Before anything is written."""
        refused = list(dict.fromkeys(self.root.refused))
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise PathRefused(
                f"{refused[0]}{more}; the plan had to leave it out, so nothing was applied: "
                "make it a regular file or remove it from the image"
            )

    def check_trusted(self) -> None:
        """Refuse a journal that someone other than the acting user could have written.

        `revert` writes each record's `old` to its `path` as the acting user (root, from
        edged-tune.service), so whoever can rewrite the journal can make root write any file.
        The journal folder and file must be owned by the current euid and not be group- or
        world-writable, and the file must be a regular file (not a symlink). A missing file
        or folder is fine: `apply` creates them root-only.

        The journal acts inside its root, so a root it must not act in is refused here too:
        an image root with a symlink under /proc or /sys that is absolute or leads out of it
        (`ConfinedRoot.check_kernel_links`, PathRefused)."""
        self.files.check_kernel_links()
        euid = os.geteuid()
        for path, device, what in (
            (self.path.parent, self._folder, "folder"),
            (self.path, self._file, "file"),
        ):
            try:
                st = self.files.stat(device) if what == "folder" else self.files.lstat(device)
            except FileNotFoundError:
                continue
            problems = []
            if what == "folder" and not stat.S_ISDIR(st.st_mode):
                problems.append("is not a directory")
            if what == "file" and not stat.S_ISREG(st.st_mode):
                problems.append("is not a regular file (a symlink?)")
            if st.st_uid != euid:
                problems.append(f"is owned by uid {st.st_uid}, not by uid {euid} that acts on it")
            if st.st_mode & 0o022:
                problems.append(f"is group/world-writable (mode {stat.S_IMODE(st.st_mode):04o})")
            if problems:
                raise UntrustedJournal(
                    f"{path}: the journal {what} {' and '.join(problems)}; refusing to apply "
                    f"or revert through a journal another user could rewrite (check its "
                    f"records, then chown it to uid {euid} and chmod go-w)"
                )

    @property
    def systemctl(self) -> Systemctl:
        if self._systemctl is None:
            self._systemctl = Systemctl()
        return self._systemctl

    # -- recording ---------------------------------------------------------------------------
    def _append(self, record: dict) -> None:
        if record.get("op") in ("set", "mkdir") and self.boot_id is not None:
            record = {**record, "boot_id": self.boot_id}
        self.files.makedirs(self._folder, mode=0o755)
        created = not self.files.lexists(self._file)
        # Owner-only from the start (not the umask's 0664), so check_trusted accepts it.
        fd = self.files.open(self._file, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "a+b") as f:
            self._end_last_line(f)
            f.write(json.dumps(record).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())  # the old value is on disk before the new one is written
        if created:
            self.files.fsync_dir(self._folder)  # its own name survives a power cut too

    @staticmethod
    def _end_last_line(f) -> None:
        """A crash mid-append leaves a last line without its newline. Appending after it would
        glue the next record to it and turn it into a corrupt middle line, so drop it (its
        write never ran: the record was not fsynced yet), or end it if it is complete."""
        size = f.seek(0, os.SEEK_END)
        if not size:
            return
        f.seek(0)
        data = f.read()
        if data.endswith(b"\n"):
            return
        start = data.rfind(b"\n") + 1
        try:
            json.loads(data[start:])
        except ValueError:
            f.truncate(start)
        else:
            f.write(b"\n")

    def records(self) -> list[dict]:
        """The journal's records; ValueError naming the file (and line) for anything else."""
        data = self.files.read_bytes(self._file)
        if data is None:
            return []
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:  # json.dumps writes ASCII: this is not a journal
            number = data[: exc.start].count(b"\n") + 1
            raise ValueError(
                f"{self.path}: line {number} is not a journal record (not UTF-8 "
                f"text: byte {data[exc.start]:#04x} at offset {exc.start}); "
                f"refusing to act on it"
            ) from None
        records = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                if number == len(lines):
                    break  # a crash mid-append: the last line is partial, its write never ran
                record = None
            if (
                not isinstance(record, dict)
                or "op" not in record
                or (record["op"] in ("set", "mkdir") and "path" not in record)
            ):
                raise ValueError(f"{self.path}: line {number} is not a journal record")
            for key in ("path", "target"):
                path = record.get(key)
                if path is not None and not _plain_path(path):
                    raise UntrustedJournal(
                        f"{self.path}: line {number}: {key} {path!r} is not "
                        f"a plain absolute path; refusing to act on it"
                    )
            records.append(record)
        return records

    def checked_records(self) -> list[dict]:
        """`records` of a trusted journal whose paths the root does not refuse (PathRefused):
        what revert may act on, checked before it touches anything."""
        self.check_trusted()
        records = self.records()
        self.check_paths(
            (r.get("target") or r["path"], "new_link" not in r)
            for r in records
            if r.get("op") in ("set", "mkdir")
        )
        return records

    def _stale_boot(self, records: Sequence[dict]) -> str | None:
        """The older boot's id when `records` were written in another boot than this one
        ("unknown" for records without one), else None. A root without a boot id (an image)
        never has a stale journal: nothing reboots it between apply and revert."""
        current = self.boot_id
        if current is None:
            return None
        for record in records:
            if record.get("op") in ("set", "mkdir") and record.get("boot_id") != current:
                return str(record.get("boot_id") or "unknown")
        return None

    def retire_stale(self) -> list[tuple[str, str]]:
        """Deal with a journal left by an older boot (power lost, or a crash, before
        `edgectl revert` ran); returns (path, action) pairs, [] when the journal is current.

        Its /proc and /sys records are dropped, not written: the kernel reset those values at
        reboot, and their paths may now name something else (IRQ numbers are assigned at
        probe time), so writing a recorded `old` could misconfigure another device. Its
        file-backed records (/etc, the boot config, mask links, folders it made) are still in
        effect, so they are reverted exactly as `revert` would: the next apply then records
        the real original as `old` instead of the previous boot's `new`, and a later revert
        restores it. A unit a live mask stopped is unmasked but not started (it did not run
        this boot). The journal is then moved aside (`.stale-<time>`). Call this before
        planning, so the plan sees the restored files; `apply` also calls it.

        A persistent journal is never stale: its changes (boot command line, masks) are meant
        to outlive the boot they were made in, so this returns [] for it untouched."""
        if self.persistent:
            return []
        records = self.checked_records()
        boot = self._stale_boot(records)
        if boot is None:
            return []
        return self._revert_records(records, stale=boot)

    # -- apply / revert ----------------------------------------------------------------------
    def apply(self, changes: Iterable[Change]) -> ApplyResult:
        """Refuses an untrusted journal (`check_trusted`) and first retires one from an older
        boot (`retire_stale`; its actions are in `ApplyResult.stale`).

        In an image root every path is resolved inside it (sysconf.confined): a link on the
        way is data, so the file it leads to is what gets written (and the link stays a
        link); the "set" record then also names that file as `target`, which revert
        restores. A path the root refuses (PathRefused: a link under /proc or /sys that
        leads elsewhere) stops the apply before anything is written."""
        changes = list(changes)
        self.check_trusted()
        self.check_paths((c.path, c.kind not in LINK_KINDS) for c in changes)
        self.check_read()
        result = ApplyResult(stale=self.retire_stale())
        for change in changes:
            if change.kind in LINK_KINDS:
                self._apply_link(change, result)
                continue
            if change.kind == task_affinity.KIND:
                self._apply_affinity(change, result)
                continue
            kernel = is_kernel_file(change.path)
            try:
                target = self._resolve(change.path)
                current = self.files.read(target)
            except OSError as exc:
                why = (
                    f"cannot read the current value, so revert could not restore it "
                    f"({_error_name(exc)})"
                )
                result.skipped.append((change, why))
                continue
            if change.selector and current is not None:
                current = selected_choice(current)
                if current is None:
                    why = "no [selected] choice in the current content to restore on revert"
                    result.skipped.append((change, why))
                    continue
            if same_value(current, change.new):
                result.unchanged.append(change)
                continue
            if current is None and not self.files.is_dir(posixpath.dirname(target)):
                why = self._make_parents(target, kernel)
                if why:
                    result.skipped.append((change, why))
                    continue
            self._append(
                {
                    "op": "set",
                    "path": change.path,
                    **_target(change.path, target),
                    "old": current,
                    "new": change.new,
                    "kind": change.kind,
                    "ts": time.time(),
                }
            )
            try:
                self._write(target, change.new, kernel)
            except OSError as exc:
                why = _error_name(exc)
                self._append({"op": "skipped", "path": change.path, "reason": why})
                result.skipped.append((change, why))
                continue
            result.applied.append(change)
        self._append({"op": "done", "ts": time.time()})
        return result

    def _apply_affinity(self, change: Change, result: ApplyResult) -> None:
        """A thread's CPU affinity (sysconf.task_affinity): recorded with its start time."""
        try:
            pid, tid = task_affinity.parse_task_path(change.path)
            old, started = task_affinity.current(pid, tid)
        except (ValueError, task_affinity.TaskGone) as exc:
            result.skipped.append((change, str(exc)))
            return
        if task_affinity.same_cpus(old, change.new):
            result.unchanged.append(change)
            return
        record = {"op": "set", "path": change.path, "old": old, "new": change.new}
        self._append({**record, "kind": change.kind, "started": started, "ts": time.time()})
        try:
            task_affinity.move(pid, tid, change.new, started)
        except (OSError, task_affinity.TaskGone) as exc:
            why = str(exc) if isinstance(exc, task_affinity.TaskGone) else _error_name(exc)
            self._append({"op": "skipped", "path": change.path, "reason": why})
            result.skipped.append((change, why))
            return
        result.applied.append(change)

    def _make_parents(self, device_path: str, kernel: bool) -> str:
        """Create the missing folders above `device_path` (resolved: no links on the way),
        outermost first, each after an fsynced {"op": "mkdir"} record so revert removes them
        (a crash between the record and the mkdir leaves a record revert finds nothing for).
        Returns why it could not, or "". Kernel interfaces (/proc, /sys) get no folders: a
        missing one there is a missing device (an IRQ that went away), not configuration."""
        parent = self.files.host(posixpath.dirname(device_path))
        if kernel:
            return f"{parent} does not exist"
        missing = [
            str(p)
            for p in reversed(PurePosixPath(device_path).parents)
            if str(p) != "/" and not self.files.is_dir(str(p))
        ]
        for folder in missing:
            if self.files.lexists(folder):
                return f"{self.files.host(folder)} is not a directory"
        for folder in missing:
            self._append({"op": "mkdir", "path": folder, "ts": time.time()})
            try:
                self.files.mkdir(folder)
            except OSError as exc:
                why = _error_name(exc)
                self._append({"op": "skipped", "path": folder, "reason": why})
                return f"cannot create {self.files.host(folder)} ({why})"
            self.files.fsync_dir(posixpath.dirname(folder))
        return ""

    def _revert_mkdir(self, record: dict) -> str:
        folder = record["path"]
        try:
            self.files.rmdir(folder)
        except FileNotFoundError:
            return "absent"  # a crash between the record and the mkdir
        except OSError as exc:
            return f"kept: {exc.strerror or exc}"  # not empty: something else lives there
        self.files.fsync_dir(posixpath.dirname(folder))
        return "removed"

    def _unlink_temp(self, device_path: str) -> None:
        """The temporary file or link a crash mid-write left beside `device_path`."""
        with contextlib.suppress(OSError):
            self.files.unlink(_temp_device_path(device_path), missing_ok=True)

    def revert(self) -> list[tuple[str, str]]:
        """Restore every recorded old value, newest first. Returns (path, action) pairs.
        A journal from an older boot is handled as `retire_stale` describes."""
        records = self.checked_records()
        boot = self._stale_boot(records)
        return self._revert_records(records, stale=boot)

    def undo_last(self) -> list[tuple[str, str]]:
        """Revert only the last apply (the records since the "done" before it), newest first,
        and append {"op": "undone"} so a later `revert` skips them: the tuning loop's way to
        take back one change it could not verify while keeping the ones it did. Returns
        (path, action) pairs, [] when there is no finished apply left to undo. A crash
        half-way leaves no "undone" record: a full revert then restores those values again,
        which writes what is already there."""
        records = self.checked_records()
        active = without_undone(records)
        if not active or active[-1].get("op") != "done":
            return []
        start = max((i for i, r in enumerate(active[:-1]) if r.get("op") == "done"), default=-1)
        done = self._restore(active[start + 1 :], None)
        self._append({"op": "undone", "ts": time.time()})
        return done

    def _revert_records(self, records: list[dict], stale: str | None) -> list[tuple[str, str]]:
        done = self._restore(without_undone(records), stale)
        if records:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            label = "stale" if stale and not self.persistent else "reverted"
            aside = f"{self._file}.{label}-{stamp}"
            number = 1
            while self.files.lexists(aside):  # two reverts in one second keep both journals
                aside = f"{self._file}.{label}-{stamp}.{number}"
                number += 1
            self.files.rename(self._file, aside)
        return done

    def _restore(self, records: list[dict], stale: str | None) -> list[tuple[str, str]]:
        """Every recorded old value of `records` back, newest first."""
        done: list[tuple[str, str]] = []
        live_masks: list[tuple[int, dict]] = []  # (index in done, record): runtime to undo
        for index in range(len(records) - 1, -1, -1):
            record = records[index]
            if record.get("op") == "mkdir":
                done.append((record["path"], self._revert_mkdir(record)))
                continue
            if record.get("op") != "set":
                continue
            following = records[index + 1] if index + 1 < len(records) else {}
            if following.get("op") == "skipped" and following.get("path") == record["path"]:
                continue  # the write was refused: nothing to undo
            if stale and is_kernel_file(record["path"]):
                done.append(
                    (
                        record["path"],
                        f"dropped: written in an older boot ({stale}); "
                        f"the kernel reset it at reboot",
                    )
                )
                continue
            if record.get("kind") == task_affinity.KIND:
                done.append((record["path"], task_affinity.revert_record(record)))
                continue
            if "new_link" in record:
                if stale and record.get("was_active"):
                    record = {**record, "was_active": False}  # it did not run this boot
                try:
                    done.append((record["path"], self._revert_link(record)))
                except OSError as exc:
                    done.append((record["path"], f"failed: {exc.strerror or exc}"))
                    continue
                if "was_active" in record:
                    live_masks.append((len(done) - 1, record))
                continue
            # What apply wrote: the file a link led to (`target`), or the path itself.
            target = record.get("target") or record["path"]
            old = record.get("old")
            kernel = is_kernel_file(record["path"])
            if not kernel:
                self._unlink_temp(target)  # a crash mid-write
            try:
                if old is None:
                    self.files.unlink(target, missing_ok=True)
                    done.append((record["path"], "removed"))
                else:
                    self._write(target, old, kernel)
                    done.append((record["path"], "restored"))
            except OSError as exc:
                done.append((record["path"], f"failed: {exc.strerror or exc}"))
        if live_masks:
            self._unmask_now(live_masks, done)
        return done

    def pending(self) -> bool:
        """True while an apply is recorded and not reverted."""
        return any(r.get("op") == "set" for r in self.records())


def without_undone(records: Sequence[dict]) -> list[dict]:
    """`records` without the applies an {"op": "undone"} took back (`Journal.undo_last`):
    each "undone" drops the last finished apply (its records up to its "done") not dropped
    yet."""
    groups: list[list[dict]] = []
    current: list[dict] = []
    for record in records:
        if record.get("op") == "undone":
            if groups:
                groups.pop()
            continue
        current.append(record)
        if record.get("op") == "done":
            groups.append(current)
            current = []
    return [record for group in groups for record in group] + current
