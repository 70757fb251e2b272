"""The rule that judges a change: did the tail get shorter, and did nothing get worse?

The unit is the telemetry window, not the request: requests of one window share its
neighbours, its interrupts and its clock, so they are not independent, and a per-request test
would call a noisy minute a win. Each window gives its p99.9 (the tail a change is meant to
cut), its p99 and p50. The before windows are the evidence the change was proposed on; the
after windows as many again, past a settle window.

Helped: the after windows' p99.9 are lower than the before windows', by a one-sided
Mann-Whitney U test (exact, from the rank sums) at p <= ALPHA. Rank-based, it needs no
normal latencies, and one wild window (a cron job, a cloud neighbour) moves one rank, not a
mean: that is what suits a noisy machine. With 3 windows each, only a complete separation
reaches p = 0.05; with 5, one swapped pair still does (p = 0.028).

Worse: the after windows' median p50 or median p99 is above the before ones' by more than
the tolerance ([tuning] worse_tolerance, 10 %): a change that cut the p99.9 by making every
request slower (or moved the tail to the p99) is not kept.

Kept when it helped and nothing got worse; reverted otherwise, with the reason and figures.
Windows with no requests carry no evidence and are not counted."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ALPHA = 0.05


@dataclass(frozen=True)
class WindowFigures:
    """One telemetry window, all models pooled: its requests and the worst model's figures
    (the loop judges the device's tail, and a change must not hurt any model)."""

    count: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    outliers: dict[str, int]  # cause -> outliers, summed over models

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "p999_ms": self.p999_ms,
            "outliers": dict(self.outliers),
        }


def figures(payload: Mapping[str, Any]) -> WindowFigures | None:
    """A telemetry payload's window (docs/schema/telemetry.schema.json); None without requests
    or figures."""
    count, p50, p99, p999 = 0, 0.0, 0.0, 0.0
    causes: dict[str, int] = {}
    for model in (payload.get("models") or {}).values():
        n = model.get("count") or 0
        values = [model.get(k) for k in ("p50_ms", "p99_ms", "p999_ms")]
        if not n or any(not isinstance(v, int | float) for v in values):
            continue
        count += n
        p50, p99, p999 = max(p50, values[0]), max(p99, values[1]), max(p999, values[2])
        for cause, k in (model.get("outliers") or {}).items():
            if isinstance(k, int):
                causes[cause] = causes.get(cause, 0) + k
    if not count:
        return None
    return WindowFigures(count, p50, p99, p999, causes)


def mann_whitney_less(after: Sequence[float], before: Sequence[float]) -> float:
    """One-sided exact p-value that `after` tends to be smaller than `before`: the share of
    all ways to split the pooled values into groups of these sizes whose `after` rank sum is
    at most the one seen (ties share their mean rank). Exact enumeration: the groups are a
    handful of windows (C(20, 10) = 184,756 splits at the most that [tuning] allows)."""
    pooled = sorted(list(after) + list(before))
    ranks: dict[float, float] = {}
    for value, group in itertools.groupby(enumerate(pooled, 1), key=lambda item: item[1]):
        positions = [rank for rank, _ in group]
        ranks[value] = sum(positions) / len(positions)
    all_ranks = [ranks[v] for v in pooled]
    seen = sum(ranks[v] for v in after)
    splits = itertools.combinations(all_ranks, len(after))
    at_most = sum(1 for split in splits if sum(split) <= seen + 1e-9)
    return at_most / math.comb(len(all_ranks), len(after))


@dataclass(frozen=True)
class Verdict:
    keep: bool
    reason: str
    p_value: float
    before: dict[str, float]  # medians over the windows
    after: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "keep": self.keep,
            "reason": self.reason,
            "p_value": round(self.p_value, 4),
            "before": self.before,
            "after": self.after,
            "rule": "Mann-Whitney U (one-sided, exact) on the windows' p99.9, "
            f"p <= {ALPHA}; worse: median p50 or p99 up by more than the tolerance",
        }


def medians(windows: Sequence[WindowFigures]) -> dict[str, float]:
    return {
        key: round(statistics.median(getattr(w, key) for w in windows), 3)
        for key in ("p50_ms", "p99_ms", "p999_ms")
    }


def judge(
    before: Sequence[WindowFigures], after: Sequence[WindowFigures], tolerance: float = 0.10
) -> Verdict:
    """Keep or revert (module docstring)."""
    if not before or not after:
        raise ValueError("judge: needs windows before and after the change")
    was, now = medians(before), medians(after)
    p = mann_whitney_less([w.p999_ms for w in after], [w.p999_ms for w in before])
    worse = [
        f"median {label} {was[key]:g} -> {now[key]:g} ms"
        for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"))
        if now[key] > was[key] * (1 + tolerance)
    ]
    if worse:
        return Verdict(False, "worse: " + ", ".join(worse), p, was, now)
    if p > ALPHA:
        reason = (
            f"did not help: p99.9 median {was['p999_ms']:g} -> {now['p999_ms']:g} ms, "
            f"not lower beyond chance (p = {p:.3f} > {ALPHA})"
        )
        return Verdict(False, reason, p, was, now)
    reason = (
        f"helped: p99.9 median {was['p999_ms']:g} -> {now['p999_ms']:g} ms (p = {p:.3f}); "
        f"p50 {was['p50_ms']:g} -> {now['p50_ms']:g}, p99 {was['p99_ms']:g} -> "
        f"{now['p99_ms']:g} ms"
    )
    return Verdict(True, reason, p, was, now)
