"""Open Inference Protocol (KServe v2) request decoding and response encoding.

Pure functions over bytes, so the decoder can be fuzzed on its own. JSON tensors and the
binary tensor extension (the one Triton and tritonclient speak): a JSON header of
`Inference-Header-Content-Length` bytes followed by raw tensor bytes in input order, each
input saying its size in `parameters.binary_data_size`; and the raw-binary form where the
whole body is the one input's bytes (header length 0).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

from backends.tensors import TensorSpec
from edged.serving import bytes_tensors

VERSION = "1"  # each model serves one version; its name in the protocol

# OIP datatype <-> numpy dtype (little-endian, as the extension specifies).
DATATYPES = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
NAMES = {dtype.name: name for name, dtype in DATATYPES.items()}
MAX_DIMS = 16
MAX_ELEMENTS = 2**31  # per tensor, and per product of its non-zero dims


BYTES = bytes_tensors.BYTES


class ProtocolError(ValueError):
    """A malformed request (HTTP 400); the message says what and where."""


def datatype_of(dtype_name: str) -> str:
    return NAMES.get(np.dtype(dtype_name).name, dtype_name.upper())


# Per-request lookups keyed by the dtype object: `dtype.name` and `newbyteorder` are Python-
# level in numpy and cost a few µs per call on a path whose budget is tens of µs.
_NATIVE: dict[np.dtype, np.dtype] = {}


def byteorder(
    cache: dict[np.dtype, np.dtype], dtype: np.dtype, order: Literal["=", "<"]
) -> np.dtype:
    converted = cache.get(dtype)
    if converted is None:
        converted = cache[dtype] = dtype.newbyteorder(order)
    return converted


@dataclass(frozen=True)
class ShmRef:
    """A tensor's system shared-memory parameters, as the request gave them (the region is
    looked up, and the range checked, by `edged.serving.shared_memory`)."""

    region: str
    offset: int
    byte_size: int


def shm_ref(params: Mapping[str, Any], where: str) -> ShmRef | None:
    """The shared-memory parameters of one input or output (plain values: HTTP's JSON, or
    gRPC's InferParameter unpacked), None when it has none. Triton's rule: region and
    byte_size together, the offset optional (0)."""
    if not any(key in params for key in SHM_PARAMETERS):
        return None
    region = params.get("shared_memory_region")
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    if region is None or size is None:
        raise ProtocolError(
            f"{where}: shared_memory_region and shared_memory_byte_size go together "
            f"(shared_memory_offset is optional)"
        )
    if not isinstance(region, str) or not region:
        raise ProtocolError(f"{where}.shared_memory_region must be a non-empty string")
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(f"{where}.{key} must be a non-negative integer")
    return ShmRef(region, offset, size)


SHM_PARAMETERS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    binary_outputs: dict[str, bool] = field(default_factory=dict)  # requested output -> binary
    binary_default: bool = False  # `binary_data_output` request parameter
    timeout_ms: float | None = None
    # Inputs in system shared memory (read into `inputs` by the shared infer path, after
    # decoding), outputs to write there, and, once written, their response entries.
    shm_inputs: dict[str, tuple[np.dtype, tuple[int, ...], ShmRef]] = field(default_factory=dict)
    shm_outputs: dict[str, ShmRef] = field(default_factory=dict)
    shm_results: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Inputs that are raw camera frames (parameters.image_format: "nv12", "i420"), which the
    # shared infer path turns into the model's picture tensor.
    frames: dict[str, str] = field(default_factory=dict)
    # parameters.postprocess = "detections": a detector's outputs decoded by edged into one
    # output, "detections" [N, 20, 6] (Frigate's rows), instead of the model's own.
    postprocess: str | None = None
    # How each picture of a BYTES/frame input was fitted (set by the picture path), so that
    # decoded boxes are mapped back to the pictures' own coordinates.
    fits: list[Any] = field(default_factory=list)


def decode_request(
    body: bytes, header_length: int | None, specs: Sequence[TensorSpec]
) -> InferRequest:
    """Decode an infer request. `header_length` is Inference-Header-Content-Length (None when
    absent: the whole body is JSON)."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise ProtocolError(
                f"Inference-Header-Content-Length {header_length} is outside "
                f"the {len(body)}-byte body"
            )
        if header_length == 0:
            return _decode_raw(body, specs)
        header, binary = body[:header_length], memoryview(body)[header_length:]
        key = None  # the header, when short enough to remember (see _Layout)
        if header_length <= CACHED_HEADER_BYTES:
            key = header if type(header) is bytes else bytes(header)
            layout = _LAYOUTS.get(key)
            if layout is not None and layout.binary_size == len(binary):
                return layout.request(binary)
    else:
        header, binary = body, memoryview(b"")
        key = None
    try:
        doc = _loads(header)
    except RecursionError:
        raise ProtocolError("request JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        hint = (
            ""
            if header_length is not None or not _looks_binary(body, exc)
            else (" (binary tensor data needs an Inference-Header-Content-Length header)")
        )
        raise ProtocolError(f"request is not valid JSON: {exc}{hint}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("request must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("request has no 'inputs' list")
    params = _object(doc.get("parameters", {}), "parameters")
    inputs: dict[str, np.ndarray] = {}
    shm_inputs: dict[str, tuple[np.dtype, tuple[int, ...], ShmRef]] = {}
    frames: dict[str, str] = {}
    offset = 0
    slices: list[tuple[str, np.dtype, tuple[int, ...], int]] | None = []
    for index, item in enumerate(raw_inputs):
        where = f"inputs[{index}]"
        item = _object(item, where)
        name = item.get("name")
        if not isinstance(name, str):
            raise ProtocolError(f"{where}.name must be a string")
        if name in inputs or name in shm_inputs:
            raise ProtocolError(f"{where}: input {name!r} given twice")
        shape = _shape(item.get("shape"), f"{where}.shape")
        in_params = _object(item.get("parameters", {}), f"{where}.parameters")
        size = in_params.get("binary_data_size")
        if item.get("datatype") == BYTES:  # pictures: edged.serving.bytes_tensors
            if shm_ref(in_params, f"{where}.parameters") is not None:
                raise ProtocolError(f"input {name!r}: a BYTES input cannot be in shared memory")
            try:
                inputs[name], offset = bytes_tensors.read_input(
                    item.get("data"), size, binary, offset, shape, name, where
                )
            except bytes_tensors.BytesError as exc:
                raise ProtocolError(str(exc)) from None
            slices = None
            continue
        dtype = _dtype(item.get("datatype"), f"{where}.datatype")
        ref = shm_ref(in_params, f"{where}.parameters")
        if ref is not None:
            if size is not None or "data" in item:
                raise ProtocolError(
                    f"input {name!r} is in shared memory and has "
                    f"{'binary_data_size' if size is not None else 'data'} too: give one"
                )
            shm_inputs[name] = (dtype, shape, ref)
            slices = None  # not only binary data: nothing to reuse
            continue
        count = math.prod(shape)
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ProtocolError(
                    f"{where}.parameters.binary_data_size must be a non-negative integer"
                )
            if offset + size > len(binary):
                raise ProtocolError(
                    f"input {name!r}: binary_data_size {size} runs past the "
                    f"end of the body ({len(binary) - offset} bytes left)"
                )
            if size != count * dtype.itemsize:
                raise ProtocolError(
                    f"input {name!r}: binary_data_size {size} does not match "
                    f"shape {list(shape)} of {_name(dtype)} "
                    f"({count * dtype.itemsize} bytes)"
                )
            array = _from_bytes(binary[offset : offset + size], dtype).reshape(shape)
            offset += size
            if slices is not None:
                slices.append((name, dtype, shape, size))
        else:
            array = _json_tensor(item.get("data"), shape, dtype, name)
            slices = None  # tensor data in the header: nothing to reuse
        inputs[name] = array.astype(byteorder(_NATIVE, dtype, "="), copy=False)
        if "image_format" in in_params:
            frames[name] = image_format(in_params["image_format"], dtype, f"{where}.parameters")
    if offset != len(binary):
        raise ProtocolError(
            f"{len(binary) - offset} bytes of binary data after the last "
            f"input (binary_data_size values do not add up to the body)"
        )
    binary_default = _flag(params, "binary_data_output", False, "parameters")
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None and not isinstance(raw_outputs, list):
        raise ProtocolError("'outputs' must be a list")
    outputs = {}
    shm_outputs = {}
    for index, out in enumerate(raw_outputs or []):
        out = _object(out, f"outputs[{index}]")
        if not isinstance(out.get("name"), str):
            raise ProtocolError(f"outputs[{index}].name must be a string")
        where = f"outputs[{index}].parameters"
        out_params = _object(out.get("parameters", {}), where)
        ref = shm_ref(out_params, where)
        if ref is not None:
            shm_outputs[out["name"]] = ref
            continue
        outputs[out["name"]] = _flag(out_params, "binary_data", binary_default, where)
    timeout = params.get("timeout")
    if timeout is not None and not _positive_finite(timeout):
        raise ProtocolError("parameters.timeout must be a positive number (microseconds)")
    postprocess = postprocess_of(params.get("postprocess"), "parameters.postprocess")
    request_id = doc.get("id")
    request = InferRequest(
        id=str(request_id) if request_id is not None else None,
        inputs=inputs,
        binary_outputs=outputs,
        binary_default=binary_default,
        # The protocol's timeout parameter is in microseconds; edged deadlines are in ms.
        timeout_ms=timeout / 1000.0 if timeout is not None else None,
        shm_inputs=shm_inputs,
        shm_outputs=shm_outputs,
        frames=frames,
        postprocess=postprocess,
    )
    if (
        key is not None
        and slices is not None
        and not shm_outputs
        and not frames
        and not postprocess
    ):
        if len(_LAYOUTS) >= CACHED_HEADERS:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))  # the oldest: a bounded FIFO
        _LAYOUTS[key] = _Layout(
            tuple(slices), offset, request.id, dict(outputs), binary_default, request.timeout_ms
        )
    return request


