"""The yologeneric decoder on a real trained detector (NudeNet's YOLOv8n from PyPI) and real
photos, with edged's own picture path (decode, fit, tensor) and onnxruntime, no daemon: the
faces are found where they are (regions read off the photos by eye), in both resize modes,
and the photos without people give no box. A decoder that read the layout wrong (channels
for anchors, centres for corners, logits for scores) fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.tensors import TensorSpec
from edged.vision.boxes import Detections
from edged.vision.decoders import decode
from edged.vision.images import decode_image, fit, image_input, tensor
from edged.vision.labels import names_from_metadata
from edged.vision.settings import Preprocessing

ort = pytest.importorskip("onnxruntime")

SIZE = 320
FACES = {  # photo -> (class name, region x0, y0, x1, y1, a point of the face)
    "astronaut.png": ("FACE_FEMALE", (150, 60, 300, 200), (222, 130)),
    "camera.png": ("FACE_MALE", (165, 105, 285, 220), (225, 160)),
}
NO_PEOPLE = ("coffee.png", "chelsea.png", "motorcycle_left.png", "rocket.jpg")


@pytest.fixture(scope="module")
def model(models_dir: Path):
    path = models_dir / "nudenet_320n.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session, names_from_metadata(session.get_modelmeta().custom_metadata_map, str(path))


def detect(model, photo: Path, resize: str) -> tuple[Detections, tuple[int, int]]:
    session, _ = model
    target = image_input(
        TensorSpec("images", "float32", (1, 3, SIZE, SIZE)), Preprocessing(resize=resize)
    )
    pixels, size = decode_image(photo.read_bytes(), photo.name, size_hint=(SIZE, SIZE))
    fitted, how = fit(pixels, target)
    [out] = session.run(None, {"images": tensor(fitted, target)})
    dets = decode("yologeneric", [out], (SIZE, SIZE), 0.25)
    mapped = Detections(how.to_picture(dets.boxes), dets.scores, dets.classes).clipped()
    return mapped.best(len(mapped)), size


@pytest.mark.parametrize("resize", ["stretch", "letterbox"])
@pytest.mark.parametrize("name", sorted(FACES))
def test_faces_are_found_where_they_are(model, test_data: Path, name: str, resize: str) -> None:
    dets, (height, width) = detect(model, test_data / "images" / "photos" / name, resize)
    label, (rx0, ry0, rx1, ry1), (px, py) = FACES[name]
    assert len(dets) >= 1 and model[1][int(dets.classes[0])] == label, dets
    assert dets.scores[0] > 0.5
    y0, x0, y1, x1 = dets.boxes[0] * [height, width, height, width]
    assert rx0 <= x0 < x1 <= rx1 and ry0 <= y0 < y1 <= ry1, (x0, y0, x1, y1)
    assert x0 <= px <= x1 and y0 <= py <= y1


@pytest.mark.parametrize("name", NO_PEOPLE)
def test_photos_without_people_give_no_box(model, test_data: Path, name: str) -> None:
    dets, _ = detect(model, test_data / "images" / "photos" / name, "letterbox")
    assert len(dets) == 0, dets


def test_the_models_own_class_names(model) -> None:
    _, names = model
    assert len(names) == 18 and names[1] == "FACE_FEMALE" and names[12] == "FACE_MALE"
