"""What a model file is: format, sha256 and the precision its graph computes in.

INT8 awareness: an ONNX graph with QDQ pairs or QOperator ops, an OpenVINO IR with
FakeQuantize (or int8-compressed weights), and a full-integer TFLite model are INT8; anything
else runs but is flagged. Inspection reads the files directly and imports no inference
runtime, so it is cheap and safe to do before choosing one.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from backends.errors import ModelError
from backends.tensors import TensorSpec, format_shape

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
# TFLite TensorType enum values (schema.fbs).
TFLITE_TYPES = {
    0: "float32",
    1: "float16",
    2: "int32",
    3: "uint8",
    4: "int64",
    5: "string",
    6: "bool",
    7: "int16",
    9: "int8",
    10: "float64",
}


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    format: str  # "onnx", "openvino-ir", "tflite"
    sha256: str
    size: int
    precision: str  # "int8", "fp16", "fp32", "mixed"
    precision_detail: str
    # ONNX INT8: "u8s8" (uint8 activations, int8 weights), "u8s8-rr" (7-bit weights,
    # reduce_range), "u8u8", "s8s8"; None where not ONNX INT8 or not told by the graph.
    int8_scheme: str | None = None

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


def read_model_file(path: Path) -> bytes:
    """The bytes of a model file: a regular file only (`/dev/zero` would never end, and a
    FIFO would block this thread until someone writes), errors naming the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise ModelError(f"{path}: is a folder, not a model file")
        raise ModelError(f"{path}: not a regular file (a device, FIFO or socket)")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as exc:
            raise ModelError(f"{path}: cannot read: {exc.strerror}") from None


def write_model_file(path: Path, data: bytes) -> None:
    """Write a model whole or not at all: via PATH.part (synced, then renamed over `path`),
    which a failure removes. OSError is the caller's to word."""
    part = path.with_name(path.name + ".part")
    try:
        with part.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def inspect_model(path: str | Path) -> ModelInfo:
    path = Path(path)
    data = read_model_file(path)
    if not data:
        raise ModelError(f"{path}: empty file")
    fmt = detect_format(path, data)
    scheme = None
    if fmt == "tflite":
        precision, detail = _tflite_precision(path, data)
    elif fmt == "openvino-ir":
        precision, detail = _ir_precision(path, data)
    else:
        precision, detail, scheme = _onnx_precision(path, data)
    return ModelInfo(
        path, fmt, hashlib.sha256(data).hexdigest(), len(data), precision, detail, scheme
    )


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


