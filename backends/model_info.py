"""What a model file is: format, sha256 and the precision its graph computes in.

INT8 awareness: an ONNX graph with QDQ pairs or QOperator ops, an OpenVINO IR with
FakeQuantize (or int8-compressed weights), and a full-integer TFLite model are INT8; anything
else runs but is flagged. Inspection reads the files directly and imports no inference
runtime, so it is cheap and safe to do before choosing one.
"""

from __future__ import annotations

import hashlib
import struct
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from backends.base import ModelError

QOPERATOR_OPS = {
    "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "QGemm", "QLinearAdd",
    "QLinearMul", "QLinearSigmoid", "QLinearGlobalAveragePool", "QLinearConcat",
    "QLinearAveragePool", "QLinearLeakyRelu", "DynamicQuantizeLinear",
}
# TFLite TensorType enum values (schema.fbs).
TFLITE_TYPES = {0: "float32", 1: "float16", 2: "int32", 3: "uint8", 4: "int64", 5: "string",
                6: "bool", 7: "int16", 9: "int8", 10: "float64"}


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    format: str  # "onnx", "openvino-ir", "tflite"
    sha256: str
    size: int
    precision: str  # "int8", "fp16", "fp32", "mixed"
    precision_detail: str

    @property
    def is_int8(self) -> bool:
        return self.precision == "int8"

    @property
    def name(self) -> str:
        return self.path.name

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        data["int8"] = self.is_int8
        return data


def inspect_model(path: str | Path) -> ModelInfo:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelError(f"{path}: is a folder, not a model file") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror}") from None
    if not data:
        raise ModelError(f"{path}: empty file")
    fmt = detect_format(path, data)
    if fmt == "tflite":
        precision, detail = _tflite_precision(path, data)
    elif fmt == "openvino-ir":
        precision, detail = _ir_precision(path, data)
    else:
        precision, detail = _onnx_precision(path, data)
    return ModelInfo(path, fmt, hashlib.sha256(data).hexdigest(), len(data), precision, detail)


def detect_format(path: Path, data: bytes) -> str:
    if data[4:8] == b"TFL3":
        return "tflite"
    suffix = path.suffix.lower()
    if suffix == ".xml" or data.lstrip()[:5] == b"<?xml":
        return "openvino-ir"
    if suffix == ".onnx":
        return "onnx"
    if suffix == ".tflite":
        raise ModelError(f"{path}: not a TFLite model (no TFL3 identifier at byte 4)")
    raise ModelError(
        f"{path}: unsupported model format (expected .onnx, OpenVINO IR .xml, or .tflite)"
    )


def _share(counts: Counter, keys: tuple[str, ...]) -> int:
    return sum(counts[k] for k in keys)


def _onnx_precision(path: Path, data: bytes) -> tuple[str, str]:
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(f"{path}: not a valid ONNX model ({exc.__class__.__name__}: "
                         f"{str(exc)[:120] or 'protobuf parse failed'})") from None
    graph = model.graph
    if not graph.node or not graph.output:
        raise ModelError(f"{path}: not a valid ONNX model (empty graph; truncated file?)")
    ops = Counter(node.op_type for node in graph.node)
    weight_types = Counter(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name for t in graph.initializer
    )
    qop = sorted(op for op in ops if op in QOPERATOR_OPS)
    if qop:
        return "int8", f"ONNX QOperator ({', '.join(qop[:4])})"
    dq = ops["DequantizeLinear"]
    int_weights = _share(weight_types, ("int8", "uint8"))
    if dq and int_weights:
        return "int8", (f"ONNX QDQ: {ops['QuantizeLinear']} QuantizeLinear, {dq} "
                        f"DequantizeLinear, {int_weights} int8 weight tensors")
    if weight_types["float16"] > weight_types["float32"]:
        return "fp16", f"ONNX float16 weights ({weight_types['float16']} tensors)"
    return "fp32", f"ONNX float32 ({len(graph.node)} nodes, no quantization)"


