"""A real pretrained detector (NudeNet's YOLOv8n from PyPI, in Frigate's "yologeneric"
layout; its FACE_FEMALE and FACE_MALE classes on the scikit-image photos) served end to end:
a Frigate-style ZMQ peer, KServe over HTTP and gRPC with pictures as BYTES inputs (the
unmodified tritonclient), and the DeepStack route, all agreeing on the same picture.

The face regions below were read off the photos by eye (the boxes drawn on them checked
the same way), not from edged's output."""

from __future__ import annotations

import http.client
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edged.vision.boxes import Detections
from edged.vision.decoders import decode
from tests.support import daemon_harness as harness
from tests.support.forms import multipart
from tests.support.frames import to_yuv420
from tests.support.frigate_peer import Peer

tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "nudenet_320n.onnx"
SIZE = 320
FACE_FEMALE, FACE_MALE = 1, 12
# (x0, y0, x1, y1) in the photo's pixels: the region a face box must lie in, and a point of
# the face it must cover.
FACES = {
    "astronaut.png": (FACE_FEMALE, (150, 60, 300, 200), (222, 130)),
    "camera.png": (FACE_MALE, (165, 105, 285, 220), (225, 160)),
}


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("real-detector")
    models = f"""
[[models]]
name = "faces"
path = "{models_dir / MODEL}"
backend = "onnxruntime"
threads = 1
shapes = {{ images = [1, 3, {SIZE}, {SIZE}] }}
serves_as = ["{MODEL}"]
[models.image]
resize = "letterbox"
[models.detector]
type = "yologeneric"
labels = "model"

{harness.cls_table(models_dir)}
[frigate]
enabled = true
socket = "{folder / "frigate.sock"}"
"""
    d = harness.Daemon(harness.write_config(folder, models)).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def photo(test_data: Path, name: str, size: int | None = None) -> Image.Image:
    img = Image.open(test_data / "images" / "photos" / name).convert("RGB")
    return img.resize((size, size), Image.Resampling.BILINEAR) if size else img


