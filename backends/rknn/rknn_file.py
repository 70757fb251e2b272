"""The Rockchip .rknn file, read without librknnrt: the SoC it was built for, its inputs and
outputs, and the precision it computes in. The format is owned by `backends.rknn`
(its FORMATS); this module only reads the bytes, every length and table checked against
the file (a damaged one is a ModelError naming it: tests/hostile/test_parser_fuzz.py)."""

from __future__ import annotations

import ast
import json
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.errors import ModelError
from backends.formats import FormatFacts, Signature
from backends.tensors import TensorSpec

# The container, as rknn-toolkit2 2.5.0 writes it (checked against the models it made here;
# Netron's reader, source/rknn.js, reads the same layout), little-endian:
#   0 "RKNN"  4 four zero bytes  8 file version u64 (6 from rknn-toolkit2 2.x)  16 size u64
#   24 forty zero bytes (versions 2-6; version 1 has no padding: a 24-byte header)
#   header: the model, `size` bytes: a flatbuffer whose file identifier (bytes 4-8) is "RKNN"
#     for RKNPU2 models ("VPMN" would be an RKNPU1 OpenVX graph, from the older rknn-toolkit)
#   then a JSON length u64 and the JSON: target_platform, norm_tensor (every input and output:
#     name as "url", shape as "size", dtype with qnt_type for a quantized one) and graph
#     (which norm_tensor each input and output is), version (the toolkit's), ori_network_platform.
# An encrypted model starts with "CYPTRKNN" instead; only librknnrt with its key reads it.
MAGIC = b"RKNN"
ENCRYPTED_MAGIC = b"CYPTRKNN"
FLATBUFFER_ID = b"RKNN"
_KNOWN_VERSIONS = range(1, 7)  # the low 12 bits; 0x1001-0x1004 are the same layouts
# Tensor data types in the flatbuffer's Tensor table (field 0): only the two that tell the
# precision, checked against the builds made here: the input's code is 10 in the fp16 build
# and 3 in the int8 one, as the same file's input_json says ("float16" / "int8").
FB_INT8, FB_FLOAT16 = 3, 10
# Original frameworks whose 4-D tensors are NCHW (the others, TFLite and TensorFlow, NHWC).
_NCHW_SOURCES = ("onnx", "pytorch", "caffe", "darknet", "mxnet")


@dataclass(frozen=True)
class RknnTensor:
    spec: TensorSpec  # as the original takes or gives it (the session's interface)
    layout: str  # "nchw" or "nhwc": how a 4-D original tensor is laid out


@dataclass(frozen=True)
class RknnFile:
    version: int  # the container's file version
    target: str | None  # target_platform: "rk3588"
    toolkit: str | None  # the rknn-toolkit2 that built it: "2.5.0"
    npu: str | None  # the flatbuffer's NPU generation: "RKNPU v2", "RKNPU lite"
    inputs: tuple[RknnTensor, ...]
    outputs: tuple[RknnTensor, ...]
    precision: str  # "int8", "fp16", "mixed"
    detail: str


def recognise(data: bytes) -> bool:
    return data[:4] == MAGIC or data[:8] == ENCRYPTED_MAGIC