def _ir_precision(path: Path, data: bytes) -> tuple[str, str]:
    weights = path.with_suffix(".bin")
    if not weights.exists():
        raise ModelError(f"{path}: OpenVINO IR weights {weights.name} are missing")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise ModelError(f"{path}: not a valid OpenVINO IR ({exc})") from None
    layers = root.findall("./layers/layer")
    if root.tag != "net" or not layers:
        raise ModelError(f"{path}: not an OpenVINO IR (no <net> with layers)")
    types = Counter(layer.get("type") for layer in layers)
    const_types = Counter(
        (layer.find("data").get("element_type") if layer.find("data") is not None else None)
        for layer in layers if layer.get("type") == "Const"
    )
    if types["FakeQuantize"]:
        return "int8", f"OpenVINO IR with {types['FakeQuantize']} FakeQuantize"
    if _share(const_types, ("i8", "u8", "i4", "u4")):
        return "int8", "OpenVINO IR with int8-compressed weights (activations float)"
    if const_types["f16"] > const_types["f32"]:
        return "fp16", "OpenVINO IR with f16 weights"
    return "fp32", "OpenVINO IR, float32"


def _tflite_precision(path: Path, data: bytes) -> tuple[str, str]:
    types = Counter(TFLITE_TYPES.get(t, f"type{t}") for t in _tflite_tensor_types(path, data))
    ints = _share(types, ("int8", "uint8"))
    floats = _share(types, ("float32", "float16"))
    summary = ", ".join(f"{n} {t}" for t, n in types.most_common())
    if ints and ints >= 4 * max(1, types["float32"]):
        return "int8", f"TFLite full-integer ({summary} tensors)"
    if ints and floats:
        return "mixed", f"TFLite partly quantized ({summary} tensors)"
    if types["float16"]:
        return "fp16", f"TFLite float16 weights ({summary} tensors)"
    return "fp32", f"TFLite float32 ({summary} tensors)"


def _tflite_tensor_types(path: Path, data: bytes) -> list[int]:
    """Tensor types of every subgraph, read from the flatbuffer with bounds checks.

    Read with the flatbuffers runtime's Table (no generated schema code is shipped for
    TFLite in any package we depend on); field numbers are from TFLite's schema.fbs.
    """
    from flatbuffers.table import Table

    def table(pos: int) -> Table:
        if not 0 <= pos < len(data) - 4:
            raise IndexError(pos)
        return Table(bytearray_data, pos)

    def vector(tab: Table, field_index: int) -> list[int]:
        off = tab.Offset(4 + 2 * field_index)
        if not off:
            return []
        start, count = tab.Vector(off), tab.VectorLen(off)
        if start + 4 * count > len(data):
            raise IndexError(start)
        return [start + 4 * i for i in range(count)]

    bytearray_data = bytearray(data)
    try:
        model = table(int.from_bytes(data[:4], "little"))
        types: list[int] = []
        for sg_pos in vector(model, 2):
            subgraph = table(sg_pos + int.from_bytes(data[sg_pos : sg_pos + 4], "little"))
            for t_pos in vector(subgraph, 0):
                tensor = table(t_pos + int.from_bytes(data[t_pos : t_pos + 4], "little"))
                off = tensor.Offset(6)  # field 1: type (byte; absent means FLOAT32)
                types.append(data[tensor.Pos + off] if off else 0)
        for b_pos in vector(model, 4):  # buffers: their data must lie inside the file
            buf = table(b_pos + int.from_bytes(data[b_pos : b_pos + 4], "little"))
            off = buf.Offset(4)
            if off and buf.Vector(off) + buf.VectorLen(off) > len(data):
                raise IndexError(buf.Vector(off))
    except (IndexError, ValueError, struct.error):
        raise ModelError(f"{path}: truncated or corrupt TFLite model (a table or buffer "
                         f"lies outside the {len(data)}-byte file)") from None
    if not types:
        raise ModelError(f"{path}: TFLite model has no tensors")
    return types
