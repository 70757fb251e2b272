"""Audit findings and the registry of checks that produce them.

A check is a small plug-in: a function taking an `AuditContext` and yielding `Finding`s,
registered by name with an id prefix (ISO, IRQ, SVC, KRN, DT, THM) and a default-on flag, the
way node_exporter's collectors register themselves. Ids are stable: scripts, SARIF ruleIds
and CI baselines key on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from sysconf.sysroot import SysRoot

SEVERITIES = ("info", "warn", "fail")
STATUSES = ("pass", "warn", "fail", "skip", "error")


@dataclass(frozen=True)
class Evidence:
    path: str  # file (on the device) or DT node path the finding is about
    observed: str
    expected: str


@dataclass(frozen=True)
class Finding:
    id: str  # stable, e.g. "DT-DMA-DISABLED-CONTROLLER"
    severity: str  # how bad it is when it fails: info | warn | fail
    status: str  # what this run found: pass | warn | fail | skip | error
    title: str
    evidence: tuple[Evidence, ...] = ()
    remedy: str = ""  # the exact command or file change
    fixable: bool = False  # `edgectl apply` can fix it
    subject: str = ""  # what it is about when one check yields many (a node, an IRQ)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"{self.id}: severity {self.severity!r} not in {SEVERITIES}")
        if self.status not in STATUSES:
            raise ValueError(f"{self.id}: status {self.status!r} not in {STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["evidence"] = [asdict(e) for e in self.evidence]
        return data


@dataclass
class AuditContext:
    """What checks read: the root (live `/` or an image folder) and any device trees given
    with --dtb (parsed by the caller; a check that needs a live-only fact yields `skip`)."""

    root: SysRoot
    dtbs: list[tuple[str, Any]] = field(default_factory=list)  # (source, DeviceTree)
    options: dict[str, Any] = field(default_factory=dict)


CheckFn = Callable[[AuditContext], Iterable[Finding]]


@dataclass(frozen=True)
class Check:
    name: str
    prefix: str  # the id prefix its findings use
    run: CheckFn
    default_on: bool = True


REGISTRY: dict[str, Check] = {}


def register(name: str, prefix: str, default_on: bool = True) -> Callable[[CheckFn], CheckFn]:
    def wrap(fn: CheckFn) -> CheckFn:
        if name in REGISTRY:
            raise ValueError(f"check {name!r} registered twice")
        REGISTRY[name] = Check(name, prefix, fn, default_on)
        return fn

    return wrap


def run_checks(ctx: AuditContext, only: Iterable[str] = (), skip: Iterable[str] = ()
               ) -> Iterator[Finding]:
    """Every registered check whose prefix matches; a check that raises becomes one `error`
    finding naming it, so one broken check never hides the others."""
    only, skip = tuple(only), tuple(skip)
    for check in REGISTRY.values():
        if only and not any(check.prefix.startswith(p) or p.startswith(check.prefix)
                            for p in only):
            continue
        if not only and not check.default_on:
            continue
        try:
            for finding in check.run(ctx):
                if skip and finding.id.startswith(skip):
                    continue
                if only and not finding.id.startswith(only):
                    continue
                yield finding
        except Exception as exc:  # report, do not crash the audit
            yield Finding(f"{check.prefix}-CHECK-ERROR", "warn", "error",
                          f"check {check.name} failed: {exc.__class__.__name__}: {exc}",
                          remedy="report this as a bug in edged")


def summary(findings: Iterable[Finding]) -> dict[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for finding in findings:
        counts[finding.status] += 1
    return counts