# A client sends the same JSON header with every request of one shape (tritonclient does,
# unless it sets a request id), and parsing and checking it is most of the decoding time of a
# binary request (≈5 of 7 µs). Headers whose tensors are all binary are remembered after they
# passed every check: the same header bytes with the same amount of binary data decode to the
# same request, so a repeat only slices the body. Anything else takes the full path (and so
# gets its exact error). Decoding the header does not depend on the model's input specs
# (names, dtypes and shapes are checked against those by check_feeds at submit).
# Bounded: at most CACHED_HEADERS headers of CACHED_HEADER_BYTES.
CACHED_HEADER_BYTES = 4096
CACHED_HEADERS = 128


@dataclass(frozen=True, slots=True)
class _Layout:
    inputs: tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]  # name, dtype, shape, size
    binary_size: int
    id: str | None
    binary_outputs: dict[str, bool]
    binary_default: bool
    timeout_ms: float | None

    def request(self, binary: memoryview) -> InferRequest:
        inputs = {}
        offset = 0
        for name, dtype, shape, size in self.inputs:
            array = _from_bytes(binary[offset : offset + size], dtype).reshape(shape)
            inputs[name] = array.astype(byteorder(_NATIVE, dtype, "="), copy=False)
            offset += size
        return InferRequest(
            self.id, inputs, dict(self.binary_outputs), self.binary_default, self.timeout_ms
        )


