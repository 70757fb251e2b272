"""How close a run's outputs are to a reference's: the one accuracy rule that backend
selection and `edgectl quantize` both gate on.

Per evaluation sample and output, the figure is the cosine of the two output vectors, except
where the reference output is nearly constant or numerically tiny for that sample (its spread
is below `TINY_SPREAD` of the output's range over the whole evaluation set): there a cosine
measures rounding noise (a text detector that sees no text answers ~1e-7 everywhere, and two
correct FP32 runtimes give a cosine of 0.97 on it), so the figure is 1 - max-abs difference /
the output's range instead. A sample's figure is its worst output's. The gated score is the
top-1 agreement for classifiers (a softmax over few classes keeps a high cosine while the
answer flips) and otherwise the mean of the samples' figures; the worst sample is reported.
It passes when the score is at least 1 - max_drop.

A detector's raw outputs are a poor thing to hold INT8 to: most of its anchors answer very
negative logits that no one reads, and a full-integer model's output step (about one logit
where the range spans hundreds) moves every score near the threshold. Given its score output
(`ScoreMap`), a sample's figure is what the detector's user sees: the agreement of the two
models' detections and the cosine of the box outputs at the anchors both detect, the lower
of the two. The agreement is weighted by score, so that an anchor crossing the threshold
moves it a little, not all the way: over the anchors either model scores at or above the
threshold, the sum of the lower of the two scores over the sum of the higher; 1.0 when
neither detects anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from backends.errors import BackendError

# A sample's reference output whose spread (max - min) is below this share of the output's
# range over the evaluation set is "nearly constant": judged by max-abs, not cosine.
TINY_SPREAD = 1e-3


@dataclass(frozen=True)
class Accuracy:
    score: float  # the gated figure (higher is better): top-1 agreement or mean sample score
    cosine: float  # mean over samples of the worst output's cosine, as measured
    cosine_min: float  # the worst sample's cosine
    max_abs: float  # largest absolute difference of any output value
    top1_agreement: float | None  # classifiers only
    rule: str  # what decided: "top-1 agreement", "cosine", "cosine; max-abs/range on 1 of 4"
    worst_sample: int = 0  # index of the sample with the lowest figure

    def passes(self, max_drop: float) -> bool:
        return self.score >= 1.0 - max_drop  # NaN fails

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Accuracy:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class ScoreMap:
    """A detector's score output (per-anchor logits, or probabilities) and how it is read."""

    output: str
    logits: bool = True  # a sigmoid turns the values into scores
    threshold: float = 0.5

    def describe(self) -> str:
        return (
            f"score-weighted agreement of {self.output} detections (score >= "
            f"{self.threshold:g}) and box cosine where both detect"
        )


