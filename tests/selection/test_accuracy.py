"""edged.selection.accuracy: the rule selection and quantize both gate on."""

from __future__ import annotations

import math

import numpy as np

from edged.selection.accuracy import accuracy, compare, constant_outputs


def test_one_bad_sample_is_not_averaged_away() -> None:
    refs = [{"y": np.array([100.0, 200.0, 300.0])}, {"y": np.array([1.0, 2.0, 3.0])}]
    outs = [{"y": np.array([100.0, 200.0, 300.0])}, {"y": np.array([3.0, 2.0, 1.0])}]
    acc = accuracy(refs, outs)
    # Concatenated, the cosine would be ~0.9999; per sample the second one is 0.71.
    assert acc.cosine_min < 0.8 and acc.worst_sample == 1 and acc.max_abs == 2.0
    assert acc.rule == "cosine" and not acc.passes(0.01)
    assert math.isclose(acc.score, (1.0 + acc.cosine_min) / 2)
    assert compare(refs[1], outs[1])[1] == 2.0
    assert constant_outputs([{"y": np.zeros(4)}, {"y": np.zeros(4)}]) == ["y"]
    assert constant_outputs(refs) == []


def test_nearly_constant_sample_is_judged_by_max_abs_against_the_range() -> None:
    """A probability map that is ~1e-7 everywhere for one input: its cosine is noise (0.3
    here), while 3e-8 against a range of 1 is nothing; a real difference on the same
    sample (0.2 of the range) still fails."""
    rng = np.random.default_rng(0)
    busy = rng.uniform(0, 1, 64)
    tiny = rng.uniform(0, 1e-7, 64)
    refs = [{"p": busy}, {"p": tiny}]
    noise = [{"p": busy}, {"p": rng.uniform(0, 1e-7, 64)}]
    acc = accuracy(refs, noise)
    assert acc.cosine_min < 0.9 and acc.score > 0.999 and acc.passes(0.01)
    assert acc.rule == "cosine; max-abs/range on 1 of 2 nearly constant sample(s)"
    wrong = [{"p": busy}, {"p": tiny + 0.2}]
    assert not accuracy(refs, wrong).passes(0.01)
    # Every sample constant and equal: a pass; the range is 0, so only equality counts.
    zeros = [{"p": np.zeros(8)}, {"p": np.zeros(8)}]
    assert accuracy(zeros, zeros).score == 1.0
    assert accuracy(zeros, [{"p": np.zeros(8)}, {"p": np.full(8, 1e-9)}]).score == 0.5


def test_classifier_is_judged_by_top1_agreement() -> None:
    refs = [{"c": np.array([[0.45, 0.55]])}, {"c": np.array([[0.9, 0.1]])}]
    flipped = [{"c": np.array([[0.55, 0.45]])}, {"c": np.array([[0.9, 0.1]])}]
    acc = accuracy(refs, flipped)
    assert acc.cosine > 0.98  # a cosine that hides the flip
    assert acc.rule == "top-1 agreement" and acc.top1_agreement == acc.score == 0.5
    assert not acc.passes(0.01) and acc.passes(0.5)


def test_non_finite_outputs_fail() -> None:
    refs = [{"y": np.ones(3)}]
    acc = accuracy(refs, [{"y": np.array([1.0, np.nan, 1.0])}])
    assert not acc.passes(0.5) and acc.rule == "non-finite outputs"
    assert acc.to_dict()["score"] != acc.to_dict()["score"]  # NaN survives to_dict
