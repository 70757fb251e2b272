"""[models.image], [models.detector], serves_as and [frigate] in the config: each read, and
each bad value refused with its key and what is wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from edged.config import ConfigError
from edged.config.load import parse_config
from edged.config.schema import Config
from edged.vision.settings import Preprocessing

# The cls model: x [N, 3, H, W] in (given a size here), [N, 2] out
CLS = '[[models]]\nname = "m"\npath = "m.onnx"\nshapes = { x = [1, 3, 48, 192] }\n'


@pytest.fixture
def folder(tmp_path: Path, models_dir: Path) -> Path:
    (tmp_path / "m.onnx").symlink_to(models_dir / "ppocr_cls.onnx")
    (tmp_path / "det.onnx").symlink_to(models_dir / "ppocrv4_det.onnx")
    return tmp_path


def parse(folder: Path, text: str) -> Config:
    return parse_config(textwrap.dedent(text), folder / "edged.toml", online_cpus=range(8))


def error(folder: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(folder, text)
    return str(info.value)


def test_image_and_serves_as_are_read(folder: Path) -> None:
    config = parse(
        folder,
        CLS
        + 'serves_as = ["cls.onnx", "cls-v2.onnx"]\n'
        + '[models.image]\ncolor = "bgr"\nmean = [0.5, 0.5, 0.5]\nstd = 0.5\n'
        + 'resize = "letterbox"\n',
    )
    (model,) = config.models
    assert model.serves_as == ("cls.onnx", "cls-v2.onnx")
    assert model.image == Preprocessing(
        color="bgr", mean=(0.5, 0.5, 0.5), std=(0.5,), resize="letterbox"
    )
    assert model.detector is None


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        ('[models.image]\ncolor = "yuv"\n', "models[0].image", "colour 'yuv': use rgb or bgr"),
        ('[models.image]\nresize = "crop"\n', "models[0].image", "use stretch or letterbox"),
        ("[models.image]\nstd = 0\n", "models[0].image", "divides by zero"),
        ("[models.image]\nmean = [1, 2]\n", "models[0].image", "give one, or one per channel"),
        ("[models.image]\nscale = -1\n", "models[0].image.scale", "a number > 0"),
        ('[models.image]\nsize = "1x1"\n', "models[0].image.size", "did you mean 'resize'"),
        ('serves_as = ["../x"]\n', "models[0].serves_as[0]", "no '/'"),
        ('serves_as = "x.onnx"\n', "models[0].serves_as", "must be an array"),
        ('[models.detector]\ntype = "centernet"\n', "models[0].detector.type", "must be one of"),
        ("[models.detector]\nmin_score = 0.5\n", "models[0].detector.type", "required"),
        (
            '[models.detector]\ntype = "yologeneric"\nlabels = "missing.txt"\n',
            "models[0].detector.labels",
            "cannot read the label map",
        ),
        (
            '[models.detector]\ntype = "ssd"\n',
            "models[0].detector.type",
            "ssd does not fit the model's outputs: ssd expects the 4 post-process outputs",
        ),
    ],
)
def test_bad_picture_settings_name_the_key(
    folder: Path, extra: str, key: str, message: str
) -> None:
    text = error(folder, CLS + extra)
    assert key in text and message in text, text


def test_a_model_without_a_picture_input_is_refused(folder: Path) -> None:
    text = error(folder, '[[models]]\nname = "d"\npath = "det.onnx"\n[models.image]\n')
    assert "models[0].image" in text and "dynamic height or width" in text, text
    config = parse(
        folder,
        '[[models]]\nname = "d"\npath = "det.onnx"\nshapes = { x = [1, 3, 64, 64] }\n'
        "[models.image]\n",
    )
    assert config.models[0].image == Preprocessing()


def test_two_models_cannot_serve_as_one_name(folder: Path) -> None:
    two = CLS + 'serves_as = ["a.onnx"]\n' + CLS.replace('"m"', '"n"') + 'serves_as = ["a.onnx"]\n'
    text = error(folder, two)
    assert "models[1].serves_as" in text and "served by models[0] already" in text, text


def test_frigate_section(folder: Path) -> None:
    config = parse(folder, '[server]\nsocket = "run/edged.sock"\n[frigate]\nenabled = true\n')
    assert config.frigate.enabled and config.frigate.socket == folder / "run" / "frigate.sock"
    config = parse(folder, '[frigate]\nenabled = true\nsocket = ""\nlisten = "127.0.0.1:5555"\n')
    assert config.frigate.socket is None
    assert (config.frigate.listen_host, config.frigate.listen_port) == ("127.0.0.1", 5555)
    for text, message in [
        ('[frigate]\nlisten = "0.0.0.0:5555"\n', "must be a loopback address"),
        ('[frigate]\nenabled = true\nsocket = ""\n', "no peer could reach it"),
        ("[frigate]\nmax_peers = 0\n", "frigate.max_peers"),
        ('[server]\nsocket = "a.sock"\n[frigate]\nsocket = "a.sock"\n', "is a [server] socket too"),
    ]:
        assert message in error(folder, text)
