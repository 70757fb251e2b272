"""What `edgectl quantize` decides and writes: every attempt (recipe on target, its accuracy
and speed-up), the pick (the fastest INT8 recipe that passed the gate and beat FP32, or FP32
kept, with the reason), and the output file written whole or not at all.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.model_info import write_model_file
from edged.quantize.calibration import Samples
from edged.quantize.recipes import QuantizeError, Recipe
from edged.selection.accuracy import Accuracy

if TYPE_CHECKING:
    from edged.quantize.recipes import Settings

# INT8 must be at least this much faster (median) than FP32 to be worth its accuracy cost;
# the same 2 % band the backend selection treats as a tie.
MIN_SPEEDUP = 1.02


@dataclass
class Attempt:
    """One recipe quantized and checked on one target."""

    target: str
    recipe: Recipe
    path: Path
    accuracy: Accuracy | None = None
    passed: bool = False
    error: str = ""
    p50_ms: float | None = None
    speedup: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "recipe": self.recipe.label,
            "scheme": self.recipe.scheme,
            "fp32_nodes": list(self.recipe.fp32_nodes),
            "accuracy": self.accuracy.to_dict() if self.accuracy else None,
            "passed": self.passed,
            "error": self.error or None,
            "p50_ms": self.p50_ms,
            "speedup": self.speedup,
        }


@dataclass
class Report:
    output: str
    target: str
    recipe: str  # the recipe written, or "fp32" when no INT8 recipe passed and beat FP32
    fp32_nodes: list[str]
    accuracy: dict[str, Any] | None
    speedup: float | None
    warnings: list[str]
    samples: dict[str, int]
    method: str
    max_drop: float
    fp32_ms: dict[str, float] = field(default_factory=dict)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    cpu: str = ""  # the ISA the recipes were chosen for and timed on (`isa_summary`)
    io: str | None = None  # a .tflite's input/output type (int8, uint8, float); None for ONNX
    compiled: dict[str, Any] | None = None  # the NPU compiler's report (Vela), when one ran
    notes: list[str] = field(default_factory=list)  # what was done beyond the recipe

    @property
    def int8(self) -> bool:
        return self.recipe != "fp32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(
    model_path: Path,
    output: Path,
    attempts: list[Attempt],
    fp32_ms: dict[str, float],
    calibration: Samples,
    evaluation: Samples,
    settings: Settings,
    warnings: list[str],
    cpu: str = "",
    notes: list[str] | None = None,
) -> Report:
    """The report of a measured run, with `output` written: the pick, or the FP32 model and
    why no INT8 recipe was."""
    passing = [a for a in attempts if a.passed and a.speedup is not None]
    if settings.require_int8:
        # An NPU target: INT8 is the point, however it runs on this CPU; the fewest float ops
        # (they would leave the NPU) first, then the fastest here.
        fewest = min((len(a.recipe.fp32_nodes) for a in passing), default=0)
        winners = [a for a in passing if len(a.recipe.fp32_nodes) == fewest]
    else:
        winners = [a for a in passing if (a.speedup or 0.0) >= MIN_SPEEDUP]
    common: dict[str, Any] = {
        "warnings": warnings,
        "method": settings.method,
        "max_drop": settings.max_drop,
        "samples": {"calibration": len(calibration), "evaluation": len(evaluation)},
        "fp32_ms": fp32_ms,
        "attempts": [a.to_dict() for a in attempts],
        "cpu": cpu,
        "io": settings.io,
        "notes": notes or [],
    }
    if winners:
        # Across targets: the lowest latency wins (auto); within one, the fastest recipe.
        pick = min(winners, key=lambda a: math.inf if a.p50_ms is None else a.p50_ms)
        _write(pick.path, output)
        return Report(
            str(output),
            pick.target,
            pick.recipe.label,
            list(pick.recipe.fp32_nodes),
            pick.accuracy.to_dict() if pick.accuracy else None,
            pick.speedup,
            **common,
        )
    if passing:
        best = max(passing, key=lambda a: a.speedup or 0.0)
        reason = (
            f"no INT8 recipe beats FP32 (best: {best.recipe.label} on {best.target}, "
            f"{best.speedup:.2f}x); FP32 kept"
        )
    elif any(a.accuracy for a in attempts):
        scored = [(a, acc) for a in attempts if (acc := a.accuracy) is not None]
        best, accuracy = max(scored, key=lambda pair: pair[1].score)
        reason = (
            f"no INT8 recipe passes the accuracy gate (max drop {settings.max_drop}; best: "
            f"{best.recipe.label} on {best.target}, {accuracy.rule} "
            f"{accuracy.score:.4f}, cosine {accuracy.cosine:.4f}"
            + (
                f", top-1 agreement {accuracy.top1_agreement:.3f}"
                if accuracy.top1_agreement is not None
                else ""
            )
            + "); FP32 kept"
        )
    else:
        errors = "; ".join(f"{a.target} {a.recipe.label}: {a.error}" for a in attempts if a.error)
        reason = f"no INT8 recipe ran ({errors}); FP32 kept"
    fastest = min(fp32_ms, key=lambda name: fp32_ms[name]) if fp32_ms else settings.targets[0]
    _write(model_path, output)
    return Report(str(output), fastest, "fp32", [], None, None, reason=reason, **common)


def _write(source: Path, output: Path) -> None:
    """Copy to `output` whole or not at all (`write_model_file`)."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_model_file(output, source.read_bytes())
    except OSError as exc:
        raise QuantizeError(f"cannot write {output}: {exc.strerror or exc}") from None