_LAYOUTS: dict[bytes, _Layout] = {}


FAST_JSON_BYTES = 16 * 1024
# Documents over ORJSON_MAX_BYTES, and those from YIELDING_JSON_BYTES on that orjson refuses,
# are parsed by the standard library with number callbacks written in Python. orjson and the
# standard library's C scanner each hold the GIL for a whole document (57 MB: ≈0.3 s and 1 s),
# which stalls the event loop even when the decode runs in another thread; a call back into
# the interpreter for every number lets it switch threads every few ms. The price: three
# 56 MB requests at once took 2.1-5.1 s instead of 1.6-1.9 s, while other clients waited at
# most ≈0.1 s instead of 0.35 s (0.9 s with the decode on the event loop).
YIELDING_JSON_BYTES = 1024 * 1024
ORJSON_MAX_BYTES = 8 * 1024 * 1024
# What tensor data sent as JSON costs while it is decoded, per value (measured with
# tracemalloc): the parse tree holds a Python number and a list slot for each (32 bytes for
# a float, 44 for an int beyond the small ones), then numpy's float64/int64 copy (8, made in
# pieces and joined) and the converted tensor (up to 8). Beside it, the standard library
# parses a str copy of the document. (orjson, used up to ORJSON_MAX_BYTES, reserves about
# 13x the document for its value pool, but touches ≈16 bytes a value of it.)
JSON_VALUE_BYTES = 56


