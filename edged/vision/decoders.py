"""From a detector's raw outputs to `Detections`, one decoder per model family, by the names
Frigate gives them (`model_type`): `ssd`, `yolox`, `yologeneric`, `yolonas`, `rfdetr`,
`dfine`. Each takes the model's outputs in the model's order and the size of the picture the
model saw (its input, height and width), and answers boxes normalised to that picture, above
`min_score`, after NMS where the family needs it. Each is written from the family's
published output layout:

- `ssd`: TensorFlow's detection post-process (TFLite_Detection_PostProcess) outputs, in
  order: boxes (1, N, 4) as normalised ymin, xmin, ymax, xmax; class ids (1, N); scores
  (1, N); the count (1,). Already suppressed.
- `yolox`: one output (1, A, 5 + C) before the grid decode (YOLOX's ONNX export default):
  per anchor point of the stride-8/16/32 grids, centre offsets, log sizes, objectness and
  class scores. Score = objectness x class score.
- `yologeneric`: one output, either (1, 4 + C, A) as YOLO v8, v9 and v11 export it (centre
  and size in input pixels, then class scores), (1, A, 5 + C) as v5 and v7 do (with
  objectness), or (1, K, 6) end to end (v10: x1, y1, x2, y2, score, class; no NMS).
- `yolonas`: the "flat" export, (K, 7) or (1, K, 7): batch index, x1, y1, x2, y2 in input
  pixels, score, class. Already suppressed.
- `rfdetr`: boxes (1, Q, 4) as normalised centre and size, and class logits (1, Q, C), in
  either order. Score = sigmoid of the best logit per query; no NMS (a set prediction).
- `dfine`: labels (1, Q), boxes (1, Q, 4) as x1, y1, x2, y2 in input pixels and scores
  (1, Q), in any order (told apart by shape and dtype); no NMS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edged.vision.boxes import IOU_THRESHOLD, Detections, corners, nms

YOLOX_STRIDES = (8, 16, 32)
MAX_DETECTIONS = 100  # after NMS; Frigate reads 20, DeepStack clients rarely more


class DecodeError(ValueError):
    """The outputs do not have the layout of the model type asked for."""


Size = tuple[int, int]  # the input picture's (height, width) in pixels
Decoder = Callable[[Sequence[np.ndarray], Size, float], Detections]


def _pixels_to_unit(dets: Detections, size: Size) -> Detections:
    h, w = size
    scale = np.array([h, w, h, w], np.float32)
    return Detections(dets.boxes / scale, dets.scores, dets.classes)


def _one(outputs: Sequence[np.ndarray], family: str) -> np.ndarray:
    if len(outputs) != 1:
        raise DecodeError(f"{family} expects one output, the model has {len(outputs)}")
    return np.asarray(outputs[0])


def _shapes(outputs: Sequence[np.ndarray]) -> str:
    return ", ".join(str(list(np.shape(o))) for o in outputs)


def decode_ssd(outputs: Sequence[np.ndarray], size: Size, min_score: float) -> Detections:
    if len(outputs) != 4:
        raise DecodeError(
            f"ssd expects the 4 post-process outputs (boxes, classes, scores, count), "
            f"the model has {len(outputs)}: {_shapes(outputs)}"
        )
    boxes, classes, scores, count = (np.asarray(o) for o in outputs)
    if (
        boxes.ndim < 2
        or boxes.shape[-1] != 4
        or classes.size != scores.size
        or boxes.size != 4 * scores.size
    ):
        raise DecodeError(
            f"ssd outputs are not boxes (1, N, 4), classes (1, N), scores (1, N), count: "
            f"{_shapes(outputs)}"
        )
    n = min(int(np.asarray(count).reshape(-1)[0]), scores.size) if count.size else scores.size
    dets = Detections.make(
        boxes.reshape(-1, 4)[:n], scores.reshape(-1)[:n], classes.reshape(-1)[:n]
    )
    return dets.above(min_score).clipped()


def _yolox_grid(size: Size, anchors: int) -> tuple[np.ndarray, np.ndarray]:
    grids, strides = [], []
    for stride in YOLOX_STRIDES:
        gh, gw = size[0] // stride, size[1] // stride
        ys, xs = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        grids.append(np.stack([xs, ys], axis=-1).reshape(-1, 2))
        strides.append(np.full((gh * gw, 1), stride))
    grid = np.concatenate(grids).astype(np.float32)
    if len(grid) != anchors:
        raise DecodeError(
            f"yolox: {anchors} anchor points, but a {size[1]}x{size[0]} input has "
            f"{len(grid)} on the stride {'/'.join(map(str, YOLOX_STRIDES))} grids"
        )
    return grid, np.concatenate(strides).astype(np.float32)


def decode_yolox(outputs: Sequence[np.ndarray], size: Size, min_score: float) -> Detections:
    raw = _one(outputs, "yolox")
    if raw.ndim != 3 or raw.shape[0] != 1 or raw.shape[2] < 6:
        raise DecodeError(f"yolox expects (1, anchors, 5 + classes), got {list(raw.shape)}")
    pred = raw[0].astype(np.float32)
    grid, stride = _yolox_grid(size, len(pred))
    centre = (pred[:, :2] + grid) * stride
    wh = np.exp(np.clip(pred[:, 2:4], -20, 20)) * stride
    cls = pred[:, 5:].argmax(axis=1)
    score = pred[:, 4] * pred[np.arange(len(pred)), 5 + cls]
    keep = score >= min_score
    boxes = corners(centre[keep, 0], centre[keep, 1], wh[keep, 0], wh[keep, 1])
    dets = _pixels_to_unit(Detections.make(boxes, score[keep], cls[keep]), size)
    return nms(dets, IOU_THRESHOLD, MAX_DETECTIONS).clipped()


def decode_yologeneric(outputs: Sequence[np.ndarray], size: Size, min_score: float) -> Detections:
    raw = _one(outputs, "yologeneric")
    if raw.ndim == 2:
        raw = raw[None]
    if raw.ndim != 3 or raw.shape[0] != 1:
        raise DecodeError(
            f"yologeneric expects one (1, rows, columns) output, got {list(raw.shape)}"
        )
    pred = raw[0].astype(np.float32)
    if pred.shape[1] == 6 and pred.shape[0] > 6:  # end to end (v10): x1 y1 x2 y2 score class
        keep = pred[:, 4] >= min_score
        p = pred[keep]
        boxes = np.stack([p[:, 1], p[:, 0], p[:, 3], p[:, 2]], axis=-1)
        return _pixels_to_unit(Detections.make(boxes, p[:, 4], p[:, 5]), size).clipped()
    if pred.shape[0] < pred.shape[1]:  # (4 + C, anchors): v8, v9, v11
        pred = pred.T
        scores_all = pred[:, 4:]
    else:  # (anchors, 5 + C): v5, v7, with objectness
        if pred.shape[1] < 6:
            raise DecodeError(f"yologeneric: cannot read {list(raw.shape)} as boxes and classes")
        scores_all = pred[:, 5:] * pred[:, 4:5]
    if scores_all.shape[1] == 0:
        raise DecodeError(f"yologeneric: no class columns in {list(raw.shape)}")
    cls = scores_all.argmax(axis=1)
    score = scores_all[np.arange(len(pred)), cls]
    keep = score >= min_score
    p = pred[keep]
    boxes = corners(p[:, 0], p[:, 1], p[:, 2], p[:, 3])
    dets = _pixels_to_unit(Detections.make(boxes, score[keep], cls[keep]), size)
    return nms(dets, IOU_THRESHOLD, MAX_DETECTIONS).clipped()


def decode_yolonas(outputs: Sequence[np.ndarray], size: Size, min_score: float) -> Detections:
    raw = _one(outputs, "yolonas")
    # The width is checked before the reshape: (0, 0) cannot be reshaped to (-1, 0).
    wide = raw.ndim in (2, 3) and raw.shape[-1] == 7
    flat = raw.reshape(-1, 7) if wide else raw
    if flat.ndim != 2 or flat.shape[1] != 7:
        raise DecodeError(
            f"yolonas expects the flat export (K, 7): batch, x1, y1, x2, y2, score, class; "
            f"got {list(raw.shape)}"
        )
    p = flat[(flat[:, 0] == 0) & (flat[:, 5] >= min_score)].astype(np.float32)
    boxes = np.stack([p[:, 2], p[:, 1], p[:, 4], p[:, 3]], axis=-1)
    return _pixels_to_unit(Detections.make(boxes, p[:, 5], p[:, 6]), size).clipped()


def decode_rfdetr(outputs: Sequence[np.ndarray], size: Size, min_score: float) -> Detections:
    arrays = [np.asarray(o) for o in outputs]
    boxes = [a for a in arrays if a.ndim == 3 and a.shape[-1] == 4]
    logits = [a for a in arrays if a.ndim == 3 and a.shape[-1] != 4]
    if len(arrays) != 2 or len(boxes) != 1 or len(logits) != 1:
        raise DecodeError(
            f"rfdetr expects boxes (1, Q, 4) and class logits (1, Q, C), got {_shapes(outputs)}"
        )
    b, lg = boxes[0][0].astype(np.float32), logits[0][0].astype(np.float32)
    if len(b) != len(lg):
        raise DecodeError(f"rfdetr: {len(b)} boxes but {len(lg)} rows of logits")
    cls = lg.argmax(axis=1)
    score = 1.0 / (1.0 + np.exp(-np.clip(lg[np.arange(len(lg)), cls], -50, 50)))
    keep = score >= min_score
    dets = Detections.make(
        corners(b[keep, 0], b[keep, 1], b[keep, 2], b[keep, 3]), score[keep], cls[keep]
    )
    return dets.best(MAX_DETECTIONS).clipped()


def decode_dfine(outputs: Sequence[np.ndarray], size: Size, min_score: float) -> Detections:
    arrays = [np.asarray(o) for o in outputs]
    boxes = [a for a in arrays if a.ndim == 3 and a.shape[-1] == 4]
    flat = [a for a in arrays if a.ndim == 2]
    labels = [a for a in flat if a.dtype.kind in "iu"]
    scores = [a for a in flat if a.dtype.kind == "f"]
    if len(arrays) != 3 or len(boxes) != 1 or len(labels) != 1 or len(scores) != 1:
        raise DecodeError(
            f"dfine expects labels (1, Q) integers, boxes (1, Q, 4) and scores (1, Q) floats, "
            f"got {_shapes(outputs)}"
        )
    b, lab, sc = boxes[0][0].astype(np.float32), labels[0][0], scores[0][0].astype(np.float32)
    keep = sc >= min_score
    xyxy = b[keep]
    yx = np.stack([xyxy[:, 1], xyxy[:, 0], xyxy[:, 3], xyxy[:, 2]], axis=-1)
    dets = _pixels_to_unit(Detections.make(yx, sc[keep], lab[keep]), size)
    return dets.best(MAX_DETECTIONS).clipped()


DECODERS: dict[str, Decoder] = {
    "ssd": decode_ssd,
    "yolox": decode_yolox,
    "yologeneric": decode_yologeneric,
    "yolonas": decode_yolonas,
    "rfdetr": decode_rfdetr,
    "dfine": decode_dfine,
}


def decode(
    model_type: str, outputs: Sequence[np.ndarray], size: Size, min_score: float
) -> Detections:
    """The detections in `outputs` of a model of `model_type` (one of DECODERS)."""
    decoder = DECODERS.get(model_type)
    if decoder is None:
        raise DecodeError(
            f"unknown model type {model_type!r}; known: {', '.join(sorted(DECODERS))}"
        )
    return decoder(outputs, size, min_score)
