"""The journal's changes that are systemd unit links: a unit masked (a link to /dev/null under
/etc/systemd/system) or enabled (a link in a target's .wants), recorded, applied and reverted
exactly, and, on the live system, the masking made effective at once (`systemctl mask --now`)
and undone when a later step fails. A mixin of `sysconf.changes.Journal`, whose recording,
confined file operations and systemctl it uses."""

from __future__ import annotations

import os
import posixpath
import stat
import time
from typing import TYPE_CHECKING

from sysconf.change_records import ApplyResult, Change, _error_name, _target, is_kernel_file
from sysconf.systemctl import SystemctlError

if TYPE_CHECKING:
    from sysconf.confined import ConfinedRoot
    from sysconf.sysroot import SysRoot
    from sysconf.systemctl import Systemctl


class UnitLinks:
    """Mask and enable links: `Journal` applies and reverts them through these."""

    if TYPE_CHECKING:  # what Journal provides (sysconf.changes)
        root: SysRoot
        files: ConfinedRoot

        @property
        def systemctl(self) -> Systemctl: ...

        def _append(self, record: dict) -> None: ...

        def _resolve(self, device_path: str, follow: bool = True) -> str: ...

        def _write(self, device_path: str, content: str, kernel: bool) -> None: ...

        def _make_parents(self, device_path: str, kernel: bool) -> str: ...

        def _unlink_temp(self, device_path: str) -> None: ...

    def _apply_link(self, change: Change, result: ApplyResult) -> None:
        """A symlink change (a mask). Records what was there: nothing, a symlink (`old_link`)
        or a file (`old` with its `old_mode`), so revert restores exactly that.

        On the live root a mask is `systemctl mask --now`: ask whether the unit runs (before
        anything is written, so a missing or broken systemctl changes nothing), record that
        with the old link, write the mask, then `daemon-reload` and `stop`. If either fails
        the mask is taken back at once (and a stopped unit started again) and a "skipped"
        record follows, so the journal never claims a mask that is not there, and revert
        never starts or unmasks what apply did not touch."""
        live = self.root.is_live
        unit = os.path.basename(change.path)
        if live and change.kind != "mask":
            why = (
                f"refusing to write an {change.kind} link on the live system "
                f"(use systemctl {change.kind} {unit})"
            )
            result.skipped.append((change, why))
            return
        old_link = old = old_mode = None
        try:
            target = self._resolve(change.path, follow=False)  # the link itself, not its target
            try:
                st: os.stat_result | None = self.files.lstat(target)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                old_link = self.files.readlink(target)
            elif st is not None and stat.S_ISDIR(st.st_mode):
                result.skipped.append((change, f"{self.files.host(target)} is a directory"))
                return
            elif st is not None:
                old = self.files.read(target)
                old_mode = stat.S_IMODE(st.st_mode)
        except OSError as exc:
            why = (
                f"cannot read the current value, so revert could not restore it "
                f"({_error_name(exc)})"
            )
            result.skipped.append((change, why))
            return
        if old_link == change.new:
            result.unchanged.append(change)
            return
        runtime: dict = {}
        if live:
            try:
                runtime = {"unit": unit, "was_active": self.systemctl.is_active(unit)}
            except SystemctlError as exc:
                result.skipped.append((change, f"{exc}; nothing was changed"))
                return
        if not self.files.is_dir(posixpath.dirname(target)):
            why = self._make_parents(target, is_kernel_file(change.path))
            if why:
                result.skipped.append((change, why))
                return
        record = {
            "op": "set",
            "path": change.path,
            **_target(change.path, target),
            "old": old,
            "old_link": old_link,
            "old_mode": old_mode,
            "new_link": change.new,
            "new": change.new,
            "kind": change.kind,
            **runtime,
            "ts": time.time(),
        }
        self._append(record)
        try:
            self.files.symlink(target, change.new)
        except OSError as exc:
            why = _error_name(exc)
            self._append({"op": "skipped", "path": change.path, "reason": why})
            result.skipped.append((change, why))
            return
        if live:
            why = self._mask_now(record)
            if why:
                result.skipped.append((change, why))
                return
        result.applied.append(change)

    def _mask_now(self, record: dict) -> str:
        """The runtime half of `systemctl mask --now` after the mask link is written: reload
        so systemd sees the mask, then stop the unit (always, as --now does: a timer may have
        fired since is-active). On failure the mask is undone and why is returned ("": done)."""
        unit = record["unit"]
        stopping = False
        try:
            self.systemctl.daemon_reload()
            stopping = True
            self.systemctl.stop(unit)
        except SystemctlError as failed:
            return self._undo_live_mask(record, failed, restart=stopping)
        return ""

    def _undo_live_mask(self, record: dict, failed: SystemctlError, restart: bool) -> str:
        """Take a live mask back after `failed`: the old link, a reload, and a start when the
        unit ran before and a stop was attempted. Only when the old link is back does a
        "skipped" record say so; otherwise the set record stays and revert undoes it."""
        unit = record["unit"]
        try:
            self._revert_link(record)
        except OSError as exc:
            return (
                f"{failed}; the mask could not be taken back ({_error_name(exc)}): it "
                f"stays in the journal, and edgectl revert removes it"
            )
        self._append({"op": "skipped", "path": record["path"], "reason": str(failed)})
        problems = []
        try:
            self.systemctl.daemon_reload()
            if restart and record.get("was_active"):
                self.systemctl.start(unit)
        except SystemctlError as exc:
            problems.append(f"then {exc}")
        return "; ".join([f"{failed}; the mask was taken back", *problems])

    def _revert_link(self, record: dict) -> str:
        target = record.get("target") or record["path"]
        self._unlink_temp(target)  # a crash mid-symlink
        if record.get("old_link") is not None:
            self.files.symlink(target, record["old_link"])
            return "restored"
        if self.files.is_link(target):
            self.files.unlink(target)  # never write through the mask into /dev/null
        if record.get("old") is None:
            return "removed"
        self._write(target, record["old"], False)
        if record.get("old_mode") is not None:
            self.files.chmod(target, record["old_mode"])
        return "restored"

    def _unmask_now(self, live_masks: list[tuple[int, dict]], done: list[tuple[str, str]]) -> None:
        """After the live masks' old links are back: one `daemon-reload`, then `start` of each
        unit that was active before apply (oldest first, the order apply stopped them). A
        failure turns that entry's action into "failed: ..." naming the command to run."""
        try:
            self.systemctl.daemon_reload()
        except SystemctlError as exc:
            for position, record in live_masks:
                done[position] = (
                    record["path"],
                    f"failed: link restored, but {exc}; run "
                    f"systemctl daemon-reload"
                    + (
                        f" and systemctl start {record['unit']}" if record.get("was_active") else ""
                    ),
                )
            return
        for position, record in reversed(live_masks):
            if not record.get("was_active"):
                continue
            try:
                self.systemctl.start(record["unit"])
            except SystemctlError as exc:
                done[position] = (record["path"], f"failed: link restored, but {exc}")
            else:
                done[position] = (record["path"], f"{done[position][1]}, started")
