"""The tuning actions: what can be changed when telemetry names a cause of latency outliers
on the inference cores, each action one module in this package (adding one is one file).

An action module declares NAME, ANSWERS (the outlier causes it answers, as telemetry names
them: "irq", "softirq:BLOCK", "softirq:NET_RX", "freq_drop", ...), RISK ("low": a runtime
value the journal restores exactly; "medium": it changes how other work runs) and
`propose(root, plan, evidence) -> Proposal | None`: the changes (sysconf Change records,
applied and reverted by the existing journal) or, when nothing can be done, why not. It only
reads. `propose_for` ranks the evidence (most outliers first) and asks every action that
answers each cause; a cause no action answers is said so.

This is the catalogue of the tuning loop: the same units serve `edgectl tune` (a proposal
from recorded telemetry, for this system or an image) and the daemon's loop
(edged.autotune), which applies one proposal at a time, verifies it and reverts it."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from sysconf.change_records import Change
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot


@dataclass(frozen=True)
class Evidence:
    """A cause and how many outliers it touched (over one or more telemetry windows)."""

    cause: str  # "irq", "softirq:BLOCK", "preempted", "freq_drop", "throttle", ...
    outliers: int
    windows: int = 1
    # For "preempted": the threads telemetry saw on the inference cores ({"comm", "pid",
    # "tid", "cpu", "cpu_ms"}, most CPU first, over all windows).
    intruders: tuple[Mapping[str, Any], ...] = ()
    # The windows come from this boot's running system (the daemon's loop): its threads may
    # be moved even when the files are a test's root.
    live: bool = False


@dataclass
class Proposal:
    action: str
    cause: str
    risk: str
    changes: list[Change] = field(default_factory=list)
    expected: str = ""  # what it should do to the tail
    blocked: str = ""  # why nothing can be changed (the action applies, the system says no)

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "cause": self.cause,
            "risk": self.risk,
            "changes": [c.to_dict() for c in self.changes],
            "expected": self.expected,
            "blocked": self.blocked or None,
        }


def catalogue() -> list[ModuleType]:
    """Every action module of this package, by name."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if all(hasattr(module, attr) for attr in ("NAME", "ANSWERS", "RISK", "propose")):
            found.append(module)
    return found


def evidence_from_telemetry(
    payloads: Iterable[Mapping[str, Any]], live: bool = False
) -> list[Evidence]:
    """Causes summed over telemetry payloads (docs/schema/telemetry.schema.json: each
    model's `outliers`, and the `intruders` named for preempted ones), most outliers first."""
    counts: dict[str, int] = {}
    windows: dict[str, int] = {}
    threads: dict[int, dict[str, Any]] = {}  # tid -> the thread, its CPU time summed
    for payload in payloads:
        seen: set[str] = set()
        for model in (payload.get("models") or {}).values():
            for cause, count in (model.get("outliers") or {}).items():
                if isinstance(count, int) and count > 0:
                    counts[cause] = counts.get(cause, 0) + count
                    seen.add(cause)
            for thread in (model.get("intruders") or {}).get("threads") or ():
                if not isinstance(thread, Mapping) or not isinstance(thread.get("tid"), int):
                    continue
                known = threads.setdefault(thread["tid"], {**thread, "cpu_ms": 0.0})
                known["cpu_ms"] = round(known["cpu_ms"] + float(thread.get("cpu_ms") or 0), 1)
        for cause in seen:
            windows[cause] = windows.get(cause, 0) + 1
    named = tuple(sorted(threads.values(), key=lambda t: (-t["cpu_ms"], t["tid"])))
    return sorted(
        (
            Evidence(cause, n, windows[cause], named if cause == "preempted" else (), live)
            for cause, n in counts.items()
        ),
        key=lambda e: (-e.outliers, e.cause),
    )


def answers(module: ModuleType, cause: str) -> bool:
    return any(cause == a or (a.endswith(":") and cause.startswith(a)) for a in module.ANSWERS)


# Causes no change to the system answers, and why (said instead of a proposal).
NOT_ACTIONABLE = {
    "unexplained": "no interrupt, preemption or clock change was seen around these outliers",
    "unsampled": "the counters were not sampled around these outliers (raise sampling)",
}


def propose_for(root: SysRoot, plan: CpuPlan, evidence: list[Evidence]) -> list[dict[str, Any]]:
    """Per cause, most outliers first: the proposals of the actions that answer it, or why
    none does."""
    modules = catalogue()
    out = []
    for item in evidence:
        entry: dict[str, Any] = {"cause": item.cause, "outliers": item.outliers}
        entry["windows"] = item.windows
        proposals = [
            p for m in modules if answers(m, item.cause) for p in [m.propose(root, plan, item)] if p
        ]
        entry["proposals"] = [p.to_dict() for p in proposals]
        if not proposals:
            entry["why_none"] = NOT_ACTIONABLE.get(
                item.cause, f"no action in the catalogue answers {item.cause!r} yet"
            )
        out.append(entry)
    return out
