"""A reload reloads a model when anything of its [[models]] table changes: model_key is
derived from ModelConfig's fields, so a key added there cannot be forgotten (`scores` was,
when the key was a hand-written list). The batching settings come from the same table."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from edged.config import BatchingConfig, ModelConfig
from edged.config.schema import DetectorConfig
from edged.quantize.calibration_spec import CalibrationSpec
from edged.serving.model_set import model_key
from edged.vision.settings import Preprocessing

CHANGED = {  # a value other than the default, for each field
    "path": Path("/tmp/other.onnx"),
    "variants": (Path("/tmp/v.onnx"),),
    "calibration": CalibrationSpec(Path("/tmp/images"), None),
    "precision": "int8",
    "backend": "openvino",
    "scores": "logits",
    "threads": 2,
    "cpus": (1,),
    "shapes": {"x": (1, 3, 8, 8)},
    "max_batch_size": 4,
    "preferred_batch_sizes": (2,),
    "max_queue_delay_us": 100,
    "max_queue_size": 8,
    "timeout_ms": 50,
    "watchdog_ms": 20,
    "rt_priority": 10,
    "period_ms": 5.0,
    "standby": True,
    "backend_options": {"rknn": {"npu_cores": (0, 1)}},
    "image": Preprocessing(color="bgr"),
    "detector": DetectorConfig("yologeneric"),
    "serves_as": ("yolo.onnx",),
    "sha256": "0" * 64,
    "signature": Path("/elsewhere/m.sig"),
    "unread": True,
}


def test_every_field_but_the_name_is_in_the_key(tmp_path: Path) -> None:
    base = ModelConfig(name="m", path=tmp_path / "m.onnx")
    names = {f.name for f in fields(ModelConfig)} - {"name"}
    assert names == set(CHANGED), "a new ModelConfig field: give it a changed value here"
    for name, value in CHANGED.items():
        assert model_key(replace(base, **{name: value})) != model_key(base), name
    assert model_key(replace(base, name="other")) == model_key(base)


def test_a_rewritten_model_file_changes_the_key(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"one")
    mc = ModelConfig(name="m", path=path)
    before = model_key(mc)
    path.write_bytes(b"three")
    assert model_key(mc) != before


def test_batching_is_the_tables_batching_keys() -> None:
    assert ModelConfig(name="m", path=Path("m")).batching == BatchingConfig()
    mc = ModelConfig(name="m", path=Path("m"), max_batch_size=8, max_queue_delay_us=500)
    assert mc.batching == BatchingConfig(max_batch_size=8, max_queue_delay_us=500)
    for f in fields(BatchingConfig):  # the same defaults, defined once
        assert getattr(ModelConfig(name="m", path=Path("m")), f.name) == f.default
