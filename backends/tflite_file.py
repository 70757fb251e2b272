"""Reading a .tflite file without a runtime: its tensor types (full-integer, float16 or
float32), its first subgraph's inputs and outputs, and its custom op codes (a Vela- or
edgetpu-compiled model). The flatbuffers runtime reads the tables; LiteRT is never imported.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

from backends.errors import ModelError
from backends.formats import FormatFacts, Signature
from backends.tensors import TensorSpec

MAGIC = b"TFL3"  # the file identifier at byte 4


def recognise(data: bytes) -> bool:
    return data[4:8] == MAGIC


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


def read(path: Path, data: bytes) -> FormatFacts:
    types = Counter(TFLITE_TYPES.get(t, f"type{t}") for t in _tensor_types(path, data))
    ints = types["int8"] + types["uint8"]
    floats = types["float32"] + types["float16"]
    summary = ", ".join(f"{n} {t}" for t, n in types.most_common())
    if ints and ints >= 4 * max(1, types["float32"]):
        return FormatFacts("int8", f"TFLite full-integer ({summary} tensors)")
    if ints and floats:
        return FormatFacts("mixed", f"TFLite partly quantized ({summary} tensors)")
    if types["float16"]:
        return FormatFacts("fp16", f"TFLite float16 weights ({summary} tensors)")
    return FormatFacts("fp32", f"TFLite float32 ({summary} tensors)")


class _Tables:
    """Tables and vectors of a .tflite flatbuffer, read with the flatbuffers runtime's Table
    and bounds-checked (no generated schema code is shipped for TFLite in any package we
    depend on); field numbers are from TFLite's schema.fbs. Out-of-bounds reads raise
    IndexError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        # Vector entries visited, at most one per 4 bytes of the file: each entry of a real
        # file is 4 bytes of its own, read once. A crafted file whose entries all point at
        # one table (say 100,000 subgraphs sharing one of 100,000 tensors) would otherwise
        # be walked 10^10 times; it runs out of budget and is refused (ValueError).
        self.budget = len(data) // 4

    def table(self, pos: int):
        from flatbuffers.table import Table

        if not 0 <= pos <= len(self.data) - 4:  # a table holds at least its vtable offset
            raise IndexError(pos)
        return Table(self.data, pos)

    def root(self):
        return self.table(int.from_bytes(self.data[:4], "little"))

    def span(self, tab, field_index: int, width: int = 4) -> tuple[int, int]:
        """(start, count) of vector field `field_index` of `tab`, checked to lie in the file
        (arithmetic only: a 100 MB buffer costs nothing to check)."""
        off = tab.Offset(4 + 2 * field_index)
        if not off:
            return 0, 0
        start, count = tab.Vector(off), tab.VectorLen(off)
        if start < 0 or start + width * count > len(self.data):
            raise IndexError(start)
        return start, count

    def positions(self, tab, field_index: int, width: int = 4) -> range:
        """Where the elements of vector field `field_index` of `tab` lie (counted against
        the file's budget of entries)."""
        start, count = self.span(tab, field_index, width)
        self.budget -= count
        if self.budget < 0:
            raise _SharedTables("more vector entries than the file holds: its tables are shared")
        return range(start, start + width * count, width)

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


# What reading a damaged flatbuffer raises: our bounds checks (IndexError), the budget
# (_SharedTables, a ValueError), struct's short reads, and the flatbuffers runtime's own
# range check (TypeError "bad number -4580 for type uint32" for a vtable offset that points
# before the file's start).
_DAMAGED = (IndexError, ValueError, struct.error, TypeError)


class _SharedTables(ValueError):
    """A crafted file: vector entries point at tables other entries point at too."""


def _corrupt(path: Path, data: bytes, exc: Exception | None = None) -> ModelError:
    if isinstance(exc, _SharedTables):
        return ModelError(f"{path}: not a well-formed TFLite model: {exc}")
    return ModelError(
        f"{path}: truncated or corrupt TFLite model (a table or buffer lies "
        f"outside the {len(data)}-byte file)"
    )


def _tensor_types(path: Path, data: bytes) -> list[int]:
    """Tensor types of every subgraph; every buffer's data must lie inside the file."""
    reader = _Tables(data)
    try:
        model = reader.root()
        # Model field 2: subgraphs; SubGraph field 0: tensors; Tensor field 1: type (byte;
        # absent means FLOAT32); Model field 4: buffers, Buffer field 0: data.
        types = [reader.byte(t, 1) for sg in reader.tables(model, 2) for t in reader.tables(sg, 0)]
        for buf in reader.tables(model, 4):
            reader.span(buf, 0, width=1)
    except _DAMAGED as exc:
        raise _corrupt(path, data, exc) from None
    if not types:
        raise ModelError(f"{path}: TFLite model has no tensors")
    return types


def signature(path: Path, data: bytes) -> Signature:
    """The first subgraph's inputs and outputs (SubGraph fields 1 and 2 index its tensors;
    Tensor fields 0 shape, 3 name, 7 shape_signature with -1 for a dynamic dim)."""
    reader = _Tables(data)
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
    except _DAMAGED as exc:
        raise _corrupt(path, data, exc) from None


def custom_codes(path: str | Path, data: bytes | None = None) -> list[str]:
    """The custom op codes a .tflite declares (Model field 1: operator_codes; OperatorCode
    field 1: custom_code), e.g. "ethos-u" in a model Vela compiled; `data` is the file's
    bytes when already read. Builtin codes have none and are left out."""
    path = Path(path)
    if data is None:
        from backends.model_info import read_model_file

        data = read_model_file(path)
    reader = _Tables(data)
    try:
        codes = [reader.string(code, 1) for code in reader.tables(reader.root(), 1)]
    except _DAMAGED as exc:
        raise _corrupt(path, data, exc) from None
    return [code for code in codes if code]
