"""Runs the registered audit checks and keeps the books on them.

Checks are found, not listed: every module of `sysconf.audit.checks` registers one when
imported. The runner, not the checks, does the accounting node_exporter does for its
collectors (`node_scrape_collector_success`, `..._duration_seconds`): for each check run,
whether it ran to its end, how long it took, and how many findings it gave.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sysconf.audit import checks as checks_package
from sysconf.audit.findings import REGISTRY, AuditContext, Check, Finding, Rule

# What a check that raised is reported as (with its own prefix): one broken check never hides
# the others, and the audit counts as incomplete.
CHECK_ERROR = Rule("warn", "the check ran to its end")


def error_id(prefix: str) -> str:
    return f"{prefix}-CHECK-ERROR"


def load_checks() -> list[Check]:
    """Every check, in run order: importing each module of `sysconf.audit.checks` registers
    its check (a module imported before is not imported again)."""
    for module in pkgutil.iter_modules(checks_package.__path__):
        importlib.import_module(f"{checks_package.__name__}.{module.name}")
    return sorted(REGISTRY.values(), key=lambda check: (check.order, check.name))


def sections() -> dict[str, int]:
    """id prefix -> its place among the text report's sections, from the catalogues."""
    return {
        prefix: place
        for check in load_checks()
        for prefix, place in check.catalogue.sections.items()
    }


@dataclass(frozen=True)
class CheckStats:
    check: str  # the registered name
    ok: bool  # ran to its end (False: it raised; its error finding is in the report)
    seconds: float
    findings: int  # of its own findings, those the report keeps (after --only/--skip)


@dataclass(frozen=True)
class AuditRun:
    findings: list[Finding]
    checks: list[CheckStats]


def _selected(check: Check, only: Sequence[str]) -> bool:
    """A default-on check always runs, since a check may yield ids of other prefixes than its
    own (isolation yields IRQ-/KRN-); one that is off by default runs when --only names its
    prefix (or a longer or shorter one)."""
    return check.default_on or any(
        check.prefix.startswith(p) or p.startswith(check.prefix) for p in only
    )


def run(ctx: AuditContext, only: Sequence[str] = (), skip: Sequence[str] = ()) -> AuditRun:
    """Every selected check's findings, filtered by id prefix (`only`, `skip`; any case); a
    crashed check's findings up to the crash are kept, and its error finding always is."""
    only = tuple(p.upper() for p in only)
    skip = tuple(p.upper() for p in skip)
    findings: list[Finding] = []
    stats: list[CheckStats] = []
    for check in load_checks():
        if not _selected(check, only):
            continue
        kept: list[Finding] = []
        error: Finding | None = None
        start = time.perf_counter()
        try:
            for finding in check.run(ctx):
                if skip and finding.id.startswith(skip):
                    continue
                if only and not finding.id.startswith(only):
                    continue
                kept.append(finding)
        except Exception as exc:  # report, do not crash the audit
            error = Finding(
                id=error_id(check.prefix),
                severity=CHECK_ERROR.severity,
                status="error",
                title=f"check {check.name} failed: {exc.__class__.__name__}: {exc}",
                remedy="report this as a bug in edged",
            )
        stats.append(CheckStats(check.name, error is None, time.perf_counter() - start, len(kept)))
        findings += kept if error is None else [*kept, error]
    return AuditRun(findings, stats)
