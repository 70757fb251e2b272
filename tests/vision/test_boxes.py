"""Detections after decoding: NMS, Frigate's rows, DeepStack's predictions, label maps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.vision.boxes import Detections, deepstack_predictions, frigate_rows, nms
from edged.vision.labels import LabelmapError, coco80, read_labelmap


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    top, left = max(a[0], b[0]), max(a[1], b[1])
    bottom, right = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, bottom - top) * max(0.0, right - left)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def test_nms_keeps_the_best_of_overlapping_boxes_of_one_class() -> None:
    dets = Detections.make(
        [[0.1, 0.1, 0.5, 0.5], [0.11, 0.1, 0.51, 0.5], [0.6, 0.6, 0.9, 0.9]],
        [0.7, 0.9, 0.8],
        [1, 1, 1],
    )
    kept = nms(dets, 0.45)
    assert kept.scores.tolist() == pytest.approx([0.9, 0.8])
    assert kept.boxes[0].tolist() == pytest.approx([0.11, 0.1, 0.51, 0.5])


def test_nms_leaves_overlapping_boxes_of_different_classes() -> None:
    dets = Detections.make([[0.1, 0.1, 0.5, 0.5], [0.1, 0.1, 0.5, 0.5]], [0.9, 0.8], [0, 2])
    assert nms(dets).classes.tolist() == [0, 2]


boxes = st.lists(
    st.tuples(
        st.floats(0, 1),
        st.floats(0, 1),
        st.floats(0.01, 0.5),
        st.floats(0.01, 0.5),
        st.floats(0, 1),
        st.integers(0, 3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(boxes)
def test_nms_properties(rows: list[tuple[float, float, float, float, float, int]]) -> None:
    dets = Detections.make(
        [[y, x, y + h, x + w] for y, x, h, w, _, _ in rows],
        [r[4] for r in rows],
        [r[5] for r in rows],
    )
    kept = nms(dets, 0.5)
    # best first, a subset, and no two kept boxes of one class overlap past the threshold
    assert list(kept.scores) == sorted(kept.scores, reverse=True)
    originals = {
        (tuple(b), float(s), int(c))
        for b, s, c in zip(dets.boxes, dets.scores, dets.classes, strict=True)
    }
    for b, s, c in zip(kept.boxes, kept.scores, kept.classes, strict=True):
        assert (tuple(b), float(s), int(c)) in originals
    for i in range(len(kept)):
        for j in range(i + 1, len(kept)):
            if kept.classes[i] == kept.classes[j]:
                assert _iou(kept.boxes[i], kept.boxes[j]) <= 0.5 + 1e-6
    # every dropped box overlaps a kept one of its class that scores at least as high
    for b, s, c in zip(dets.boxes, dets.scores, dets.classes, strict=True):
        if not any(
            np.array_equal(b, k) and s == ks for k, ks in zip(kept.boxes, kept.scores, strict=True)
        ):
            assert any(
                kc == c and ks >= s and _iou(b, kb) > 0.5 - 1e-6
                for kb, ks, kc in zip(kept.boxes, kept.scores, kept.classes, strict=True)
            )


def test_frigate_rows_are_20_by_6_best_first_and_zero_after() -> None:
    dets = Detections.make([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.6, 0.7]], [0.3, 0.8], [4, 2])
    rows = frigate_rows(dets)
    assert rows.shape == (20, 6) and rows.dtype == np.float32
    assert rows.tobytes().__len__() == 480
    assert rows[0].tolist() == pytest.approx([2, 0.8, 0.5, 0.5, 0.6, 0.7])
    assert rows[1].tolist() == pytest.approx([4, 0.3, 0.1, 0.2, 0.3, 0.4])
    assert not rows[2:].any()


def test_frigate_rows_keep_only_the_best_20() -> None:
    scores = np.linspace(0.1, 0.9, 30)
    dets = Detections.make(np.tile([0.1, 0.1, 0.2, 0.2], (30, 1)), scores, np.zeros(30))
    rows = frigate_rows(dets)
    assert rows[:, 1].tolist() == pytest.approx(sorted(scores, reverse=True)[:20])


def test_deepstack_predictions_in_pixels_with_labels() -> None:
    dets = Detections.make([[0.25, 0.5, 0.75, 1.0]], [0.875], [0])
    assert deepstack_predictions(dets, coco80(), 640, 480) == [
        {
            "label": "person",
            "confidence": 0.875,
            "x_min": 320,
            "y_min": 120,
            "x_max": 640,
            "y_max": 360,
        }
    ]
    assert deepstack_predictions(dets, {}, 10, 10)[0]["label"] == "0"


def test_labelmaps_in_both_layouts(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("person\nbicycle\n\ncar\n")
    assert read_labelmap(plain) == {0: "person", 1: "bicycle", 3: "car"}
    numbered = tmp_path / "numbered.txt"
    numbered.write_text("0  person\n2 traffic light\n")
    assert read_labelmap(numbered) == {0: "person", 2: "traffic light"}
    assert coco80()[9] == "traffic light" and len(coco80()) == 80


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"0 person\n0 car\n", "numbered.txt:2: id 0 given twice"),
        (b"0 person\n1\n", "numbered.txt:2: id 1 has no name"),
        (b"\xff\xfe", "not UTF-8 text"),
        (b"x" * ((1 << 20) + 1), "not a label map"),
    ],
)
def test_bad_labelmaps_say_what_and_where(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "numbered.txt"
    path.write_bytes(content)
    with pytest.raises(LabelmapError, match=message.replace(".", r"\.")):
        read_labelmap(path)
    with pytest.raises(LabelmapError, match="cannot read the label map"):
        read_labelmap(tmp_path / "missing.txt")
