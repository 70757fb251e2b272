"""The selection policy: how long to measure, the accuracy budget, and what a model runs with.

Its own module, importing nothing heavy, because the config holds one (`[selection]`, and per
model through `ModelConfig.policy`): loading or checking a config must not import numpy,
psutil or the backends that the selection itself needs.

Field metadata `toml` is for the config: the keys `[selection]` spells a field with (None:
not a key of `[selection]`; threads, cpus, shapes, backend and precision come from each
`[[models]]` table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_DROP = 0.01  # accuracy budget against the FP32 original (selection and quantize)

# Generated evaluation inputs when no data is given: one small output (a 2-class softmax)
# makes a figure that swings with a single sample; several make it about the runtime.
VERIFY_SAMPLES = 4
PRECISIONS = ("auto", "int8")  # Policy.precision: any variant, or INT8 variants only
_PER_MODEL = {"toml": None}


QUICK_LOOK_RUNS = 10  # fewer timed runs than this (selection.bench's min_runs) decide apart


@dataclass(frozen=True)
class Policy:
    # At most `runs` timed runs per candidate, and at most its share of `time_budget_s` (but
    # at least 10): a 0.5 ms model gets hundreds of runs, so its p99 is not decided by one
    # preemption, and a 50 ms model still finishes in seconds.
    runs: int = 1000
    warmup: int = 5
    time_budget_s: float = 6.0  # for the whole benchmark phase
    # The accuracy budget against the original; `min_cosine` is its older spelling.
    max_drop: float = field(default=DEFAULT_MAX_DROP, metadata={"toml": ("max_drop", "min_cosine")})
    max_abs: float | None = None  # None: reported, not gated
    threads: int | None = field(default=None, metadata=_PER_MODEL)
    cpus: tuple[int, ...] | None = field(default=None, metadata=_PER_MODEL)
    shapes: Mapping[str, tuple[int, ...]] | None = field(default=None, metadata=_PER_MODEL)
    # or "openvino", "openvino:CPU", "openvino:CPU:bf16"
    backend: str = field(default="auto", metadata=_PER_MODEL)
    # "int8": choose among the INT8 variants only
    precision: str = field(default="auto", metadata=_PER_MODEL)
    # A detector's score output (logits): the accuracy rule compares detections
    # (edged.selection.accuracy.ScoreMap), not raw values.
    scores: str | None = field(default=None, metadata=_PER_MODEL)
    # Each backend's own options ([models.backend_options.<backend>]: RKNN's npu_cores), by
    # backend name, as the backends read them.
    backend_options: Mapping[str, Mapping[str, Any]] = field(
        default_factory=dict, hash=False, metadata=_PER_MODEL
    )

    def key_parts(self) -> dict[str, Any]:
        parts: dict[str, Any] = {}
        if self.backend_options:
            parts["backend_options"] = {
                name: {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(opts.items())}
                for name, opts in sorted(self.backend_options.items())
                if opts
            }
        # A quick look (`edgectl backends --runs 3`: fewer runs than a p99 needs, the
        # benchmark's minimum of 10) is its own decision, never the one the daemon reads.
        # Other timings share one, as before.
        if self.runs < QUICK_LOOK_RUNS:
            parts["runs"] = self.runs
        return parts | {
            "max_drop": self.max_drop,
            "max_abs": self.max_abs,
            "threads": self.threads,
            "cpus": list(self.cpus) if self.cpus else None,
            "shapes": {k: list(v) for k, v in sorted((self.shapes or {}).items())},
            "backend": self.backend,
            "precision": self.precision,
            "scores": self.scores,
            "verify_samples": VERIFY_SAMPLES,
        }
