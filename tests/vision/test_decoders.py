"""Each detector family's decoder on outputs laid out as that family's export lays them out,
built here around known boxes (the real detector in the test data is checked end to end
elsewhere), and every wrong layout refused with the family's DecodeError."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edged.vision.decoders import DECODERS, DecodeError, decode

SIZE = (320, 320)
# Two objects in input pixels (x1, y1, x2, y2) and their classes
OBJECTS = [((32.0, 64.0, 96.0, 192.0), 0), ((160.0, 160.0, 288.0, 224.0), 2)]
CLASSES = 3


def _expected() -> list[tuple[int, list[float]]]:
    """(class, [ymin, xmin, ymax, xmax] normalised) of OBJECTS, in order."""
    h, w = SIZE
    return [(c, [y1 / h, x1 / w, y2 / h, x2 / w]) for (x1, y1, x2, y2), c in OBJECTS]


def _check(dets, scores: list[float]) -> None:
    assert len(dets) == len(OBJECTS)
    found = sorted(
        zip(dets.classes.tolist(), dets.boxes.tolist(), dets.scores.tolist(), strict=True)
    )
    for (cls, box, score), (want_cls, want_box), want_score in zip(
        found, _expected(), scores, strict=True
    ):
        assert cls == want_cls
        assert box == pytest.approx(want_box, abs=1e-4)
        assert score == pytest.approx(want_score, abs=1e-4)


def test_ssd_reads_the_post_process_outputs_up_to_the_count() -> None:
    boxes = np.zeros((1, 10, 4), np.float32)
    classes = np.zeros((1, 10), np.float32)
    scores = np.zeros((1, 10), np.float32)
    for i, ((cls, box), score) in enumerate(zip(_expected(), (0.9, 0.7), strict=True)):
        boxes[0, i], classes[0, i], scores[0, i] = box, cls, score
    scores[0, 2] = 0.95  # past the count: ignored
    _check(
        decode("ssd", [boxes, classes, scores, np.array([2.0], np.float32)], SIZE, 0.5), [0.9, 0.7]
    )


def _yolox_raw() -> np.ndarray:
    anchors = sum((SIZE[0] // s) * (SIZE[1] // s) for s in (8, 16, 32))
    raw = np.full((1, anchors, 5 + CLASSES), -1.0, np.float32)
    raw[0, :, 4] = 0.0  # no objectness anywhere...
    # ... but on the stride-8 grid cell holding each object's centre
    gw = SIZE[1] // 8
    for (x1, y1, x2, y2), cls in OBJECTS:
        cx, cy, w, h = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1
        gx, gy = int(cx // 8), int(cy // 8)
        row = raw[0, gy * gw + gx]
        row[:4] = [cx / 8 - gx, cy / 8 - gy, np.log(w / 8), np.log(h / 8)]
        row[4] = 0.9
        row[5:] = 0.0
        row[5 + cls] = 1.0
    return raw


def test_yolox_decodes_the_grids() -> None:
    _check(decode("yolox", [_yolox_raw()], SIZE, 0.5), [0.9, 0.9])


def test_yolox_refuses_an_input_size_its_grids_do_not_fit() -> None:
    with pytest.raises(DecodeError, match="anchor points, but a 640x640 input has 8400"):
        decode("yolox", [_yolox_raw()], (640, 640), 0.5)


def _v8(duplicate: bool = False) -> np.ndarray:
    cols = []
    for (x1, y1, x2, y2), cls in OBJECTS:
        col = np.zeros(4 + CLASSES, np.float32)
        col[:4] = [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]
        col[4 + cls] = 0.8
        cols.append(col)
        if duplicate:  # a near copy that NMS removes
            near = col.copy()
            near[0] += 1
            near[4 + cls] = 0.6
            cols.append(near)
    cols += [np.zeros(4 + CLASSES, np.float32)] * 20
    return np.stack(cols, axis=1)[None]


def test_yologeneric_v8_layout_with_nms() -> None:
    _check(decode("yologeneric", [_v8(duplicate=True)], SIZE, 0.25), [0.8, 0.8])


def test_yologeneric_v5_layout_multiplies_objectness() -> None:
    rows = np.zeros((25, 5 + CLASSES), np.float32)
    for i, ((x1, y1, x2, y2), cls) in enumerate(OBJECTS):
        rows[i, :4] = [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]
        rows[i, 4] = 0.5
        rows[i, 5 + cls] = 0.9
    _check(decode("yologeneric", [rows[None]], SIZE, 0.25), [0.45, 0.45])


def test_yologeneric_end_to_end_layout() -> None:
    rows = np.zeros((300, 6), np.float32)
    for i, ((x1, y1, x2, y2), cls) in enumerate(OBJECTS):
        rows[i] = [x1, y1, x2, y2, 0.7, cls]
    _check(decode("yologeneric", [rows[None]], SIZE, 0.5), [0.7, 0.7])


def test_yolonas_flat_layout_only_batch_zero() -> None:
    rows = [[0, x1, y1, x2, y2, 0.6, cls] for (x1, y1, x2, y2), cls in OBJECTS]
    rows.append([1, 0, 0, 10, 10, 0.99, 1])  # another picture of the batch
    _check(decode("yolonas", [np.array(rows, np.float32)], SIZE, 0.5), [0.6, 0.6])


def test_rfdetr_sigmoid_of_logits_in_either_output_order() -> None:
    h, w = SIZE
    boxes = np.zeros((1, 30, 4), np.float32)
    logits = np.full((1, 30, 91), -9.0, np.float32)
    for i, ((x1, y1, x2, y2), cls) in enumerate(OBJECTS):
        boxes[0, i] = [(x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h]
        logits[0, i, cls] = 2.0
    want = 1 / (1 + np.exp(-2.0))
    _check(decode("rfdetr", [boxes, logits], SIZE, 0.5), [want, want])
    _check(decode("rfdetr", [logits, boxes], SIZE, 0.5), [want, want])


def test_dfine_tells_its_outputs_apart() -> None:
    labels = np.zeros((1, 50), np.int64)
    boxes = np.zeros((1, 50, 4), np.float32)
    scores = np.zeros((1, 50), np.float32)
    for i, ((x1, y1, x2, y2), cls) in enumerate(OBJECTS):
        labels[0, i], boxes[0, i], scores[0, i] = cls, [x1, y1, x2, y2], 0.66
    _check(decode("dfine", [scores, labels, boxes], SIZE, 0.5), [0.66, 0.66])


@pytest.mark.parametrize(
    ("model_type", "outputs", "message"),
    [
        ("ssd", [np.zeros((1, 10, 4))], "ssd expects the 4 post-process outputs"),
        (
            "ssd",
            [np.zeros((1, 10, 3)), np.zeros((1, 10)), np.zeros((1, 10)), np.zeros(1)],
            "ssd outputs are not",
        ),
        ("yolox", [np.zeros((1, 10))], "yolox expects"),
        ("yolox", [np.zeros((1, 10, 8)), np.zeros(1)], "yolox expects one output"),
        ("yologeneric", [np.zeros((1, 10, 4))], "cannot read"),
        ("yologeneric", [np.zeros((2, 3, 4, 5))], "yologeneric expects one"),
        ("yolonas", [np.zeros((5, 6))], "flat export"),
        ("rfdetr", [np.zeros((1, 5, 4))], "rfdetr expects"),
        ("rfdetr", [np.zeros((1, 5, 4)), np.zeros((1, 6, 91))], "5 boxes but 6 rows"),
        ("dfine", [np.zeros((1, 5, 4)), np.zeros((1, 5)), np.zeros((1, 5))], "dfine expects"),
        ("centernet", [np.zeros(1)], "unknown model type 'centernet'; known: dfine, rfdetr"),
    ],
)
def test_wrong_layouts_name_the_family_and_the_shapes(model_type, outputs, message) -> None:
    with pytest.raises(DecodeError, match=message):
        decode(model_type, outputs, SIZE, 0.5)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(sorted(DECODERS)),
    st.lists(
        arrays(
            st.sampled_from([np.float32, np.int64]),
            st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple),
        ),
        max_size=4,
    ),
)
# Found by this test in a full run: an empty (0, 0) output reshaped to (-1, 0) was a ValueError.
@example("yolonas", [np.zeros((0, 0), np.float32)])
def test_any_outputs_decode_or_raise_decode_error(model_type, outputs) -> None:
    try:
        dets = decode(model_type, outputs, SIZE, 0.25)
    except DecodeError:
        return
    assert np.all((dets.boxes >= 0) & (dets.boxes <= 1))
    assert np.all(dets.scores >= 0.25)


def test_the_config_knows_every_decoder() -> None:
    from edged.config.vision import MODEL_TYPES

    assert set(MODEL_TYPES) == set(DECODERS)
