"""Model and calibration files crafted to hang, exhaust or crash the readers: each is the
project's error naming the file, quickly and in little memory. The files are built here, by
the formats' own layouts (flatbuffers' builder for .tflite)."""

from __future__ import annotations

import os
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import flatbuffers
import pytest

from backends import tflite_file
from backends.errors import ModelError
from backends.model_info import inspect_model, signature
from backends.rknn import rknn_file
from backends.tensors import TensorSpec
from edged.quantize.calibration import MAX_ARRAY_BYTES, load_samples
from edged.quantize.calibration_spec import CalibrationError
from tests.support.crafted import unknown_element_type

SPEC = [TensorSpec("x", "float32", (1, 4))]


def _vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def shared_tables_tflite(count: int) -> bytes:
    """A .tflite whose `count` subgraphs are one table, whose `count` tensors are one table:
    count² tensors to a naive walk, from a file of about 8 * count bytes."""
    b = flatbuffers.Builder(0)
    b.StartObject(8)
    b.PrependUint8Slot(1, 9, 0)  # Tensor.type = INT8
    tensor = b.EndObject()
    tensors = _vector(b, [tensor] * count)
    b.StartObject(5)
    b.PrependUOffsetTRelativeSlot(0, tensors, 0)  # SubGraph.tensors
    subgraph = b.EndObject()
    subgraphs = _vector(b, [subgraph] * count)
    b.StartObject(8)
    b.PrependUOffsetTRelativeSlot(2, subgraphs, 0)  # Model.subgraphs
    model = b.EndObject()
    b.Finish(model, file_identifier=b"TFL3")
    return bytes(b.Output())


def big_buffer_tflite(size: int) -> bytes:
    """A valid-looking .tflite: one tensor, one buffer of `size` bytes."""
    b = flatbuffers.Builder(size + 1024)
    data = b.CreateByteVector(bytes(size))
    b.StartObject(1)
    b.PrependUOffsetTRelativeSlot(0, data, 0)  # Buffer.data
    buffer = b.EndObject()
    buffers = _vector(b, [buffer])
    b.StartObject(8)
    tensor = b.EndObject()
    tensors = _vector(b, [tensor])
    b.StartObject(5)
    b.PrependUOffsetTRelativeSlot(0, tensors, 0)
    subgraph = b.EndObject()
    subgraphs = _vector(b, [subgraph])
    b.StartObject(8)
    b.PrependUOffsetTRelativeSlot(2, subgraphs, 0)
    b.PrependUOffsetTRelativeSlot(4, buffers, 0)  # Model.buffers
    model = b.EndObject()
    b.Finish(model, file_identifier=b"TFL3")
    return bytes(b.Output())


def test_a_tflite_of_shared_tables_is_refused_quickly(tmp_path: Path) -> None:
    path = tmp_path / "shared.tflite"
    path.write_bytes(shared_tables_tflite(50_000))  # 2.5e9 tensors to a naive walk
    start = time.monotonic()
    with pytest.raises(ModelError, match="shared"):
        inspect_model(path)
    assert signature(path) == ([], [])  # it names no inputs: nothing to walk
    assert time.monotonic() - start < 5


def test_a_large_buffer_is_checked_in_constant_memory(tmp_path: Path) -> None:
    data = big_buffer_tflite(8 * 2**20)
    tracemalloc.start()
    try:
        facts = tflite_file.read(tmp_path / "big.tflite", data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert facts.precision == "fp32"
    assert peak < 1 * 2**20, peak  # one int per byte was about 300 MB here


def test_an_unknown_onnx_element_type_is_a_model_error(tmp_path: Path) -> None:
    path = unknown_element_type(tmp_path / "bad.onnx")
    with pytest.raises(ModelError, match="element type 99") as err:
        inspect_model(path)
    assert str(path) in str(err.value)


def test_a_deeply_nested_rknn_json_is_a_model_error(tmp_path: Path) -> None:
    meta = b"[" * 200_000 + b"]" * 200_000
    data = rknn_file.MAGIC + b"\0" * 4 + struct.pack("<QQ", 1, 0)
    data += struct.pack("<Q", len(meta)) + meta
    path = tmp_path / "deep.rknn"
    path.write_bytes(data)
    with pytest.raises(ModelError, match="nested too deeply"):
        inspect_model(path)


def test_calibration_that_is_neither_file_nor_folder(tmp_path: Path) -> None:
    fifo = tmp_path / "calib"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(CalibrationError, match="neither a regular file nor a folder"):
        load_samples(fifo, SPEC)
    assert time.monotonic() - start < 5


def test_an_npz_bomb_is_refused_from_its_header(tmp_path: Path) -> None:
    """A 16 GiB array of zeros, compressed to a few MB: refused before it is inflated."""
    from numpy.lib import format as npy

    path = tmp_path / "bomb.npz"
    count = MAX_ARRAY_BYTES  # float32: four times the bound
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("x.npy", "w", force_zip64=True) as f,
    ):
        npy.write_array_header_2_0(f, {"descr": "<f4", "fortran_order": False, "shape": (1, count)})
        zeros = bytes(2**20)
        for _ in range(64):  # the header says more; the bytes need not all be there
            f.write(zeros)
    tracemalloc.start()
    try:
        with pytest.raises(CalibrationError, match="more than"):
            load_samples(path, SPEC)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20


def test_an_image_bomb_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    """A PNG declaring 40000x40000 pixels (1.6 G): refused from its header."""
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("L", (1, 1)).save(folder / "a.png")
    raw = (folder / "a.png").read_bytes()
    ihdr = raw.index(b"IHDR")
    bomb = raw[: ihdr + 4] + struct.pack(">II", 40_000, 40_000) + raw[ihdr + 12 :]
    (folder / "a.png").write_bytes(bomb)
    spec = [TensorSpec("x", "float32", (1, 3, 32, 32))]
    with pytest.raises(CalibrationError, match=r"a\.png"):
        load_samples(folder, spec)


def test_real_models_still_read(models_dir: Path) -> None:
    for name in ("ppocr_cls.onnx", "ppocr_cls_int8.onnx", "palm_detection_lite.tflite"):
        assert inspect_model(models_dir / name).precision
