"""BYTES tensors of the KServe v2 protocol: each element a byte string (an encoded picture,
for the models that take pictures). In the binary extension, and in gRPC's raw contents,
every element is a 4-byte little-endian length and that many bytes, one after the other; in
JSON an element is a string (its UTF-8 bytes) or, for binary data, {"b64": "<base64>"} as
OpenVINO Model Server reads it. Both become a numpy object array of `bytes` in the request's
shape; the shared infer path turns pictures into the model's tensor (`edged.serving.pictures`).

Hand-written: the format is a few lines over the protocol's own definition, and every length
is checked against the data it claims, so a crafted one is a ProtocolError naming the input.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from typing import Any

import numpy as np

BYTES = "BYTES"
_LENGTH = struct.Struct("<I")


class BytesError(ValueError):
    """A malformed BYTES tensor; the message names the input and what is wrong."""


def read_input(
    data: Any,
    size: Any,
    binary: bytes | memoryview,
    offset: int,
    shape: tuple[int, ...],
    name: str,
    where: str,
) -> tuple[np.ndarray, int]:
    """A BYTES input of an HTTP request: from the JSON `data` when `size` (its
    binary_data_size) is None, else from `binary` at `offset`. The array and the offset after
    it."""
    if size is None:
        return from_json(data, shape, name), offset
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BytesError(f"{where}.parameters.binary_data_size must be a non-negative integer")
    if offset + size > len(binary):
        raise BytesError(
            f"input {name!r}: binary_data_size {size} runs past the end of the body "
            f"({len(binary) - offset} bytes left)"
        )
    part = memoryview(binary)[offset : offset + size]
    return from_length_prefixed(part, shape, name), offset + size


def from_length_prefixed(data: bytes | memoryview, shape: tuple[int, ...], name: str) -> np.ndarray:
    """The elements of `data` (4-byte little-endian length, then the bytes, per element) as
    an object array of `shape`; their count must be the shape's and nothing may be left."""
    count = math.prod(shape)
    view = memoryview(data)
    elements: list[bytes] = []
    offset = 0
    while offset < len(view):
        if len(elements) == count:
            raise BytesError(
                f"input {name!r}: {len(view) - offset} bytes after its {count} BYTES element(s)"
            )
        if offset + 4 > len(view):
            raise BytesError(f"input {name!r}: element {len(elements)} has a cut length prefix")
        (size,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if size > len(view) - offset:
            raise BytesError(
                f"input {name!r}: element {len(elements)} says {size} bytes, "
                f"{len(view) - offset} are left"
            )
        elements.append(bytes(view[offset : offset + size]))
        offset += size
    if len(elements) != count:
        raise BytesError(
            f"input {name!r}: {len(elements)} BYTES element(s), its shape {list(shape)} "
            f"needs {count}"
        )
    return _array(elements, shape)


def from_json(data: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    """A JSON BYTES tensor's `data`: strings (their UTF-8) or {"b64": ...} objects, flat or
    nested as the shape."""
    flat: list[Any] = []
    _flatten(data, flat, name)
    count = math.prod(shape)
    if len(flat) != count:
        raise BytesError(
            f"input {name!r}: {len(flat)} BYTES element(s), its shape {list(shape)} needs {count}"
        )
    elements = []
    for index, item in enumerate(flat):
        if isinstance(item, str):
            elements.append(item.encode("utf-8"))
        elif isinstance(item, dict) and set(item) == {"b64"} and isinstance(item["b64"], str):
            try:
                elements.append(base64.b64decode(item["b64"], validate=True))
            except (binascii.Error, ValueError):
                raise BytesError(f"input {name!r}: element {index} is not valid base64") from None
        else:
            raise BytesError(
                f'input {name!r}: element {index} must be a string or {{"b64": "..."}}'
            )
    return _array(elements, shape)


def _flatten(data: Any, out: list[Any], name: str, depth: int = 0) -> None:
    if depth > 16:
        raise BytesError(f"input {name!r}: data nested deeper than a tensor's 16 dims")
    if isinstance(data, list):
        for item in data:
            _flatten(item, out, name, depth + 1)
    elif depth == 0:
        raise BytesError(f"input {name!r}: data must be a list")
    else:
        out.append(data)


def from_elements(elements: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    """Elements already apart (gRPC's bytes_contents), in the tensor's shape."""
    return _array(elements, shape)


def _array(elements: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array.reshape(shape)


def is_bytes(array: np.ndarray) -> bool:
    return array.dtype == object
