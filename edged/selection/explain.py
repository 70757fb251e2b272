"""Which passing candidate wins, and the one line on why.

The lowest p99 wins; near-ties (within TIE_FRACTION) go to the lower precision (less memory
and power), then the smaller memory growth. Every timed variant's speed-up over the original
on the same backend:device goes into its evidence, and the why-line says what the best INT8
(or FP32) alternative did.
"""

from __future__ import annotations

from pathlib import Path

from backends.model_info import ModelInfo
from edged.selection.accuracy import Accuracy
from edged.selection.bench import LatencyStats
from edged.selection.decision import Evidence, Selection
from sysconf.hardware import HardwareFacts

TIE_FRACTION = 0.02  # p99s this close are a tie: measurement noise on a busy device
# What ran, lowest first: the tie-break order ("int8+bf16" is INT8 with bf16 in between).
PRECISION_RANK = {"int8": 0, "fp16": 1, "bf16": 1, "fp32": 2}


def _latency(ev: Evidence) -> LatencyStats:
    """The latency of evidence known to be timed."""
    assert ev.latency is not None, ev
    return ev.latency


def _accuracy(ev: Evidence) -> Accuracy:
    """The accuracy of evidence known to be compared."""
    assert ev.accuracy is not None, ev
    return ev.accuracy


def record_speedups(evidence: list[Evidence], original: str) -> None:
    """Each timed variant's speed against the original on the same backend:device (the
    original's fp32 request where it has one, else its cheapest timed one)."""
    timed = [e for e in evidence if e.latency]
    base: dict[tuple[str, str], float] = {}
    for ev in sorted(timed, key=lambda e: e.candidate.precision not in ("fp32", "model")):
        if ev.variant == original:
            base.setdefault((ev.candidate.backend, ev.candidate.device), _latency(ev).p50_ms)
    for ev in timed:
        ref = base.get((ev.candidate.backend, ev.candidate.device))
        if ev.variant != original and ref:
            ev.speedup_vs_original = round(ref / _latency(ev).p50_ms, 3)


def precision_rank(precision: str | None) -> int:
    head = (precision or "fp32").split("+")[0]
    return PRECISION_RANK.get(head, 2)


def choose(passed: list[Evidence]) -> Evidence:
    best_p99 = min(e.latency.p99_ms for e in passed if e.latency)
    tied = [e for e in passed if e.latency and e.latency.p99_ms <= best_p99 * (1 + TIE_FRACTION)]
    return min(
        tied,
        key=lambda e: (precision_rank(e.precision), e.rss_growth_bytes or 0, _latency(e).p99_ms),
    )


def variant_label(ev: Evidence, original: ModelInfo) -> str:
    return "original" if ev.variant in ("", str(original.path)) else Path(ev.variant).name


def explain(selection: Selection, hw: HardwareFacts) -> str:
    """One line on why the pick won, and what the best INT8 or FP32 alternative did."""
    sel = selection.selected
    assert sel is not None and sel.latency is not None
    original = selection.original or selection.model
    cpu = (
        f"on this CPU ({hw.isa_summary()})"
        if sel.candidate.device.startswith("CPU")
        else f"on {sel.candidate.device}"
    )
    head = (
        f"{variant_label(sel, original)} on {sel.candidate.backend}:{sel.candidate.device} "
        f"({sel.precision}) has the lowest p99 within the accuracy budget, "
        f"{sel.latency.p99_ms:.3f} ms"
    )
    int8 = [
        e
        for e in selection.evidence
        if selection.model_of(e).is_int8 and e.variant != str(original.path)
    ]
    if not selection.against_original or not int8:
        return head
    if selection.model.is_int8 and sel.speedup_vs_original:
        return (
            f"{head}; INT8 on {sel.candidate.backend}:{sel.candidate.device} is "
            f"{sel.speedup_vs_original:.2f}x its FP32 model {cpu}"
        )
    timed = [e for e in int8 if e.status == "passed" and e.speedup_vs_original]
    if timed:
        best = max(timed, key=lambda e: e.speedup_vs_original or 0.0)
        return (
            f"{head}; INT8 lost: on {best.candidate.backend}:{best.candidate.device} it "
            f"is {best.speedup_vs_original:.2f}x its FP32 model {cpu}, p99 "
            f"{_latency(best).p99_ms:.3f} ms"
        )
    rejected = [e for e in int8 if e.status == "rejected" and e.accuracy]
    if rejected:
        best = max(rejected, key=lambda e: _accuracy(e).score)
        return (
            f"{head}; INT8 lost on accuracy: at best {_accuracy(best).rule} "
            f"{_accuracy(best).score:.4f} against the original "
            f"({best.candidate.backend}:{best.candidate.device})"
        )
    return f"{head}; no INT8 variant ran here"