def encoded(img: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


def best(outputs: np.ndarray, min_score: float = 0.25) -> Detections:
    """The model's raw output decoded (the decoder itself is checked on the photos in
    tests/vision/test_real_detector_decode.py)."""
    dets = decode("yologeneric", [outputs], (SIZE, SIZE), min_score)
    return dets.best(len(dets))


def assert_face(name: str, cls: int, box_unit: np.ndarray, width: int, height: int) -> None:
    want, (rx0, ry0, rx1, ry1), (px, py) = FACES[name]
    y0, x0, y1, x1 = box_unit * [height, width, height, width]
    assert cls == want, (name, cls)
    assert rx0 <= x0 < x1 <= rx1 and ry0 <= y0 < y1 <= ry1, (name, x0, y0, x1, y1)
    assert x0 <= px <= x1 and y0 <= py <= y1, (name, x0, y0, x1, y1)


def test_a_frigate_peer_and_kserve_pictures_get_the_same_detections(
    daemon: harness.Daemon, test_data: Path
) -> None:
    """The same 320x320 picture as a Frigate frame (raw RGB) and as a lossless PNG in a
    KServe BYTES input: the same tensor reaches the model, so the same boxes come back."""
    img = photo(test_data, "astronaut.png", SIZE)
    peer = Peer(f"ipc://{daemon.config.parent / 'frigate.sock'}", MODEL)
    try:
        assert peer.handshake() == {"model_available": True, "model_loaded": True}
        rows = peer.detect(np.asarray(img)[None])
    finally:
        peer.close()
    assert isinstance(rows, np.ndarray) and rows[0, 1] > 0.5
    frigate = rows[rows[:, 1] > 0]

    client = tritonclient_http.InferenceServerClient(daemon.address)
    try:
        x = tritonclient_http.InferInput("images", [1], "BYTES")
        x.set_data_from_numpy(np.array([encoded(img, "PNG")], dtype=np.object_))
        result = client.infer("faces", [x])
    finally:
        client.close()
    kserve = best(result.as_numpy("output0"))
    assert len(kserve) == len(frigate)
    np.testing.assert_allclose(kserve.scores, frigate[:, 1], atol=1e-4)
    np.testing.assert_array_equal(kserve.classes, frigate[:, 0].astype(int))
    np.testing.assert_allclose(kserve.boxes, frigate[:, 2:], atol=1e-4)
    # Normalised boxes: of the photo as much as of its 320x320 copy.
    full = photo(test_data, "astronaut.png")
    assert_face("astronaut.png", int(frigate[0, 0]), frigate[0, 2:], full.width, full.height)


@pytest.mark.parametrize("name", sorted(FACES))
def test_a_jpeg_over_grpc_finds_the_face(daemon: harness.Daemon, test_data: Path, name) -> None:
    """The photo at its own size as a JPEG in a gRPC BYTES input (tritonclient's raw
    contents): decoded, fitted to 320x320 and run; the face is found where it is."""
    img = photo(test_data, name)
    with tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{harness.grpc_port(daemon)}") as c:
        x = tritonclient_grpc.InferInput("images", [1], "BYTES")
        x.set_data_from_numpy(np.array([encoded(img, "JPEG")], dtype=np.object_))
        result = c.infer("faces", [x])
    dets = best(result.as_numpy("output0"))
    assert len(dets) >= 1
    # A square photo letterboxed into a square input: the boxes are the photo's own.
    assert_face(name, int(dets.classes[0]), dets.boxes[0], img.width, img.height)


def test_deepstack_answers_a_real_jpeg(daemon: harness.Daemon, test_data: Path) -> None:
    img = photo(test_data, "camera.png")
    body, content_type = multipart({"image": ("camera.jpg", encoded(img, "JPEG"))})
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    try:
        conn.request("POST", "/v1/vision/detection", body, {"Content-Type": content_type})
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 200 and answer["success"] is True, answer
    [face] = [p for p in answer["predictions"] if p["label"] == "FACE_MALE"]
    box = np.array([face["y_min"], face["x_min"], face["y_max"], face["x_max"]], np.float64)
    unit = box / [img.height, img.width, img.height, img.width]
    assert_face("camera.png", FACE_MALE, unit, img.width, img.height)


@pytest.mark.parametrize(
    ("model", "name", "picture", "message"),
    [
        ("faces", "images", b"not a picture", "input 'images', picture 0: cannot read the picture"),
        ("cls", "x", b"\xff\xd8\xff", "input 'x', picture 0: cannot read the picture"),
        ("faces", "other", b"\xff\xd8\xff", "input 'other' is BYTES, and this model takes no"),
    ],
)
def test_a_bad_picture_is_a_400_naming_the_input(
    daemon: harness.Daemon, model: str, name: str, picture: bytes, message: str
) -> None:
    """Any model with one picture input (3 colour channels, fixed size) takes pictures, with
    the default preprocessing unless [models.image] says otherwise; what cannot be used is a
    400 naming the input and the picture."""
    client = tritonclient_http.InferenceServerClient(daemon.address)
    try:
        x = tritonclient_http.InferInput(name, [1], "BYTES")
        x.set_data_from_numpy(np.array([picture], dtype=np.object_))
        with pytest.raises(tritonclient_http.InferenceServerException) as err:
            client.infer(model, [x])
    finally:
        client.close()
    assert err.value.status() == "400" and message in err.value.message(), err.value


def infer_frame(daemon: harness.Daemon, frame: np.ndarray, layout: str, transport: str):
    """A raw frame with parameters.image_format, over HTTP (the protocol's binary request,
    by hand: tritonclient has no per-input parameters) or gRPC (tritonclient's own
    messages and stub); the model's output, or (status, message) of a refusal."""
    if transport == "grpc":
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        request = service_pb2.ModelInferRequest(model_name="faces")
        tensor = request.inputs.add(name="images", datatype="UINT8", shape=frame.shape)
        tensor.parameters["image_format"].string_param = layout
        request.raw_input_contents.append(frame.tobytes())
        with grpc.insecure_channel(f"127.0.0.1:{harness.grpc_port(daemon)}") as channel:
            try:
                reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
            except grpc.RpcError as exc:
                return exc.code().name, exc.details()
        shape = tuple(reply.outputs[0].shape)
        return np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(shape)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "images",
                    "shape": list(frame.shape),
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": frame.nbytes, "image_format": layout},
                }
            ]
        }
    ).encode()
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    try:
        conn.request(
            "POST",
            "/v2/models/faces/infer",
            header + frame.tobytes(),
            {"Inference-Header-Content-Length": str(len(header))},
        )
        response = conn.getresponse()
        body = json.loads(response.read())
    finally:
        conn.close()
    if response.status != 200:
        return response.status, body["error"]
    [out] = body["outputs"]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