def _load_onnx(path: Path, data: bytes):
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load_model_from_string(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(
            f"{path}: not a valid ONNX model ({exc.__class__.__name__}: "
            f"{str(exc)[:120] or 'protobuf parse failed'})"
        ) from None


def _onnx_precision(path: Path, data: bytes) -> tuple[str, str, str | None]:
    import onnx

    model = _load_onnx(path, data)
    graph = model.graph
    if not graph.node or not graph.output:
        raise ModelError(f"{path}: not a valid ONNX model (empty graph; truncated file?)")
    ops = Counter(node.op_type for node in graph.node)
    weight_types = Counter(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name for t in graph.initializer
    )
    qop = sorted(op for op in ops if op in QOPERATOR_OPS)
    if qop:
        return "int8", f"ONNX QOperator ({', '.join(qop[:4])})", _int8_scheme(graph)
    dq = ops["DequantizeLinear"]
    int_weights = _share(weight_types, ("int8", "uint8"))
    if dq and int_weights:
        scheme = _int8_scheme(graph)
        return (
            "int8",
            (
                f"ONNX QDQ{f' {scheme.upper()}' if scheme else ''}: "
                f"{ops['QuantizeLinear']} QuantizeLinear, {dq} "
                f"DequantizeLinear, {int_weights} int8 weight tensors"
            ),
            scheme,
        )
    if weight_types["float16"] > weight_types["float32"]:
        return "fp16", f"ONNX float16 weights ({weight_types['float16']} tensors)", None
    return "fp32", f"ONNX float32 ({len(graph.node)} nodes, no quantization)", None


def _int8_scheme(graph) -> str | None:
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
        (node.get("element_type") if (node := layer.find("data")) is not None else None)
        for layer in layers
        if layer.get("type") == "Const"
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


class _TfliteTables:
    """Tables and vectors of a .tflite flatbuffer, read with the flatbuffers runtime's Table
    and bounds-checked (no generated schema code is shipped for TFLite in any package we
    depend on); field numbers are from TFLite's schema.fbs. Out-of-bounds reads raise
    IndexError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._buf = bytearray(data)

    def table(self, pos: int):
        from flatbuffers.table import Table

        if not 0 <= pos <= len(self.data) - 4:  # a table holds at least its vtable offset
            raise IndexError(pos)
        return Table(self._buf, pos)

    def root(self):
        return self.table(int.from_bytes(self.data[:4], "little"))

    def positions(self, tab, field_index: int, width: int = 4) -> list[int]:
        """Where the elements of vector field `field_index` of `tab` lie."""
        off = tab.Offset(4 + 2 * field_index)
        if not off:
            return []
        start, count = tab.Vector(off), tab.VectorLen(off)
        if start + width * count > len(self.data):
            raise IndexError(start)
        return [start + width * i for i in range(count)]

    def tables(self, tab, field_index: int) -> list:
        return [
            self.table(p + int.from_bytes(self.data[p : p + 4], "little"))
            for p in self.positions(tab, field_index)
        ]

    def ints(self, tab, field_index: int) -> list[int]:
        return [
            int.from_bytes(self.data[p : p + 4], "little", signed=True)
            for p in self.positions(tab, field_index)
        ]

    def byte(self, tab, field_index: int, default: int = 0) -> int:
        off = tab.Offset(4 + 2 * field_index)
        return self.data[tab.Pos + off] if off else default

    def string(self, tab, field_index: int) -> str:
        off = tab.Offset(4 + 2 * field_index)
        if not off:
            return ""
        start = tab.Vector(off)
        length = tab.VectorLen(off)
        if start + length > len(self.data):
            raise IndexError(start)
        return self.data[start : start + length].decode("utf-8", "replace")


def _corrupt_tflite(path: Path, data: bytes) -> ModelError:
    return ModelError(
        f"{path}: truncated or corrupt TFLite model (a table or buffer lies "
        f"outside the {len(data)}-byte file)"
    )


def _tflite_tensor_types(path: Path, data: bytes) -> list[int]:
    """Tensor types of every subgraph; every buffer's data must lie inside the file."""
    reader = _TfliteTables(data)
    try:
        model = reader.root()
        # Model field 2: subgraphs; SubGraph field 0: tensors; Tensor field 1: type (byte;
        # absent means FLOAT32); Model field 4: buffers, Buffer field 0: data.
        types = [reader.byte(t, 1) for sg in reader.tables(model, 2) for t in reader.tables(sg, 0)]
        for buf in reader.tables(model, 4):
            reader.positions(buf, 0, width=1)
    except (IndexError, ValueError, struct.error):
        raise _corrupt_tflite(path, data) from None
    if not types:
        raise ModelError(f"{path}: TFLite model has no tensors")
    return types


def _tflite_signature(path: Path, data: bytes) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The first subgraph's inputs and outputs (SubGraph fields 1 and 2 index its tensors;
    Tensor fields 0 shape, 3 name, 7 shape_signature with -1 for a dynamic dim)."""
    reader = _TfliteTables(data)
    try:
        subgraphs = reader.tables(reader.root(), 2)
        if not subgraphs:
            raise ModelError(f"{path}: TFLite model has no subgraph")
        tensors = reader.tables(subgraphs[0], 0)

        def spec(index: int) -> TensorSpec:
            tensor = tensors[index]
            shape = reader.ints(tensor, 7) or reader.ints(tensor, 0)
            return TensorSpec(
                reader.string(tensor, 3),
                TFLITE_TYPES.get(reader.byte(tensor, 1), "unknown"),
                tuple(None if d < 0 else d for d in shape),
            )

        return (
            [spec(i) for i in reader.ints(subgraphs[0], 1)],
            [spec(i) for i in reader.ints(subgraphs[0], 2)],
        )
    except (IndexError, ValueError, struct.error):
        raise _corrupt_tflite(path, data) from None


def tflite_custom_codes(path: str | Path, data: bytes | None = None) -> list[str]:
    """The custom op codes a .tflite declares (Model field 1: operator_codes; OperatorCode
    field 1: custom_code), e.g. "ethos-u" in a model Vela compiled; `data` is the file's
    bytes when already read. Builtin codes have none and are left out."""
    path = Path(path)
    data = read_model_file(path) if data is None else data
    reader = _TfliteTables(data)
    try:
        codes = [reader.string(code, 1) for code in reader.tables(reader.root(), 1)]
    except (IndexError, ValueError, struct.error):
        raise _corrupt_tflite(path, data) from None
    return [code for code in codes if code]


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


def _onnx_signature(path: Path, data: bytes) -> tuple[list[TensorSpec], list[TensorSpec]]:
    graph = _load_onnx(path, data).graph
    inits = {init.name for init in graph.initializer}

    def spec(value) -> TensorSpec:
        tensor = value.type.tensor_type
        dims = tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None
            for d in tensor.shape.dim
        )
        return TensorSpec(value.name, ONNX_DTYPES.get(tensor.elem_type, "unknown"), dims)

    return ([spec(v) for v in graph.input if v.name not in inits], [spec(v) for v in graph.output])


def signature(path: str | Path) -> tuple[list[TensorSpec], list[TensorSpec]] | None:
    """A model file's inputs and outputs (names, dtypes, shapes with None for dynamic dims),
    read from the file without a runtime; None for formats read only by a runtime (IR)."""
    path = Path(path)
    data = read_model_file(path)
    fmt = detect_format(path, data)
    if fmt == "onnx":
        return _onnx_signature(path, data)
    if fmt == "tflite":
        return _tflite_signature(path, data)
    return None


def signature_mismatch(
    original: tuple[list[TensorSpec], list[TensorSpec]],
    variant: tuple[list[TensorSpec], list[TensorSpec]],
) -> str | None:
    """What differs between two models' inputs/outputs (names, dtypes, fixed dims), or None.
    A dim that is dynamic in either is not compared (a variant may fix a size)."""
    for kind, want, got in (
        ("inputs", original[0], variant[0]),
        ("outputs", original[1], variant[1]),
    ):
        if [s.name for s in want] != [s.name for s in got]:
            return (
                f"{kind} are {[s.name for s in got]}, the original's are {[s.name for s in want]}"
            )
        for a, b in zip(want, got, strict=True):
            if a.dtype != b.dtype:
                return f"{kind[:-1]} {a.name!r} is {b.dtype}, the original's is {a.dtype}"
            if len(a.shape) != len(b.shape) or any(
                x is not None and y is not None and x != y
                for x, y in zip(a.shape, b.shape, strict=True)
            ):
                return (
                    f"{kind[:-1]} {a.name!r} has shape {format_shape(b.shape)}, the "
                    f"original's is {format_shape(a.shape)}"
                )
    return None