def json_decode_bytes(body: bytes | bytearray, header_length: int | None) -> int:
    """The memory decoding the JSON part of `body` may take, estimated before decoding (so
    a request can be refused before it costs anything): the document once, and
    JSON_VALUE_BYTES per value, counted by its commas (there is one after every value but
    the last of each list; keys separated by commas make it a slight over-estimate)."""
    end = len(body) if header_length is None else min(max(header_length, 0), len(body))
    return end + (body.count(b",", 0, end) + 1) * JSON_VALUE_BYTES


def _loads(header: bytes) -> Any:
    """Large JSON documents (tensors sent as JSON data) go through orjson, which parses them
    ~8x faster (a 533 kB request: 6.2 ms with `json`, 0.8 ms with orjson), up to
    ORJSON_MAX_BYTES (see there). Small ones, and whatever orjson refuses (NaN/Infinity, which
    Python's json and so tritonclient write), take the standard library, so errors read the
    same. orjson turns integers beyond 64 bits into
    floats; the tensor checks below reject floats where integers are due, as they reject the
    integers themselves."""
    if FAST_JSON_BYTES <= len(header) <= ORJSON_MAX_BYTES:
        try:
            return orjson.loads(header)
        except orjson.JSONDecodeError:
            pass
    if len(header) >= YIELDING_JSON_BYTES:
        return json.loads(header, parse_float=_float, parse_int=_int)
    return json.loads(header)


def _float(text: str) -> float:
    return float(text)


def _int(text: str) -> int:
    return int(text)


def _looks_binary(body: bytes, exc: Exception) -> bool:
    """A JSON header followed by raw bytes fails as undecodable bytes or "Extra data"."""
    if isinstance(exc, UnicodeDecodeError):
        return True
    return bool(body) and (body[:1] not in (b"{", b"[", b" ", b"\n") or "Extra data" in str(exc))


def _flag(params: dict, key: str, default: bool, where: str) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"{where}.{key} must be true or false, not {_brief(value)}")
    return value


def _positive_finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:  # an integer too large for a float
        return False


