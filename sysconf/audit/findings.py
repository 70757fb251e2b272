"""Audit findings, the catalogue of ids a check declares, and the registry of checks.

A check is a small plug-in, one module of `sysconf.audit.checks`: a function taking an
`AuditContext` and yielding `Finding`s, registered by name with its `Catalogue` and a
default-on flag, the way node_exporter's collectors register themselves. The catalogue says,
as data, every id the check can produce with its severity: ids are stable (scripts, SARIF
ruleIds and CI baselines key on them) and tests/sysconf/test_audit_catalogue.py pins them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from sysconf.sysroot import SysRoot

SEVERITIES = ("info", "warn", "fail")
STATUSES = ("pass", "warn", "fail", "skip", "error")


@dataclass(frozen=True)
class Evidence:
    path: str  # file (on the device) or DT node path the finding is about
    observed: str
    expected: str


# Keyword-only: severity and status take the same words ("warn", "fail"), so a positional
# mix-up would pass validation and silently change what a report counts.
@dataclass(frozen=True, kw_only=True)
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


class Rule(NamedTuple):
    """One stable id, as (severity, title): how bad it is when it fails, and what it checks
    (the title of its `pass` finding where that is fixed; a check may word a finding from the
    facts it found). `escalated`: a worse severity some of its findings carry (a thermal zone
    past its hot trip, not only its passive one); empty for most."""

    severity: str
    title: str
    escalated: str = ""


@dataclass(frozen=True)
class Catalogue:
    """Every id a check can produce, with where its findings go in the text report.

    `prefix`: the check's own id prefix (`--only` selects the check by it; a crash is
    reported as `<prefix>-CHECK-ERROR`). `sections`: the id prefixes its findings use, each
    with its place among the text report's sections (a check may report under several: the
    isolation check's IRQ- and KRN- ids).
    """

    prefix: str
    sections: Mapping[str, int]
    rules: Mapping[str, Rule]

    def __post_init__(self) -> None:
        if self.prefix not in self.sections:
            raise ValueError(f"catalogue {self.prefix}: its own prefix has no section")
        for fid, rule in self.rules.items():
            if fid.split("-", 1)[0] not in self.sections:
                raise ValueError(f"{fid}: prefix not among the sections {list(self.sections)}")
            for severity in filter(None, (rule.severity, rule.escalated)):
                if severity not in SEVERITIES:
                    raise ValueError(f"{fid}: severity {severity!r} not in {SEVERITIES}")

    def finding(
        self,
        fid: str,
        status: str,
        title: str | None = None,
        *,
        escalated: bool = False,
        **fields: Any,
    ) -> Finding:
        """A finding of a declared id, with the severity the catalogue gives it (so each id's
        severity is written once). `title` defaults to the rule's; `escalated` picks the
        rule's worse severity. An undeclared id raises KeyError: a bug in the check."""
        rule = self.rules[fid]
        if escalated and not rule.escalated:
            raise ValueError(f"{fid}: no escalated severity declared")
        return Finding(
            id=fid,
            severity=rule.escalated if escalated else rule.severity,
            status=status,
            title=rule.title if title is None else title,
            **fields,
        )


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
    catalogue: Catalogue
    run: CheckFn
    order: int  # where it runs, and so where its findings come in the JSON/JUnit/SARIF lists
    default_on: bool = True

    @property
    def prefix(self) -> str:
        return self.catalogue.prefix


REGISTRY: dict[str, Check] = {}


def register(
    name: str, catalogue: Catalogue, order: int, default_on: bool = True
) -> Callable[[CheckFn], CheckFn]:
    def wrap(fn: CheckFn) -> CheckFn:
        if name in REGISTRY:
            raise ValueError(f"check {name!r} registered twice")
        REGISTRY[name] = Check(name, catalogue, fn, order, default_on)
        return fn

    return wrap
