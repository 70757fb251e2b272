"""Warm standby per served model: which verified candidate is kept loaded, when, and what
status says. The fail-over, unplug and switch-back under a request stream is in
tests/serving/test_failover.py (with the RKNN stand-in at the driver boundary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends import probe_hardware
from backends.base import Candidate
from edged.config import BatchingConfig
from edged.selection.policy import Policy
from edged.serving.models import device_used, is_accelerator, load_model

CLS = {"x": (1, 3, 48, 192)}
FAST = Policy(runs=10, warmup=1, time_budget_s=1.0, threads=1, shapes=CLS)


@pytest.fixture(scope="module")
def hw():
    return probe_hardware()


def _load(models_dir: Path, state: Path, hw, standby):
    return load_model(
        "cls", models_dir / "ppocr_cls.onnx", FAST, BatchingConfig(), hw, state, standby=standby
    )


def test_standby_true_keeps_the_next_verified_candidate_loaded(
    models_dir: Path, tmp_path: Path, hw
) -> None:
    served = _load(models_dir, tmp_path / "state", hw, True)
    try:
        standby = served.worker.standby
        assert standby is not None
        pick = served.selection.selected.candidate
        assert standby.candidate.key != pick.key
        verified = [e.candidate.key for e in served.selection.evidence if e.status == "passed"]
        assert standby.candidate.key in verified  # only a verified candidate stands by
        status = served.status()
        assert status["standby"] == standby.candidate.key
        assert status["pick"] == pick.key and status["degraded"] is False
        # The standby is warm and answers like the pick.
        feeds = {"x": __import__("numpy").zeros(CLS["x"], "float32")}
        assert set(standby.run(feeds)) == set(served.session.run(feeds))
    finally:
        served.worker.stop(1.0)


def test_by_default_a_cpu_pick_keeps_no_standby_and_says_why(
    models_dir: Path, tmp_path: Path, hw
) -> None:
    served = _load(models_dir, tmp_path / "state", hw, None)
    try:
        assert not is_accelerator(served.selection.selected.candidate)
        assert served.worker.standby is None
        assert "the pick runs on the CPU" in served.status()["standby_note"]
    finally:
        served.worker.stop(1.0)


def test_standby_false_keeps_none(models_dir: Path, tmp_path: Path, hw) -> None:
    served = _load(models_dir, tmp_path / "state", hw, False)
    try:
        assert served.worker.standby is None
        assert served.status()["standby_note"] == "off (standby = false)"
    finally:
        served.worker.stop(1.0)


def test_device_used_is_what_the_runtime_reports() -> None:
    npu = Candidate("litert", "NPU-VX", "model")
    assert device_used(npu, {"delegate_coverage": 0.5}).startswith("NPU-VX (50% of the graph")
    assert device_used(Candidate("openvino", "AUTO", "fp16"), {"execution_devices": ["GPU.0"]}) == (
        "GPU.0"
    )
    assert device_used(Candidate("rknn", "NPU", "model"), {"device": "NPU cores 0,1"}) == (
        "NPU cores 0,1"
    )
    assert device_used(Candidate("onnxruntime", "CPU", "model"), {}) == "CPU"
    assert not is_accelerator(Candidate("litert", "XNNPACK", "model"))
    assert is_accelerator(npu)
