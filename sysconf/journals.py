"""Both journals of one state dir used as one: the tuning journal (runtime tuning, undone at
every boot and by `edgectl revert`) and the persistent journal (boot-line and unit changes
that outlive it). Each change goes to the journal `sysconf.changes.outlives_tuning` picks."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sysconf.changes import LINK_KINDS, ApplyResult, Change, Journal, Writer, outlives_tuning
from sysconf.sysroot import SysRoot
from sysconf.systemctl import Systemctl


class Journals:
    """The tuning journal and the persistent journal of one state dir, used as one.

    `apply` sends each change to the journal `outlives_tuning` picks (both checked trusted
    before anything is written; same fsync-before-write records in each), `retire_stale`
    retires only an older boot's tuning journal, and `revert` restores the tuning journal
    and then, unless `runtime_only`, the persistent one. The two never hold the same path
    (the rule goes by kind), so their order only matters for folders they created: apply
    writes the persistent changes first and revert undoes them last, the exact reverse."""

    def __init__(
        self,
        root: SysRoot,
        state_dir: str = "/var/lib/edged",
        writer: Writer | None = None,
        systemctl: Systemctl | None = None,
    ) -> None:
        self.tuning = Journal(root, state_dir, writer, systemctl)
        self.persistent = Journal(root, state_dir, writer, systemctl, persistent=True)

    @property
    def path(self) -> Path:
        """The tuning journal (what edged-tune.service applies and reverts)."""
        return self.tuning.path

    def check_trusted(self) -> None:
        self.tuning.check_trusted()
        self.persistent.check_trusted()

    def retire_stale(self) -> list[tuple[str, str]]:
        """`Journal.retire_stale` of the tuning journal; the persistent one is kept."""
        self.check_trusted()
        return self.tuning.retire_stale()

    def apply(self, changes: Iterable[Change]) -> ApplyResult:
        """Both journals' results in one, in the order of `changes`. The persistent journal
        is only created when a change goes to it."""
        self.check_trusted()
        changes = list(changes)
        # Every path of both journals before either writes anything (PathRefused).
        self.tuning.check_paths((c.path, c.kind not in LINK_KINDS) for c in changes)
        self.tuning.check_read()
        result = ApplyResult(stale=self.retire_stale())
        lasting = [c for c in changes if outlives_tuning(c)]
        parts = [self.persistent.apply(lasting)] if lasting else []
        parts.append(self.tuning.apply([c for c in changes if not outlives_tuning(c)]))
        order = {id(c): i for i, c in enumerate(changes)}
        for part in parts:
            result.applied += part.applied
            result.unchanged += part.unchanged
            result.skipped += part.skipped
            result.stale += part.stale
        result.applied.sort(key=lambda c: order[id(c)])
        result.unchanged.sort(key=lambda c: order[id(c)])
        result.skipped.sort(key=lambda item: order[id(item[0])])
        return result

    def revert(self, runtime_only: bool = False) -> list[tuple[str, str]]:
        """The tuning journal's `revert`, then (unless `runtime_only`) the persistent one's.
        Both journals are checked (trust, every record readable) before either is touched."""
        journals = [self.tuning] if runtime_only else [self.tuning, self.persistent]
        for journal in journals:
            journal.checked_records()
        done: list[tuple[str, str]] = []
        for journal in journals:
            done += journal.revert()
        return done

    def pending(self) -> bool:
        return self.tuning.pending() or self.persistent.pending()