@pytest.mark.parametrize("layout", ["nv12", "i420"])
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_raw_camera_frame_finds_the_face(
    daemon: harness.Daemon, test_data: Path, layout: str, transport: str
) -> None:
    """The photo as a raw YUV 4:2:0 frame ([1, height * 3 / 2, width] UINT8 with
    parameters.image_format), as a camera pipeline hands it over."""
    img = photo(test_data, "astronaut.png")
    frame = to_yuv420(np.asarray(img), layout)[None]
    dets = best(infer_frame(daemon, frame, layout, transport))
    assert len(dets) >= 1
    assert_face("astronaut.png", int(dets.classes[0]), dets.boxes[0], img.width, img.height)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_frame_of_a_wrong_shape_is_refused_naming_it(
    daemon: harness.Daemon, transport: str
) -> None:
    status, message = infer_frame(daemon, np.zeros((1, 721, 640), np.uint8), "nv12", transport)
    assert status in (400, "INVALID_ARGUMENT")
    assert "input 'images', frame 0: 721 rows of 640" in message


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_postprocess_returns_frigates_rows_in_the_pictures_coordinates(
    daemon: harness.Daemon, test_data: Path, transport: str
) -> None:
    """parameters.postprocess = "detections": edged decodes the boxes itself, per picture,
    mapped back through the letterbox to each picture (a 512x384 crop here, so the mapping
    matters), as [N, 20, 6] rows of Frigate's layout."""
    full = photo(test_data, "astronaut.png")
    crop = full.crop((0, 0, 512, 384))
    pictures = np.array([encoded(crop, "PNG"), encoded(full, "PNG")], dtype=np.object_)
    lib = tritonclient_http if transport == "http" else tritonclient_grpc
    address = daemon.address if transport == "http" else f"127.0.0.1:{harness.grpc_port(daemon)}"
    client = lib.InferenceServerClient(address)
    try:
        rows = []
        for one in pictures:  # the model is served at batch 1: a picture a request
            x = lib.InferInput("images", [1], "BYTES")
            x.set_data_from_numpy(np.array([one], dtype=np.object_))
            result = client.infer("faces", [x], parameters={"postprocess": "detections"})
            rows.append(result.as_numpy("detections"))
    finally:
        client.close()
    for found, img in zip(rows, (crop, full), strict=True):
        assert found.shape == (1, 20, 6) and found.dtype == np.float32
        top = found[0, 0]
        assert top[1] > 0.5
        assert_face("astronaut.png", int(top[0]), top[2:], img.width, img.height)
        assert np.all(np.diff(found[0, :, 1]) <= 0)  # best first, zero rows after


def test_postprocess_is_refused_for_a_model_without_a_detector(daemon: harness.Daemon) -> None:
    client = tritonclient_http.InferenceServerClient(daemon.address)
    x = tritonclient_http.InferInput("x", [1, 3, 48, 192], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 48, 192), np.float32))
    try:
        with pytest.raises(tritonclient_http.InferenceServerException) as err:
            client.infer("cls", [x], parameters={"postprocess": "detections"})
    finally:
        client.close()
    assert err.value.status() == "400" and "needs a detector" in err.value.message()