def _pairs(
    reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Outputs matched by name, else by position (runtimes may rename outputs of converted
    graphs), as float64 vectors."""
    ref_items = list(reference.items())
    got_items = (
        [(name, got[name]) for name, _ in ref_items]
        if set(reference) <= set(got)
        else list(got.items())
    )
    if len(got_items) != len(ref_items):
        raise BackendError(f"{len(got_items)} outputs, the reference has {len(ref_items)}")
    pairs = []
    for (name, ref), (_, out) in zip(ref_items, got_items, strict=True):
        a = np.asarray(ref, dtype=np.float64).ravel()
        b = np.asarray(out, dtype=np.float64).ravel()
        if a.shape != b.shape:
            raise BackendError(f"output {name!r} has {b.size} values, reference {a.size}")
        pairs.append((name, a, b))
    return pairs


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    # Sums of products rather than `@`/norm: those go through OpenBLAS, whose threads then
    # spin in the daemon for a while after each call.
    denom = math.sqrt(float(np.sum(a * a)) * float(np.sum(b * b)))
    if denom == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.sum(a * b)) / denom


def compare(
    reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]
) -> tuple[float, float]:
    """(lowest cosine over outputs, highest max-abs difference) for one sample."""
    cosines, diffs = [], []
    for _, a, b in _pairs(reference, got):
        if not np.all(np.isfinite(b)):
            return float("nan"), float("inf")
        cosines.append(_cosine(a, b))
        diffs.append(float(np.max(np.abs(a - b))) if a.size else 0.0)
    return min(cosines), max(diffs)


def classifier_output(outputs: Mapping[str, np.ndarray]) -> str | None:
    """The output that looks like class scores: (batch, classes) with 2 or more classes."""
    for name, value in outputs.items():
        if np.ndim(value) == 2 and np.shape(value)[1] >= 2:
            return name
    return None


def accuracy(
    references: Sequence[Mapping[str, np.ndarray]],
    outputs: Sequence[Mapping[str, np.ndarray]],
    scores: ScoreMap | None = None,
) -> Accuracy:
    """The module's rule over evaluation samples (see the docstring); `scores` reads the
    outputs as a detector's."""
    per_sample = [_pairs(ref, got) for ref, got in zip(references, outputs, strict=True)]
    if not per_sample:
        raise BackendError("no evaluation samples")
    names = [name for name, _, _ in per_sample[0]]
    ranges = {
        name: max(
            (float(np.max(np.abs(pairs[i][1]))) if pairs[i][1].size else 0.0)
            for pairs in per_sample
        )
        for i, name in enumerate(names)
    }
    figures, cosines, diffs = [], [], []
    flat = 0
    for pairs in per_sample:
        sample_figures, sample_cosines = [], []
        sample_flat = False
        for name, a, b in pairs:
            if not np.all(np.isfinite(b)):
                nan = float("nan")
                return Accuracy(nan, nan, nan, float("inf"), None, "non-finite outputs")
            cosine = _cosine(a, b)
            diff = float(np.max(np.abs(a - b))) if a.size else 0.0
            span = ranges[name]
            spread = float(np.ptp(a)) if a.size else 0.0
            if spread <= TINY_SPREAD * span or span == 0:
                sample_flat = True
                figure = (1.0 if diff == 0 else 0.0) if span == 0 else 1.0 - diff / span
            else:
                figure = cosine
            sample_figures.append(figure)
            sample_cosines.append(cosine)
            diffs.append(diff)
        flat += sample_flat
        figures.append(min(sample_figures))
        cosines.append(min(sample_cosines))
    worst = int(np.argmin(figures))
    rule = (
        "cosine"
        if not flat
        else f"cosine; max-abs/range on {flat} of {len(figures)} nearly constant sample(s)"
    )
    top1 = None if scores else _top1(references, outputs)
    if scores is not None:
        figures = [
            _detection_figure(ref, got, scores)
            for ref, got in zip(references, outputs, strict=True)
        ]
        worst = int(np.argmin(figures))
        score, rule = float(np.mean(figures)), scores.describe()
    elif top1 is not None:
        score, rule = top1, "top-1 agreement"
    else:
        score = float(np.mean(figures))
    return Accuracy(score, float(np.mean(cosines)), min(cosines), max(diffs), top1, rule, worst)


def _detection_figure(
    reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], spec: ScoreMap
) -> float:
    """One sample's figure under a `ScoreMap` (see the module docstring)."""
    if spec.output not in reference or spec.output not in got:
        raise BackendError(f"no output {spec.output!r} (outputs: {', '.join(reference)})")
    ref_raw = np.asarray(reference[spec.output], dtype=np.float64)
    got_raw = np.asarray(got[spec.output], dtype=np.float64)
    if ref_raw.shape != got_raw.shape:
        raise BackendError(f"output {spec.output!r} has shape {got_raw.shape}, not {ref_raw.shape}")
    anchors = ref_raw.shape[:-1] if ref_raw.ndim > 1 and ref_raw.shape[-1] == 1 else ref_raw.shape

    def score(raw: np.ndarray) -> np.ndarray:
        flat = raw.reshape(-1)
        return 1.0 / (1.0 + np.exp(-np.clip(flat, -60, 60))) if spec.logits else flat

    ref_s, got_s = score(ref_raw), score(got_raw)
    # Score-weighted agreement over the anchors either model scores at or above the threshold.
    counted = np.maximum(ref_s, got_s) >= spec.threshold
    union = float(np.sum(np.maximum(ref_s, got_s)[counted]))
    figure = 1.0 if union == 0 else float(np.sum(np.minimum(ref_s, got_s)[counted])) / union
    shared = (ref_s >= spec.threshold) & (got_s >= spec.threshold)
    for name, value in reference.items():
        if name == spec.output or name not in got:
            continue
        a = np.asarray(value, dtype=np.float64)
        b = np.asarray(got[name], dtype=np.float64)
        if a.shape[: len(anchors)] == anchors and a.shape == b.shape:  # per-anchor boxes
            if shared.any():
                rows = a.reshape(ref_s.size, -1)[shared], b.reshape(ref_s.size, -1)[shared]
                figure = min(figure, _cosine(rows[0].ravel(), rows[1].ravel()))
        else:
            figure = min(figure, _cosine(a.ravel(), b.ravel()))
    return figure


def _top1(
    references: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Mapping[str, np.ndarray]]
) -> float | None:
    name = classifier_output(references[0])
    if name is None:
        return None
    index = list(references[0]).index(name)
    ref = np.concatenate([np.asarray(r[name]) for r in references])
    got = np.concatenate(
        [np.asarray(o[name] if name in o else list(o.values())[index]) for o in outputs]
    )
    return float(np.mean(ref.argmax(axis=1) == got.argmax(axis=1)))


def constant_outputs(references: Sequence[Mapping[str, np.ndarray]]) -> list[str]:
    """Outputs that are constant for every reference input: comparing them proves nothing
    (a detector that sees no text answers all zeros, on any runtime)."""
    names = list(references[0])
    return [
        name
        for name in names
        if all(np.ptp(np.asarray(ref[name], dtype=np.float64)) == 0 for ref in references)
    ]