def read_rknn(path: Path, data: bytes) -> RknnFile:
    """What a .rknn file says about itself; ModelError names the path for a file that is not
    one, is cut short, or is corrupt."""
    if data[:8] == ENCRYPTED_MAGIC:
        raise ModelError(
            f"{path}: an encrypted RKNN model (CYPTRKNN): its target and tensors cannot be read "
            "without its key; give the model unencrypted"
        )
    if data[:4] != MAGIC:
        raise ModelError(f"{path}: not an RKNN model (no RKNN magic at byte 0)")
    if len(data) < 24:
        raise ModelError(f"{path}: truncated RKNN model ({len(data)} bytes; the header is 24+)")
    version, size = struct.unpack_from("<QQ", data, 8)
    if version & 0xFFF not in _KNOWN_VERSIONS or version >> 12 not in (0, 1):
        raise ModelError(
            f"{path}: RKNN file version {version:#x} is not one edged reads (1-6, from "
            "rknn-toolkit2 up to 2.5.0)"
        )
    header = 64 if version & 0xFFF >= 2 and size > 0 else 24
    json_at = header + size
    if len(data) < json_at + 8:
        raise ModelError(
            f"{path}: truncated RKNN model: its header says the model is {size} bytes after "
            f"byte {header}, the file has {len(data)} bytes"
        )
    (json_size,) = struct.unpack_from("<Q", data, json_at)
    end = json_at + 8 + json_size
    if len(data) < end:
        raise ModelError(
            f"{path}: truncated RKNN model: its JSON section ends at byte {end}, the file "
            f"has {len(data)} bytes"
        )
    try:
        meta = json.loads(data[json_at + 8 : end])
    except RecursionError:
        raise _corrupt(path, "its JSON section is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(path, f"its JSON section does not parse ({exc})") from None
    if not isinstance(meta, dict):
        raise ModelError(f"{path}: corrupt RKNN model: its JSON section is not an object")
    body = data[header:json_at]
    fb = _read_flatbuffer(path, body) if body[4:8] == FLATBUFFER_ID else None
    attrs = fb.attrs if fb else {}
    source = str(meta.get("ori_network_platform") or meta.get("network_platform") or "")
    default_layout = "nchw" if source.lower() in _NCHW_SOURCES else "nhwc"
    inputs, outputs = _json_tensors(path, meta, attrs, default_layout)
    targets = meta.get("target_platform")
    # rknn-toolkit2 builds for one target_platform (config() takes one); the JSON lists it.
    target = targets[0] if isinstance(targets, list) and targets else (fb and fb.runtime)
    target = str(target).lower() if target else None
    toolkit = meta.get("version")
    precision, counts = _precision(meta, fb)
    built = f"for {target}" if target else "target not stated"
    by = f" by rknn-toolkit2 {toolkit}" if toolkit else ""
    return RknnFile(
        int(version),
        target,
        str(toolkit) if toolkit else None,
        fb.npu if fb else None,
        inputs,
        outputs,
        precision,
        f"RKNN {precision} ({counts}), built {built}{by}",
    )


def read(path: Path, data: bytes) -> FormatFacts:
    model = read_rknn(path, data)
    return FormatFacts(model.precision, model.detail, target=model.target)


def signature(path: Path, data: bytes) -> Signature:
    model = read_rknn(path, data)
    return [t.spec for t in model.inputs], [t.spec for t in model.outputs]


def _corrupt(path: Path, what: str) -> ModelError:
    return ModelError(f"{path}: corrupt RKNN model: {what}")


def _json_tensors(
    path: Path, meta: dict, attrs: Mapping[str, Any], default_layout: str
) -> tuple[tuple[RknnTensor, ...], tuple[RknnTensor, ...]]:
    """Inputs and outputs in order: the JSON's `graph` says which `norm_tensor` each is; the
    flatbuffer's attrs (when there) say the original's dtype and layout."""
    try:
        tensors = {t["tensor_id"]: t for t in meta.get("norm_tensor") or []}
        found: dict[str, list[tuple[int, dict]]] = {"input": [], "output": []}
        for entry in meta.get("graph") or []:
            if entry.get("left") in found and entry.get("right") == "norm_tensor":
                norm = tensors[entry["right_tensor_id"]]
                found[entry["left"]].append((int(entry["left_tensor_id"]), norm))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _corrupt(path, f"its JSON's graph and norm_tensor do not match ({exc!r})") from None
    if not found["input"] or not found["output"]:
        raise _corrupt(path, "its JSON names no input or no output tensor")

    def described(entry: dict) -> RknnTensor:
        name, size = entry.get("url"), entry.get("size")
        if not isinstance(name, str) or not isinstance(size, list):
            raise _corrupt(path, f"a norm_tensor without a name or shape: {entry!r:.200}")
        if not all(isinstance(d, int) for d in size):
            raise _corrupt(path, f"tensor {name!r} has shape {size!r}")
        raw = attrs.get(name)
        attr: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
        dtype, layout = attr.get("dtype"), attr.get("layout")
        return RknnTensor(
            TensorSpec(
                name,
                dtype if isinstance(dtype, str) else "float32",
                tuple(d if d >= 0 else None for d in size),
            ),
            layout if layout in ("nchw", "nhwc") else default_layout,
        )

    inputs, outputs = (
        tuple(described(t) for _, t in sorted(found[kind], key=lambda pair: pair[0]))
        for kind in ("input", "output")
    )
    return inputs, outputs


def _precision(meta: dict, fb: _Flatbuffer | None) -> tuple[str, str]:
    """int8, fp16 or mixed, from the compiled graph's tensor types; without a flatbuffer,
    from the JSON's inputs (a quantized model takes int8 in: its norm_tensor's qnt_type)."""
    if fb is not None and fb.types:
        ints, halves = fb.types[FB_INT8], fb.types[FB_FLOAT16]
        counts = f"{ints} int8 and {halves} float16 tensors"
        if ints and ints >= 4 * halves:
            return "int8", counts
        if halves and halves >= 4 * ints:
            return "fp16", counts
        return ("mixed" if ints and halves else "fp16"), counts
    quantized = any(
        isinstance(t, dict)
        and isinstance(t.get("dtype"), dict)
        and t["dtype"].get("qnt_type") in ("int8", "uint8", "int16", "int4")
        for t in meta.get("norm_tensor") or []
    )
    return ("int8" if quantized else "fp16"), "from its inputs' quantization"


@dataclass(frozen=True)
class _Flatbuffer:
    npu: str | None
    runtime: str | None
    attrs: Mapping[str, Any]
    types: Counter


def _read_flatbuffer(path: Path, body: bytes) -> _Flatbuffer:
    """The fields of the compiled model that edged uses. Field numbers as Netron names them
    (source/rknn-schema.js), checked against the real files: Model 1 the NPU generation
    ("RKNPU v2"), 2 the graphs, 3 a Python literal with each input's and output's original
    dtype, shape and layout ("attrs"), 8 the target ("rk3588"); Graph 0 its tensors; Tensor 0
    the data type. Any offset outside the section is a corrupt (or cut) file."""
    fb = _Tables(body)
    try:
        model = fb.root()
        npu = fb.string(model, 1)
        runtime = fb.string(model, 8)
        literal = fb.string(model, 3)
        types: Counter = Counter()
        for graph in fb.tables(model, 2):
            for tensor in fb.tables(graph, 0):
                types[fb.int8(tensor, 0)] += 1
    except IndexError:
        raise _corrupt(path, "an offset in its compiled model lies outside the file") from None
    except ValueError as exc:
        raise _corrupt(path, str(exc)) from None
    return _Flatbuffer(npu, runtime, _attrs(literal), types)


def _attrs(literal: str | None) -> Mapping[str, Any]:
    """The original's tensors from the metadata literal; {} when it is absent or unreadable
    (dtype and layout then default: it only refines what the JSON says)."""
    if not literal or len(literal) > 1 << 20:
        return {}
    try:
        value = ast.literal_eval(literal)  # a Python literal (True, single quotes), not JSON
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return {}
    attrs = value.get("attrs") if isinstance(value, dict) else None
    return attrs if isinstance(attrs, dict) else {}


class _Tables:
    """A flatbuffer read by hand (its tables, vtables, vectors and strings), every read
    bounds-checked: there is no published schema to generate code from."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        # Vector entries visited, at most one per 4 bytes of the section: a crafted file
        # whose entries all point at one table would be walked count x count times.
        self.budget = len(buf) // 4

    def _u(self, pos: int, width: int, signed: bool = False) -> int:
        if not 0 <= pos <= len(self.buf) - width:
            raise IndexError(pos)
        return int.from_bytes(self.buf[pos : pos + width], "little", signed=signed)

    def root(self) -> int:
        return self._u(0, 4)

    def _field(self, table: int, index: int) -> int:
        vtable = table - self._u(table, 4, signed=True)
        size = self._u(vtable, 2)
        slot = 4 + 2 * index
        return self._u(vtable + slot, 2) if slot + 2 <= size else 0

    def _target(self, table: int, index: int) -> int | None:
        off = self._field(table, index)
        if not off:
            return None
        ref = table + off
        return ref + self._u(ref, 4)

    def int8(self, table: int, index: int) -> int:
        off = self._field(table, index)
        return self._u(table + off, 1, signed=True) if off else 0

    def string(self, table: int, index: int) -> str | None:
        at = self._target(table, index)
        if at is None:
            return None
        length = self._u(at, 4)
        if at + 4 + length > len(self.buf):
            raise IndexError(at)
        return self.buf[at + 4 : at + 4 + length].decode("utf-8", "replace")

    def tables(self, table: int, index: int) -> list[int]:
        at = self._target(table, index)
        if at is None:
            return []
        count = self._u(at, 4)
        if at + 4 + 4 * count > len(self.buf):
            raise IndexError(at)
        self.budget -= count
        if self.budget < 0:
            raise ValueError("more vector entries than its compiled model holds (shared tables)")
        return [at + 4 + 4 * i + self._u(at + 4 + 4 * i, 4) for i in range(count)]
