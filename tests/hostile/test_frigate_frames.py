"""Frigate frames and JSON frames of any content: a frame becomes the model's input or a
ProtocolError, a JSON frame a header or a RequestError, never anything else."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.tensors import TensorSpec
from edged.serving.errors import RequestError
from edged.serving.frigate_zmq import _header, frame_tensor
from edged.serving.protocol import ProtocolError
from edged.vision.images import image_input
from edged.vision.settings import Preprocessing

NCHW = image_input(TensorSpec("images", "float32", (1, 3, 8, 8)), Preprocessing())
NHWC_U8 = image_input(TensorSpec("input", "uint8", (1, 8, 8, 3)), Preprocessing())


def test_pictures_and_tensors_become_the_input() -> None:
    pic = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(1, 8, 8, 3)
    x = frame_tensor({"shape": [1, 8, 8, 3], "dtype": "uint8"}, pic.tobytes(), NCHW)
    assert x.shape == (1, 3, 8, 8) and x.dtype == np.float32
    assert np.allclose(x[0].transpose(1, 2, 0), pic[0] / 255, atol=1e-6)
    chw = np.ascontiguousarray(pic.transpose(0, 3, 1, 2))
    y = frame_tensor({"shape": [1, 3, 8, 8], "dtype": "uint8"}, chw.tobytes(), NCHW)
    assert np.array_equal(x, y)
    u8 = frame_tensor({"shape": [1, 8, 8, 3], "dtype": "uint8"}, pic.tobytes(), NHWC_U8)
    assert u8.dtype == np.uint8 and np.array_equal(u8, pic)  # a quantized model: pixels as they are


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (
            {"shape": [1, 8, 8, 3], "dtype": "uint8"},
            b"x",
            "1 bytes, but shape [1, 8, 8, 3] of uint8 is 192",
        ),
        ({"shape": "1x8x8x3", "dtype": "uint8"}, b"", "shape must be 1 to 4 positive integers"),
        ({"shape": [1, 8, 8, 3], "dtype": "object"}, b"", "dtype must be one of"),
        (
            {"shape": [1, 4, 4, 3], "dtype": "uint8"},
            bytes(48),
            "takes a uint8 picture [1, 8, 8, 3]",
        ),
        ({"dtype": "uint8"}, b"", "shape must be"),
    ],
)
def test_bad_frames_say_what(header: dict, data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        frame_tensor(header, data, NCHW)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "shape": json_values | st.lists(st.integers(-5, 70_000), max_size=6),
            "dtype": json_values | st.sampled_from(["uint8", "float32", "int8", "float16"]),
        },
    ),
    st.binary(max_size=800),
)
def test_any_frame_is_an_input_or_a_protocol_error(header: dict, data: bytes) -> None:
    try:
        x = frame_tensor(header, data, NCHW)
    except ProtocolError:
        return
    assert x.shape == (1, 3, 8, 8)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_json_frame_is_a_header_or_a_request_error(frame: bytes) -> None:
    try:
        assert isinstance(_header(frame), dict)
    except RequestError as exc:
        assert exc.status == 400