def _brief(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def tensor_from_bytes(
    name: str, datatype: str, shape: Sequence[int], data: bytes | memoryview, where: str
) -> np.ndarray:
    """One input tensor from its raw little-endian bytes, with the checks `decode_request`
    makes of a binary input (datatype, shape, byte count), for the gRPC front end's
    `raw_input_contents`. `where` names the tensor in errors ("inputs[0]")."""
    dims = _shape(list(shape), f"{where}.shape")
    dtype = _dtype(datatype, f"{where}.datatype")
    count = math.prod(dims)
    if len(data) != count * dtype.itemsize:
        raise ProtocolError(
            f"input {name!r}: {len(data)} bytes of raw contents do not match shape "
            f"{list(dims)} of {_name(dtype)} ({count * dtype.itemsize} bytes)"
        )
    array = _from_bytes(data, dtype).reshape(dims)
    return array.astype(byteorder(_NATIVE, dtype, "="), copy=False)


# A typed value list (gRPC InferTensorContents) holds each datatype in one field, in a wider
# type for the narrow integers (INT8 values in int_contents, an int32 field); FP16 has none.
TYPED_FIELDS = {
    "BOOL": ("bool_contents", np.dtype("bool")),
    "INT8": ("int_contents", np.dtype("int32")),
    "INT16": ("int_contents", np.dtype("int32")),
    "INT32": ("int_contents", np.dtype("int32")),
    "INT64": ("int64_contents", np.dtype("int64")),
    "UINT8": ("uint_contents", np.dtype("uint32")),
    "UINT16": ("uint_contents", np.dtype("uint32")),
    "UINT32": ("uint_contents", np.dtype("uint32")),
    "UINT64": ("uint64_contents", np.dtype("uint64")),
    "FP32": ("fp32_contents", np.dtype("float32")),
    "FP64": ("fp64_contents", np.dtype("float64")),
}


def tensor_from_values(
    name: str, datatype: str, shape: Sequence[int], values: Any, where: str
) -> np.ndarray:
    """One input tensor from a typed value list (`TYPED_FIELDS`: the field's values, any
    sequence), checked like `tensor_from_bytes`, and the values against the datatype's range
    (an INT8 input's int32 values must fit in 8 bits)."""
    dims = _shape(list(shape), f"{where}.shape")
    dtype = _dtype(datatype, f"{where}.datatype")
    if datatype not in TYPED_FIELDS:
        raise ProtocolError(f"input {name!r}: {datatype} has no typed contents; send it raw")
    wide = TYPED_FIELDS[datatype][1]
    count = math.prod(dims)
    if len(values) != count:
        raise ProtocolError(
            f"input {name!r}: {len(values)} values for shape {list(dims)} ({count} expected)"
        )
    array = np.fromiter(values, wide, count)
    if wide != dtype and dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise ProtocolError(
                f"input {name!r}: values outside [{info.min}, {info.max}] for {datatype}"
            )
    return array.astype(byteorder(_NATIVE, dtype, "="), copy=False).reshape(dims)


def dtype_and_shape(
    datatype: str, shape: Sequence[int], where: str
) -> tuple[np.dtype, tuple[int, ...]]:
    """A tensor's datatype and shape, checked as every input's are (a gRPC input in shared
    memory has only these)."""
    return _dtype(datatype, f"{where}.datatype"), _shape(list(shape), f"{where}.shape")


def _from_bytes(data: bytes | memoryview, dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "b":  # any non-zero byte is true; hand runtimes canonical 0/1 bytes
        return np.frombuffer(data, dtype=np.uint8) != 0
    return np.frombuffer(data, dtype=dtype)


POSTPROCESS = ("detections",)


def postprocess_of(value: Any, where: str) -> str | None:
    """The request's `postprocess` parameter: None, or "detections"."""
    if value is None:
        return None
    if value not in POSTPROCESS:
        raise ProtocolError(f'{where} must be "detections", got {_brief(value)}')
    return value


def image_format(value: Any, dtype: np.dtype, where: str) -> str:
    """A raw frame's layout (parameters.image_format) on a UINT8 input."""
    if value not in ("nv12", "i420"):
        raise ProtocolError(f'{where}.image_format must be "nv12" or "i420", got {_brief(value)}')
    if dtype != np.uint8:
        raise ProtocolError(f"{where}.image_format: a {value} frame is UINT8, not {_name(dtype)}")
    return value


def _decode_raw(body: bytes, specs: Sequence[TensorSpec]) -> InferRequest:
    if len(specs) != 1:
        raise ProtocolError(
            f"raw binary request (header length 0) needs a single-input "
            f"model; this one has {len(specs)} inputs"
        )
    spec = specs[0]
    shape = [d for d in spec.shape if d is not None]
    if len(shape) != len(spec.shape):
        raise ProtocolError(
            f"raw binary request: input {spec.name!r} has dynamic dims "
            f"{list(spec.shape)}; send a JSON header with the shape"
        )
    dtype = np.dtype(spec.dtype)
    expected = math.prod(shape) * dtype.itemsize
    if len(body) != expected:
        raise ProtocolError(
            f"raw binary request: body is {len(body)} bytes, input {spec.name!r} needs {expected}"
        )
    array = _from_bytes(body, dtype).reshape(shape)
    return InferRequest(None, {spec.name: array}, binary_default=True)


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be a JSON object")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise ProtocolError(f"{where} must be a list of non-negative integers, not {_brief(value)}")
    if len(value) > MAX_DIMS:
        raise ProtocolError(f"{where} has {len(value)} dims (at most {MAX_DIMS})")
    # Exact integer arithmetic (no float/int64 overflow), and a zero dim does not excuse huge
    # others: numpy cannot even describe an empty array of shape [0, 2**62].
    if math.prod(max(d, 1) for d in value) > MAX_ELEMENTS:
        raise ProtocolError(
            f"{where} {_brief(value)} is too large (more than {MAX_ELEMENTS} elements)"
        )
    return tuple(value)


def _dtype(value: Any, where: str) -> np.dtype:
    if not isinstance(value, str) or value not in DATATYPES:
        raise ProtocolError(
            f"{where} {_brief(value)} is not supported (one of {', '.join(DATATYPES)})"
        )
    return DATATYPES[value]


def _name(dtype: np.dtype) -> str:
    return NAMES[dtype.name]


def _json_tensor(data: Any, shape: tuple[int, ...], dtype: np.dtype, name: str) -> np.ndarray:
    if data is None:
        raise ProtocolError(f"input {name!r} has neither 'data' nor binary_data_size")
    try:
        array = _asarray(data)
        kind = array.dtype.kind
        if dtype.kind in "iu" and kind in "fO" and array.size:
            # numpy reads ints past INT64 mixed with smaller ones as float64 (losing digits)
            # or as objects: keep the exact ints JSON gave, if that is what they all are.
            exact = np.asarray(data, dtype=object)
            if exact.shape == array.shape and all(type(v) is int for v in exact.flat):
                array, kind = exact, "i"
        if kind == "O":
            raise ValueError("ragged, mixed or out-of-range values")
        if array.size == 0:
            pass  # `[]` parses as float64; there are no values to check
        elif kind not in "biuf":
            raise ValueError("values must be numbers, or true/false for BOOL")
        elif dtype.kind == "b" and kind != "b":
            raise ValueError("BOOL values must be true or false")
        elif dtype.kind != "b" and kind == "b":
            raise ValueError("true/false given for a numeric datatype")
        elif dtype.kind in "iu" and kind == "f":
            raise ValueError("floats given for an integer datatype")
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
            if int(array.min()) < info.min or int(array.max()) > info.max:
                raise ValueError(f"values outside [{info.min}, {info.max}]")
        if array.size == 0:
            converted = np.empty(array.shape, dtype)
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                converted = array.astype(dtype)
            if dtype.kind == "f" and bool(np.any(np.isinf(converted) & ~np.isinf(array))):
                raise ValueError(f"values too large for {_name(dtype)}")
    except (ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError(
            f"input {name!r}: data is not a {_name(dtype)} tensor ({exc})"
        ) from None
    expected = math.prod(shape)
    if converted.size != expected:
        raise ProtocolError(
            f"input {name!r}: {converted.size} values for shape {list(shape)} ({expected} expected)"
        )
    return converted.reshape(shape)


ASARRAY_VALUES = 64 * 1024


def _asarray(data: Any) -> np.ndarray:
    """np.asarray, in pieces for a long flat list (the form tritonclient sends): one call on
    millions of values holds the GIL for ~50 ms; pieces let other threads in between. The
    pieces' types promote as one call's would (ints and floats to float64, past-int64 ints
    to objects), and what one call refuses, a piece or the joining refuses."""
    if type(data) is not list or len(data) <= ASARRAY_VALUES or isinstance(data[0], list):
        return np.asarray(data)
    return np.concatenate(
        [np.asarray(data[i : i + ASARRAY_VALUES]) for i in range(0, len(data), ASARRAY_VALUES)]
    )
