"""Model inspection: format, precision (INT8 awareness) and bad files, on the real models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from backends.errors import ModelError
from backends.model_info import inspect_model, signature


@pytest.mark.parametrize(
    ("name", "fmt", "precision"),
    [
        ("ppocrv4_det.onnx", "onnx", "fp32"),
        ("ppocrv4_det_int8.onnx", "onnx", "int8"),
        ("ppocr_cls.onnx", "onnx", "fp32"),
        ("ppocr_cls_int8.onnx", "onnx", "int8"),
        # mediapipe ships float16 weights that are dequantized at load: not INT8.
        ("face_detection_short_range.tflite", "tflite", "fp16"),
    ],
)
def test_real_models(models_dir: Path, name: str, fmt: str, precision: str) -> None:
    info = inspect_model(models_dir / name)
    assert (info.format, info.precision) == (fmt, precision)
    assert info.is_int8 == (precision == "int8")
    assert len(info.sha256) == 64
    if precision == "int8":
        assert "QDQ" in info.precision_detail


@pytest.mark.slow
def test_qoperator_onnx_is_int8(models_dir: Path, tmp_path: Path) -> None:
    """A QOperator model (QLinearConv...) made from the real cls model."""
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.items = iter(
                [{"x": rng.random((1, 3, 48, 192), dtype=np.float32)} for _ in range(2)]
            )

        def get_next(self):
            return next(self.items, None)

    out = tmp_path / "cls_qop.onnx"
    quantize_static(
        str(models_dir / "ppocr_cls.onnx"), str(out), Reader(), quant_format=QuantFormat.QOperator
    )
    info = inspect_model(out)
    assert info.precision == "int8"
    assert "QOperator" in info.precision_detail


def _save_ir(src: Path, dest: Path, compress: bool) -> Path:
    import openvino as ov

    xml = dest / (src.stem + ".xml")
    ov.save_model(ov.convert_model(str(src)), str(xml), compress_to_fp16=compress)
    return xml


def test_openvino_ir_precisions(models_dir: Path, tmp_path: Path) -> None:
    fp32 = _save_ir(models_dir / "ppocr_cls.onnx", tmp_path, compress=False)
    assert inspect_model(fp32).precision == "fp32"
    (tmp_path / "f16").mkdir()
    fp16 = _save_ir(models_dir / "ppocr_cls.onnx", tmp_path / "f16", compress=True)
    assert inspect_model(fp16).precision == "fp16"
    (tmp_path / "q").mkdir()
    int8 = _save_ir(models_dir / "ppocr_cls_int8.onnx", tmp_path / "q", compress=False)
    info = inspect_model(int8)
    assert info.format == "openvino-ir"
    assert info.precision == "int8", info.precision_detail


def test_ir_without_weights(models_dir: Path, tmp_path: Path) -> None:
    xml = _save_ir(models_dir / "ppocr_cls.onnx", tmp_path, compress=False)
    xml.with_suffix(".bin").unlink()
    with pytest.raises(ModelError, match=r"cls\.xml: OpenVINO IR weights ppocr_cls\.bin"):
        inspect_model(xml)


def _bad(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9])
def test_truncated_onnx(models_dir: Path, tmp_path: Path, cut: float) -> None:
    data = (models_dir / "ppocr_cls.onnx").read_bytes()
    path = _bad(tmp_path, "cut.onnx", data[: int(len(data) * cut)])
    with pytest.raises(ModelError, match=r"cut\.onnx: not a valid ONNX model"):
        inspect_model(path)


@pytest.mark.parametrize("cut", [0.05, 0.5, 0.95])
def test_truncated_tflite(models_dir: Path, tmp_path: Path, cut: float) -> None:
    data = (models_dir / "face_detection_short_range.tflite").read_bytes()
    path = _bad(tmp_path, "cut.tflite", data[: int(len(data) * cut)])
    with pytest.raises(ModelError, match=r"cut\.tflite: truncated or corrupt TFLite model"):
        inspect_model(path)


def test_bad_files(tmp_path: Path) -> None:
    cases = {
        "missing.onnx": (None, "no such file"),
        "empty.onnx": (b"", "empty file"),
        "text.onnx": (b"hello, I am not a model\n" * 20, "not a valid ONNX model"),
        "model.pt": (b"\x80\x02" + b"\x00" * 64, "unsupported model format"),
        "fake.tflite": (b"\x00" * 64, "not a TFLite model"),
        "broken.xml": (b"<?xml version='1.0'?><net><layers>", "not a valid OpenVINO IR"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
            if name.endswith(".xml"):
                path.with_suffix(".bin").write_bytes(b"")
        with pytest.raises(ModelError) as err:
            inspect_model(path)
        assert str(path) in str(err.value) and message in str(err.value), str(err.value)
    with pytest.raises(ModelError, match="is a folder"):
        inspect_model(tmp_path)


def test_copy_has_same_identity(models_dir: Path, tmp_path: Path) -> None:
    """The selection cache is keyed by content, not by path."""
    copy = tmp_path / "renamed.onnx"
    shutil.copy(models_dir / "ppocr_cls_int8.onnx", copy)
    assert inspect_model(copy).sha256 == inspect_model(models_dir / "ppocr_cls_int8.onnx").sha256


def test_a_model_is_read_once_per_change_of_its_file(
    models_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The config check, selection, the variants job and the variants' checks each ask about
    the same file: it is read and hashed once per change, and a rewrite is read anew."""
    import backends.model_info as model_info

    path = tmp_path / "m.onnx"
    path.write_bytes((models_dir / "ppocr_cls.onnx").read_bytes())
    reads: list[Path] = []
    real = model_info.read_model_file
    monkeypatch.setattr(model_info, "read_model_file", lambda p: reads.append(p) or real(p))
    first = inspect_model(path)
    assert inspect_model(path) is first and signature(path) == signature(path)
    assert len(reads) == 2  # one for the facts, one for the signature
    path.write_bytes((models_dir / "ppocr_cls_int8.onnx").read_bytes())  # a new model, same path
    again = inspect_model(path)
    assert again.sha256 != first.sha256 and again.precision == "int8"
    assert len(reads) == 3
