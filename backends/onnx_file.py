"""Reading an ONNX file without a runtime: the precision its graph computes in (QDQ or
QOperator INT8 and the activation/weight scheme, float16, float32) and its inputs and
outputs. The `onnx` package parses it; onnxruntime is never imported here.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from backends.errors import ModelError
from backends.formats import FormatFacts, Signature
from backends.tensors import TensorSpec

QOPERATOR_OPS = {
    "QLinearConv",
    "QLinearMatMul",
    "ConvInteger",
    "MatMulInteger",
    "QGemm",
    "QLinearAdd",
    "QLinearMul",
    "QLinearSigmoid",
    "QLinearGlobalAveragePool",
    "QLinearConcat",
    "QLinearAveragePool",
    "QLinearLeakyRelu",
    "DynamicQuantizeLinear",
}
# TensorProto element types -> numpy dtype names.
ONNX_DTYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
}


def load_onnx(path: Path, data: bytes):
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load_model_from_string(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(
            f"{path}: not a valid ONNX model ({exc.__class__.__name__}: "
            f"{str(exc)[:120] or 'protobuf parse failed'})"
        ) from None


def metadata(path: Path, data: bytes) -> dict[str, str]:
    """The model's metadata_props (key -> value), as its exporter wrote them."""
    return {p.key: p.value for p in load_onnx(path, data).metadata_props}


def read(path: Path, data: bytes) -> FormatFacts:
    """The model's precision. A field this onnx cannot read (an element type from a newer
    ONNX, initializer data that does not match its shape) is a ModelError naming it."""
    model = load_onnx(path, data)
    graph = model.graph
    if not graph.node or not graph.output:
        raise ModelError(f"{path}: not a valid ONNX model (empty graph; truncated file?)")
    try:
        return _facts(path, graph)
    except ModelError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ModelError(
            f"{path}: not a valid ONNX model ({exc.__class__.__name__}: {str(exc)[:120]})"
        ) from None


def _element_type(path: Path, init) -> str:
    import onnx

    try:
        return onnx.helper.tensor_dtype_to_np_dtype(init.data_type).name
    except (KeyError, ValueError, TypeError):
        raise ModelError(
            f"{path}: initializer {init.name[:80]!r} has element type {init.data_type}, which "
            f"onnx {onnx.__version__} does not know (a newer or corrupt model)"
        ) from None


def _facts(path: Path, graph) -> FormatFacts:
    ops = Counter(node.op_type for node in graph.node)
    weight_types = Counter(_element_type(path, t) for t in graph.initializer)
    qop = sorted(op for op in ops if op in QOPERATOR_OPS)
    if qop:
        return FormatFacts("int8", f"ONNX QOperator ({', '.join(qop[:4])})", int8_scheme(graph))
    dq = ops["DequantizeLinear"]
    int_weights = weight_types["int8"] + weight_types["uint8"]
    if dq and int_weights:
        scheme = int8_scheme(graph)
        return FormatFacts(
            "int8",
            f"ONNX QDQ{f' {scheme.upper()}' if scheme else ''}: "
            f"{ops['QuantizeLinear']} QuantizeLinear, {dq} "
            f"DequantizeLinear, {int_weights} int8 weight tensors",
            scheme,
        )
    if weight_types["float16"] > weight_types["float32"]:
        return FormatFacts("fp16", f"ONNX float16 weights ({weight_types['float16']} tensors)")
    return FormatFacts("fp32", f"ONNX float32 ({len(graph.node)} nodes, no quantization)")


def int8_scheme(graph) -> str | None:
    """Activation and weight types of a quantized graph: activations from the zero points
    of its QuantizeLinear nodes, weights from its 8-bit initializers of two or more axes. A
    weight range within [-64, 64] everywhere is the 7-bit `reduce_range` encoding."""
    from onnx import numpy_helper

    inits = {init.name: init for init in graph.initializer}
    kinds = {2: "u8", 3: "s8"}  # TensorProto.UINT8, INT8
    activations = {
        kinds[inits[n.input[2]].data_type]
        for n in graph.node
        if n.op_type == "QuantizeLinear"
        and len(n.input) > 2
        and n.input[2] in inits
        and inits[n.input[2]].data_type in kinds
    }
    # Most of them: a constant operand quantized like an activation is an 8-bit tensor too.
    weights = Counter(
        kinds[i.data_type] for i in graph.initializer if i.data_type in kinds and len(i.dims) >= 2
    ).most_common(1)
    if len(activations) != 1 or not weights:
        return None
    widest = max(
        (
            int(abs(numpy_helper.to_array(i).astype(int)).max())
            for i in graph.initializer
            if i.data_type == 3 and len(i.dims) >= 2
        ),
        default=0,
    )
    scheme = f"{activations.pop()}{weights[0][0]}"
    return "u8s8-rr" if scheme == "u8s8" and widest <= 64 else scheme


def signature(path: Path, data: bytes) -> Signature:
    graph = load_onnx(path, data).graph
    inits = {init.name for init in graph.initializer}

    def spec(value) -> TensorSpec:
        tensor = value.type.tensor_type
        dims = tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None
            for d in tensor.shape.dim
        )
        return TensorSpec(value.name, ONNX_DTYPES.get(tensor.elem_type, "unknown"), dims)

    return ([spec(v) for v in graph.input if v.name not in inits], [spec(v) for v in graph.output])
