"""Uploads of any content: a DeepStack form is its fields or a ProtocolError, any bytes as a
picture are pixels or an ImageError, never anything else."""

from __future__ import annotations

import io

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from edged.serving.http_deepstack import form_fields
from edged.serving.protocol import ProtocolError
from edged.vision.images import ImageError, decode_image

BOUNDARY = b"b0undary"


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(out, "PNG")
    return out.getvalue()


PNG = _png()


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=400)
    | st.lists(st.binary(max_size=40), max_size=6).map(
        lambda parts: b"".join(b"--" + BOUNDARY + b"\r\n" + p for p in parts)
    ),
    st.sampled_from(
        [b"multipart/form-data; boundary=" + BOUNDARY, b"multipart/form-data", b"text/plain", b""]
    ),
)
def test_any_form_is_its_fields_or_a_protocol_error(body: bytes, content_type: bytes) -> None:
    try:
        fields = form_fields(body, content_type)
    except ProtocolError:
        return
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in fields.items())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, len(PNG)))
def test_any_picture_bytes_are_pixels_or_an_image_error(noise: bytes, cut: int) -> None:
    for data in (noise, PNG[:cut] + noise):
        try:
            pixels, size = decode_image(data, "upload")
        except ImageError:
            continue
        assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
        assert size == pixels.shape[:2]
