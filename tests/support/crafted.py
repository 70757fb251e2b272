"""Model files made to be wrong in one way, for the tests that check each is refused with the
project's error naming the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def unknown_element_type(path: Path) -> Path:
    """A valid ONNX graph whose initializer has element type 99 (none such: a newer or
    crafted file)."""
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.graph.initializer[0].data_type = 99
    path.write_bytes(model.SerializeToString())
    return path
