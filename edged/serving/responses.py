"""The response side of the Open Inference Protocol (KServe v2): outputs encoded as JSON data
or as binary tensors after the JSON header (the binary extension), and tensor metadata.
Requests are decoded in `edged.serving.protocol`, which holds the datatype tables."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from backends.tensors import TensorSpec
from edged.serving.protocol import InferRequest, ProtocolError, byteorder, datatype_of

# Per-response lookups keyed by the dtype object (see protocol's _NATIVE: the same reason).
_DATATYPE_OF: dict[np.dtype, str] = {}
_LITTLE: dict[np.dtype, np.dtype] = {}


def datatype_of_dtype(dtype: np.dtype) -> str:
    name = _DATATYPE_OF.get(dtype)
    if name is None:
        name = _DATATYPE_OF[dtype] = datatype_of(dtype.name)
    return name


def little_endian(array: np.ndarray) -> np.ndarray:
    """The array in the byte order the protocol's binary data has (a view when it has it)."""
    return array.astype(byteorder(_LITTLE, array.dtype, "<"), copy=False)


def encode_response(
    model_name: str,
    request: InferRequest,
    outputs: Mapping[str, np.ndarray],
) -> tuple[bytes, int | None]:
    """(body, header length or None). Binary outputs when asked (per output or by the
    request-wide `binary_data_output`), else JSON data."""
    wanted = _wanted(request, outputs)
    unknown = sorted(set(wanted) - set(outputs))
    if unknown:
        raise ProtocolError(f"unknown output {unknown[0]!r}; outputs are {sorted(outputs)}")
    doc: dict[str, Any] = {"model_name": model_name, "model_version": "1", "outputs": []}
    if request.id is not None:
        doc["id"] = request.id
    chunks: list[bytes] = []
    as_data: list[np.ndarray] = []
    for name, binary in wanted.items():
        array = np.asarray(outputs[name])  # (ascontiguousarray makes 0-d arrays 1-d)
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of_dtype(array.dtype),
            "shape": list(array.shape),
        }
        if binary:
            data = little_endian(array).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = array.ravel().tolist()
            as_data.append(array)
        doc["outputs"].append(entry)
    # Written to shared memory: name, datatype and shape only, as Triton's HTTP server answers
    # (no data, no parameters). Triton's C++ client reads `binary_data_size` from every output
    # that has `parameters`, so echoing the region there stopped it ("attempt to access
    # non-existing object member 'binary_data_size'").
    doc["outputs"].extend(
        {k: v for k, v in entry.items() if k != "parameters"}
        for entry in request.shm_results.values()
    )
    if not chunks:
        return _dumps(doc, as_data), None
    # Binary outputs only carry strings and integers in the header: orjson writes the same
    # compact JSON several times faster.
    header = orjson.dumps(doc) if len(chunks) == len(wanted) else _dumps(doc, as_data)
    return header + b"".join(chunks), len(header)


def _wanted(request: InferRequest, outputs: Mapping[str, np.ndarray]) -> dict[str, bool]:
    """The outputs to send: those named (but not in shared memory), or all when none is."""
    if request.binary_outputs or request.shm_outputs:
        return request.binary_outputs
    return dict.fromkeys(outputs, request.binary_default)


def json_output_values(request: InferRequest, outputs: Mapping[str, np.ndarray]) -> int:
    """How many values the response carries as JSON data (its encoding cost)."""
    return sum(
        int(np.size(outputs[name]))
        for name, binary in _wanted(request, outputs).items()
        if not binary and name in outputs
    )


# JSON data of this many values or more: a 0.9 M-value output took 0.63 s in `json.dumps`,
# 34 ms with orjson. orjson writes NaN and Infinity as null, so outputs holding them keep
# the standard library (NaN stays NaN, as Triton writes it), with its pure-Python encoder:
# the C one holds the GIL for the whole document, stalling the event loop even from a thread.
FAST_JSON_VALUES = 16 * 1024
_YIELDING_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _dumps(doc: dict[str, Any], as_data: Sequence[np.ndarray]) -> bytes:
    if sum(a.size for a in as_data) < FAST_JSON_VALUES:
        return json.dumps(doc, separators=(",", ":")).encode()
    if all(a.dtype.kind not in "fc" or bool(np.isfinite(a).all()) for a in as_data):
        return orjson.dumps(doc)
    return "".join(_YIELDING_ENCODER.iterencode(doc)).encode()


def tensor_metadata(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "datatype": datatype_of(s.dtype),
            "shape": [-1 if d is None else d for d in s.shape],
        }
        for s in specs
    ]
