"""The DeepStack detection API against the real daemon: real photos (JPEG and PNG from the
test data) uploaded as multipart/form-data, boxes back in the photo's pixels for stretched and
letterboxed models, and each bad upload a clear 4xx with `success: false`."""

from __future__ import annotations

import http.client
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edged.vision.images import ImageError, decode_image
from tests.support import daemon_harness as harness
from tests.support.detector import SIZE, make_detector
from tests.support.forms import multipart

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def post(daemon: harness.Daemon, path: str, body: bytes, content_type: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepstack")
    tables = []
    for name, resize, cls in (("stretched", "stretch", 0), ("boxed", "letterbox", 2)):
        path = make_detector(folder / f"{name}.onnx", cls)
        tables.append(f"""
[[models]]
name = "{name}"
path = "{path}"
backend = "onnxruntime"
threads = 1
serves_as = ["{name}.onnx"]
[models.image]
resize = "{resize}"
[models.detector]
type = "yologeneric"
""")
    d = harness.Daemon(harness.write_config(folder, "".join(tables))).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def jpeg(photo: Path) -> bytes:
    out = io.BytesIO()
    Image.open(photo).convert("RGB").save(out, "JPEG", quality=90)
    return out.getvalue()


def test_a_real_jpeg_gets_boxes_in_its_pixels(daemon: harness.Daemon, test_data: Path) -> None:
    photo = test_data / "images" / "photos" / "chelsea.png"  # 451 x 300
    width, height = Image.open(photo).size
    body, kind = multipart(
        {"image": ("chelsea.jpg", jpeg(photo)), "min_confidence": (None, b"0.01")}
    )
    status, answer = post(daemon, "/v1/vision/detection", body, kind)
    assert status == 200, answer
    assert answer["success"] is True and answer["duration"] > 0
    [best] = answer["predictions"]
    # the built detector: one box over the middle half of what the model saw, class 0
    assert best["label"] == "person"
    assert best["x_min"] == pytest.approx(width / 4, abs=2)
    assert best["x_max"] == pytest.approx(3 * width / 4, abs=2)
    assert best["y_min"] == pytest.approx(height / 4, abs=2)
    assert best["y_max"] == pytest.approx(3 * height / 4, abs=2)
    # its score is the picture's mean brightness, as the model saw it (64 x 64)
    small = np.asarray(
        Image.open(photo).convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    )
    assert best["confidence"] == pytest.approx(small.mean() / 255, abs=0.02)


def test_letterboxed_boxes_map_back_to_the_picture(daemon: harness.Daemon, test_data: Path) -> None:
    photo = test_data / "images" / "photos" / "chelsea.png"
    width, height = Image.open(photo).size  # wider than tall: bands above and below
    data = photo.read_bytes()  # a PNG this time
    body, kind = multipart({"image": ("c.png", data), "min_confidence": (None, b"0")})
    status, answer = post(daemon, "/v1/vision/custom/boxed.onnx", body, kind)
    assert status == 200, answer
    [best] = answer["predictions"]
    assert best["label"] == "car"
    scale = SIZE / width
    band = (SIZE - round(height * scale)) // 2
    # model rows 16..48 hold picture rows (16 - band) / scale .. (48 - band) / scale
    assert best["y_min"] == pytest.approx((SIZE / 4 - band) / scale, abs=3)
    assert best["y_max"] == pytest.approx(min(height, (3 * SIZE / 4 - band) / scale), abs=3)
    assert best["x_min"] == pytest.approx(width / 4, abs=3)


@pytest.mark.parametrize(
    ("path", "fields", "content_type", "status", "message"),
    [
        ("/v1/vision/detection", None, "application/json", 400, "must be multipart/form-data"),
        ("/v1/vision/detection", {"file": ("a.jpg", b"x")}, None, 400, "no 'image' field"),
        (
            "/v1/vision/detection",
            {"image": ("a.jpg", b"not a picture")},
            None,
            400,
            "cannot read the picture",
        ),
        (
            "/v1/vision/detection",
            {"image": ("a.jpg", b"x"), "min_confidence": (None, b"high")},
            None,
            400,
            "min_confidence",
        ),
        (
            "/v1/vision/custom/nothere",
            {"image": ("a.jpg", b"x")},
            None,
            404,
            "no detector model 'nothere'",
        ),
        ("/v1/vision/face", {"image": ("a.jpg", b"x")}, None, 404, "no route"),
    ],
)
def test_bad_uploads_say_what(daemon, path, fields, content_type, status, message) -> None:
    body, kind = multipart(fields or {"image": ("a", b"x")})
    got, answer = post(daemon, path, body, content_type or kind)
    assert (got, answer["success"]) == (status, False), answer
    assert message in answer["error"], answer


def test_a_picture_too_big_is_refused_before_decoding() -> None:
    out = io.BytesIO()
    Image.new("RGB", (300, 200)).save(out, "PNG")
    with pytest.raises(ImageError, match="300x200 pixels, more than the 1000"):
        decode_image(out.getvalue(), "upload", max_pixels=1000)
