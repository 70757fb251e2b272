"""The decision of a selection, and its cache under the state dir.

`Selection` is the pick (the variant and candidate the daemon loads) with the `Evidence` of
every candidate of every variant tried (what ran, its accuracy and latency, why it lost) and
the one-line why. It is stored keyed by `cache_key`: the sha256 of every file of the family,
the hardware fingerprint, the runtime versions, the evaluation data and the policy, so a
restart does not re-benchmark.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends import Candidate
from backends.model_info import ModelInfo
from edged.selection.accuracy import Accuracy
from edged.selection.bench import LatencyStats
from edged.selection.candidates import find_candidate, runtime_versions
from edged.selection.policy import Policy
from sysconf.hardware import HardwareFacts

# 3: model families, accuracy against the original (edged.selection.accuracy), max_drop.
CACHE_VERSION = 3


@dataclass
class Evidence:
    candidate: Candidate
    status: str  # "selected", "passed", "rejected" (accuracy), "failed", "unavailable"
    reason: str = ""
    precision: str | None = None  # what really ran
    cosine: float | None = None  # against the original (or, lone INT8, its own float)
    max_abs: float | None = None
    latency: LatencyStats | None = None
    load_s: float | None = None
    rss_growth_bytes: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    variant: str = ""  # the model file this ran ("" in evidence cached before families)
    accuracy: Accuracy | None = None
    # p50 of the original on the same backend:device over this one's (above 1: faster).
    speedup_vs_original: float | None = None

    @property
    def key(self) -> str:
        """Unique within a selection: the variant's file and the candidate."""
        return f"{self.variant}|{self.candidate.key}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "backend": self.candidate.backend,
            "device": self.candidate.device,
            "requested_precision": self.candidate.precision,
            "precision": self.precision,
            "status": self.status,
            "reason": self.reason,
            "cosine": self.cosine,
            "max_abs": self.max_abs,
            "accuracy": self.accuracy.to_dict() if self.accuracy else None,
            "speedup_vs_original": self.speedup_vs_original,
            "latency": self.latency.to_dict() if self.latency else None,
            "load_s": self.load_s,
            "rss_growth_bytes": self.rss_growth_bytes,
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        latency = data.get("latency")
        acc = data.get("accuracy")
        return cls(
            candidate=Candidate(data["backend"], data["device"], data["requested_precision"]),
            status=data["status"],
            reason=data.get("reason", ""),
            precision=data.get("precision"),
            cosine=data.get("cosine"),
            max_abs=data.get("max_abs"),
            latency=LatencyStats(**latency) if latency else None,
            load_s=data.get("load_s"),
            rss_growth_bytes=data.get("rss_growth_bytes"),
            info=dict(data.get("info") or {}),
            variant=data.get("variant", ""),
            accuracy=Accuracy.from_dict(acc) if acc else None,
            speedup_vs_original=data.get("speedup_vs_original"),
        )


@dataclass
class Selection:
    model: ModelInfo  # the variant that was selected (the file the daemon loads)
    selected: Evidence | None
    evidence: list[Evidence]
    shapes: dict[str, tuple[int, ...]]
    cache_key: str
    from_cache: bool = False
    created: float = field(default_factory=time.time)
    warnings: list[str] = field(default_factory=list)
    original: ModelInfo | None = None  # the family's original (None: the model alone)
    models: dict[str, ModelInfo] = field(default_factory=dict)  # variant path -> info
    against_original: bool = True  # False: a lone INT8 model, held to its own float
    why: str = ""  # one line: why the pick won (and what lost, and why)
    evaluation: str = ""  # what the outputs were compared on

    def summary(self) -> dict[str, Any] | None:
        """The `selected` object of `edgectl backends --json` (a stable shape)."""
        ev = self.selected
        if ev is None:
            return None
        return {
            "variant": str(self.model.path),
            "model_precision": self.model.precision,
            "backend": ev.candidate.backend,
            "device": ev.candidate.device,
            "precision": ev.precision,
            "p50_ms": ev.latency.p50_ms if ev.latency else None,
            "p99_ms": ev.latency.p99_ms if ev.latency else None,
            "cosine": ev.cosine,
            "max_abs": ev.max_abs,
            "accuracy": ev.accuracy.to_dict() if ev.accuracy else None,
            "against_original": self.against_original,
            "why": self.why,
            "from_cache": self.from_cache,
            "warnings": self.warnings,
        }

    def model_of(self, ev: Evidence) -> ModelInfo:
        """The model file `ev` ran (the selected model for evidence without a variant)."""
        return self.models.get(ev.variant, self.model)

    def load_candidate(self, hw: HardwareFacts | None = None) -> Candidate:
        """The selected candidate with its backend options, ready for `load`.

        Asks only the selected backend, so loading a cached decision imports one runtime."""
        assert self.selected is not None
        return find_candidate(hw, self.model, self.selected.candidate)


@dataclass(frozen=True)
class Evaluation:
    """Evaluation inputs given by the user (samples held out from calibration data, or an
    eval set), with an id for the cache key; None in `select` means generated inputs."""

    feeds: list[dict[str, np.ndarray]]
    source: str  # for people: "12 images held out of calib/"

    def digest(self) -> str:
        from edged.selection.inputs import feeds_digest

        return feeds_digest(self.feeds)


def cache_key(
    model: ModelInfo,
    hw: HardwareFacts,
    policy: Policy,
    variants: Sequence[ModelInfo] = (),
    evaluation: Evaluation | None = None,
) -> str:
    parts = {
        "v": CACHE_VERSION,
        "model": model.sha256,
        "variants": [v.sha256 for v in variants],
        "evaluation": evaluation.digest() if evaluation else None,
        "hardware": hw.fingerprint(),
        "runtimes": runtime_versions(),
        "policy": policy.key_parts(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _cache_path(state_dir: Path, key: str) -> Path:
    return state_dir / "selection" / f"{key}.json"


def load_cached(state_dir: Path | None, family: Sequence[ModelInfo], key: str) -> Selection | None:
    if state_dir is None:
        return None
    path = _cache_path(state_dir, key)
    models = {str(m.path): m for m in family}
    try:
        data = json.loads(path.read_text())
        evidence = [Evidence.from_dict(e) for e in data["evidence"]]
        selected = next(e for e in evidence if e.status == "selected")
        model = models[selected.variant]
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return None  # missing, unreadable or from another layout: measure again
    shapes = {k: tuple(v) for k, v in data.get("shapes", {}).items()}
    return Selection(
        model,
        selected,
        evidence,
        shapes,
        key,
        True,
        data.get("created", 0.0),
        list(data.get("warnings", [])),
        family[0],
        models,
        bool(data.get("against_original", True)),
        data.get("why", ""),
        data.get("evaluation", ""),
    )


def store(state_dir: Path, selection: Selection) -> None:
    path = _cache_path(state_dir, selection.cache_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "warnings": selection.warnings,
        "model": str(selection.model.path),
        "model_sha256": selection.model.sha256,
        "original": str(selection.original.path) if selection.original else None,
        "against_original": selection.against_original,
        "why": selection.why,
        "evaluation": selection.evaluation,
        "created": selection.created,
        "shapes": {k: list(v) for k, v in selection.shapes.items()},
        "evidence": [e.to_dict() for e in selection.evidence],
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # atomic: a crash never leaves half a decision behind
