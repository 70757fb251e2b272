"""A small detector graph built for the front-end tests (not a trained model: the real detector
in the test data is checked apart). Its one output is in YOLO v8's layout, (1, 4 + 3, 8):
one box, class `cls`, centred, half the picture's size, scoring the picture's mean pixel
value after preprocessing (so two peers sending pictures of different brightness get
different scores: cross-talk shows); the other anchors score 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SIZE = 64  # the input's height and width
CLASSES = 3
ANCHORS = 8


def make_detector(path: Path, cls: int = 0) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    base = np.zeros((1, 4 + CLASSES, ANCHORS), np.float32)
    base[0, :4, 0] = [SIZE / 2, SIZE / 2, SIZE / 2, SIZE / 2]  # cx, cy, w, h in pixels
    mask = np.zeros_like(base)
    mask[0, 4 + cls, 0] = 1.0
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0),
            helper.make_node("Mul", ["mask", "mean"], ["scored"]),
            helper.make_node("Add", ["base", "scored"], ["output0"]),
        ],
        "detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 4 + CLASSES, ANCHORS])],
        [numpy_helper.from_array(base, "base"), numpy_helper.from_array(mask, "mask")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path
