"""KServe BYTES tensors (edged/serving/bytes_tensors.py): the length-prefixed binary form
tritonclient sends, the JSON form (strings, {"b64": ...}), and any bytes or JSON refused
with a BytesError naming the input, never another exception."""

from __future__ import annotations

import base64
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.serving.bytes_tensors import BytesError, from_json, from_length_prefixed


def prefixed(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def test_length_prefixed_elements_in_the_shape() -> None:
    array = from_length_prefixed(prefixed(b"a", b"", b"ccc", b"dd"), (2, 2), "x")
    assert array.shape == (2, 2) and array.dtype == object
    assert array.tolist() == [[b"a", b""], [b"ccc", b"dd"]]


def test_json_strings_and_base64() -> None:
    data = [["text", {"b64": base64.b64encode(b"\xff\xd8").decode()}]]
    assert from_json(data, (1, 2), "x").tolist() == [[b"text", b"\xff\xd8"]]


@pytest.mark.parametrize(
    ("data", "shape", "says"),
    [
        (prefixed(b"a"), (2,), "1 BYTES element(s), its shape [2] needs 2"),
        (prefixed(b"a", b"b"), (1,), "bytes after its 1 BYTES element(s)"),
        (struct.pack("<I", 10) + b"abc", (1,), "element 0 says 10 bytes, 3 are left"),
        (b"\x01\x00", (1,), "element 0 has a cut length prefix"),
    ],
)
def test_bad_binary_names_the_input(data: bytes, shape: tuple, says: str) -> None:
    with pytest.raises(BytesError) as err:
        from_length_prefixed(data, shape, "pic")
    assert "input 'pic'" in str(err.value) and says in str(err.value)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("abc", "data must be a list"),
        ([1], "element 0 must be a string"),
        ([{"b64": "***"}], "element 0 is not valid base64"),
        ([{"b64": "YQ==", "x": 1}], "element 0 must be a string"),
        (["a", "b"], "2 BYTES element(s)"),
    ],
)
def test_bad_json_names_the_input(data, says: str) -> None:
    with pytest.raises(BytesError) as err:
        from_json(data, (1,), "pic")
    assert "input 'pic'" in str(err.value) and says in str(err.value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.lists(st.integers(0, 4), max_size=3).map(tuple))
def test_any_bytes_decode_or_raise_bytes_error(data: bytes, shape: tuple) -> None:
    try:
        array = from_length_prefixed(data, shape, "x")
    except BytesError:
        return
    assert array.shape == shape and all(isinstance(e, bytes) for e in array.flat)
    assert sum(4 + len(e) for e in array.flat) == len(data)


def test_a_picture_batch_of_one_becomes_the_model_tensor() -> None:
    """Through the served model's picture contract (edged/serving/pictures.py)."""
    import io

    from PIL import Image

    from backends.tensors import TensorSpec
    from edged.config.schema import ModelConfig
    from edged.serving.pictures import pictures_of, tensors_of

    mc = ModelConfig(name="m", path=__file__, shapes={"x": (1, 3, 8, 8)})  # type: ignore[arg-type]
    pictures = pictures_of(
        mc, [TensorSpec("x", "float32", (None, 3, None, None))], [TensorSpec("y", "float32", (1,))]
    )
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (255, 0, 0)).save(out, "PNG")
    feeds, fits = tensors_of(pictures, {"x": np.array([out.getvalue()], dtype=object)}, {}, "m")
    assert len(fits) == 1
    assert feeds["x"].shape == (1, 3, 8, 8) and feeds["x"].dtype == np.float32
    assert feeds["x"][0, 0].min() == pytest.approx(1.0) and feeds["x"][0, 1:].max() == 0.0
