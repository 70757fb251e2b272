"""Detections and what is done to them after decoding: a score threshold, class-aware
non-maximum suppression, the best rows first, and the two answers apps expect: Frigate's
fixed 20x6 float32 rows and DeepStack's predictions in pixels.

NMS is written here (a greedy pass over numpy arrays, some tens of lines) rather than taken
from OpenCV or torchvision: those would be a 30-800 MB dependency for one function, and the
daemon must not pull either in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FRIGATE_ROWS = 20  # Frigate reads exactly this many rows and stops at the first under its threshold
IOU_THRESHOLD = 0.45  # the usual YOLO default
MAX_CANDIDATES = 4096  # boxes considered by NMS at most (the best-scoring), a time bound


@dataclass(frozen=True)
class Detections:
    """Boxes as (ymin, xmin, ymax, xmax), normalised 0..1 to the picture they are about,
    with their scores and class ids, in any order."""

    boxes: np.ndarray  # (n, 4) float32
    scores: np.ndarray  # (n,) float32
    classes: np.ndarray  # (n,) int64

    @classmethod
    def make(cls, boxes: Any, scores: Any, classes: Any) -> Detections:
        b = np.asarray(boxes, np.float32).reshape(-1, 4)
        s = np.asarray(scores, np.float32).reshape(-1)
        c = np.asarray(classes).reshape(-1).astype(np.int64)
        if not (len(b) == len(s) == len(c)):
            raise ValueError(f"{len(b)} boxes, {len(s)} scores and {len(c)} classes")
        return cls(b, s, c)

    @classmethod
    def empty(cls) -> Detections:
        return cls.make(np.zeros((0, 4)), [], [])

    def __len__(self) -> int:
        return len(self.scores)

    def take(self, index: np.ndarray) -> Detections:
        return Detections(self.boxes[index], self.scores[index], self.classes[index])

    def above(self, min_score: float) -> Detections:
        """Those scoring at least `min_score` (NaN scores never do)."""
        return self.take(np.flatnonzero(self.scores >= min_score))

    def best(self, count: int) -> Detections:
        """At most `count`, highest score first (ties keep their order)."""
        order = np.argsort(-self.scores, kind="stable")[:count]
        return self.take(order)

    def clipped(self) -> Detections:
        """Boxes clipped to the picture, those left with no area dropped."""
        boxes = np.clip(self.boxes, 0.0, 1.0)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        return Detections(boxes[keep], self.scores[keep], self.classes[keep])


def corners(cx: np.ndarray, cy: np.ndarray, w: np.ndarray, h: np.ndarray) -> np.ndarray:
    """(ymin, xmin, ymax, xmax) rows from centres and sizes."""
    return np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], axis=-1)


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Intersection over union of one box with each of `others`."""
    top = np.maximum(box[0], others[:, 0])
    left = np.maximum(box[1], others[:, 1])
    bottom = np.minimum(box[2], others[:, 2])
    right = np.minimum(box[3], others[:, 3])
    inter = np.clip(bottom - top, 0, None) * np.clip(right - left, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def nms(dets: Detections, iou_threshold: float = IOU_THRESHOLD, limit: int = 100) -> Detections:
    """Class-aware greedy non-maximum suppression: the best box of each cluster of boxes of
    one class overlapping more than `iou_threshold`, highest score first, at most `limit`.
    Boxes of different classes never suppress each other (each class is moved to a square
    of its own before comparing)."""
    dets = dets.best(MAX_CANDIDATES)
    if len(dets) == 0:
        return dets
    span = float(np.abs(dets.boxes).max()) + 1.0
    shifted = dets.boxes + (dets.classes.astype(np.float32) * 2 * span)[:, None]
    remaining = np.arange(len(dets))
    kept: list[int] = []
    while remaining.size and len(kept) < limit:
        first = remaining[0]
        kept.append(int(first))
        rest = remaining[1:]
        remaining = rest[_iou(shifted[first], shifted[rest]) <= iou_threshold]
    return dets.take(np.asarray(kept, dtype=np.int64))


def frigate_rows(dets: Detections, rows: int = FRIGATE_ROWS) -> np.ndarray:
    """Frigate's detector answer: float32 (rows, 6) of [class_id, score, ymin, xmin, ymax,
    xmax], normalised, best first (Frigate stops at the first row under its threshold),
    unused rows zero."""
    out = np.zeros((rows, 6), np.float32)
    top = dets.best(rows)
    n = len(top)
    out[:n, 0] = top.classes
    out[:n, 1] = top.scores
    out[:n, 2:] = top.boxes
    return out


def deepstack_predictions(
    dets: Detections, labels: dict[int, str], width: int, height: int
) -> list[dict[str, Any]]:
    """DeepStack's `predictions`: label, confidence and the box in whole pixels of the
    picture (`width` x `height`), best first. A class with no label is named by its id."""
    out = []
    top = dets.best(len(dets))
    for box, score, cls in zip(top.boxes, top.scores, top.classes, strict=True):
        ymin, xmin, ymax, xmax = (float(v) for v in box)
        out.append(
            {
                "label": labels.get(int(cls), str(int(cls))),
                "confidence": round(float(score), 4),
                "x_min": round(xmin * width),
                "y_min": round(ymin * height),
                "x_max": round(xmax * width),
                "y_max": round(ymax * height),
            }
        )
    return out
