"""Shared fixtures (the real test data fetched by scripts/fetch_test_data.py) and the markers
of pyproject.toml that need code: `needs_cpus(n)` and `needs_broker` skip with the reason;
`needs_data` is put on every test that uses the fetched data, so `make test-fast` can
leave those out (`make test` runs them, fetching the data first), and `integration` on every
`needs_broker` test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.broker import MOSQUITTO, MOSQUITTO_SUB

# Counted once, at start: a test that pins this thread must not make later ones skip.
CPUS = len(os.sched_getaffinity(0))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "test_data" in item.fixturenames:  # directly or through models_dir, dtb_corpus, ...
            item.add_marker(pytest.mark.needs_data)
        if item.get_closest_marker("needs_broker"):  # a real broker is integration by definition
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start a daemon or a broker
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_cpus"):
        wanted = mark.args[0]
        if wanted > CPUS:
            why = f" ({mark.kwargs['reason']})" if "reason" in mark.kwargs else ""
            pytest.skip(f"needs {wanted} CPUs{why}; this process may run on {CPUS}")
    if item.get_closest_marker("needs_broker"):
        missing = [p for p in (MOSQUITTO, MOSQUITTO_SUB) if shutil.which(p) is None]
        if missing:
            pytest.skip(
                f"{' and '.join(missing)} not installed "
                "(apt-get install mosquitto mosquitto-clients)"
            )


def _data_dir() -> Path:
    env = os.environ.get("EDGED_TEST_DATA")
    return Path(env) if env else Path.home() / ".cache" / "edged" / "test-data"


@pytest.fixture(scope="session")
def test_data() -> Path:
    """The fetched models and device trees; fetched here if `make data` has not run yet."""
    root = _data_dir()
    if not (root / "manifest.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_test_data.py")], check=True)
    return root


@pytest.fixture(scope="session")
def models_dir(test_data: Path) -> Path:
    return test_data / "models"


@pytest.fixture(scope="session")
def dtb_corpus(test_data: Path) -> Path:
    """Arm64 board device trees from Debian's linux-image-6.1.0-50-arm64 (6.1.176-1)."""
    return test_data / "dtb" / "linux-6.1.176-arm64"


@pytest.fixture(scope="session")
def cls_u8s8(models_dir: Path) -> Path:
    """The cls model as plain U8S8 QDQ (8-bit weights, no reduce_range): correct on CPUs with
    VNNI, saturated on x86 without it. Made by scripts/fetch_test_data.py beside the test
    data's other INT8 models."""
    return models_dir / "ppocr_cls_u8s8.onnx"


# The MediaPipe face detector's preprocessing (128x128 RGB scaled to [-1, 1]) and its score
# output: what the full-integer TFLite tests quantize it with.
FACE_PRE = {"size": (128, 128), "scale": 1 / 255, "mean": (0.5,), "std": (0.5,)}
FACE_SCORES = "classificators"
FACE_MAX_DROP = 0.05  # the detection rule's budget for this model (docs/BENCHMARKS.md)


def face_samples(test_data: Path):
    """Calibration and held-out evaluation samples for the face detector (the fetched,
    derived detector image sets)."""
    from edged.quantize.calibration import calibration_and_evaluation
    from edged.quantize.calibration_spec import Preprocess
    from edged.quantize.quantizer import input_specs

    model = test_data / "models" / "face_detection_short_range.tflite"
    images = test_data / "images"
    return calibration_and_evaluation(
        images / "detector-calibration",
        images / "detector-eval",
        input_specs(model),
        Preprocess(**FACE_PRE),
    )


@pytest.fixture(scope="session")
def face_full_integer(test_data: Path, tmp_path_factory) -> dict[str, Path]:
    """The face detector made full-integer by edged's quantizer, once per session: "int8"
    with int8 inputs and outputs (what an NPU delegate wants) and "float" with float32 ones
    (int8 inside; a variant of the float original, same interface)."""
    from edged.quantize.quantizer import quantize_model
    from edged.quantize.recipes import Settings
    from edged.selection.accuracy import ScoreMap

    calibration, evaluation, warnings = face_samples(test_data)
    model = test_data / "models" / "face_detection_short_range.tflite"
    folder = tmp_path_factory.mktemp("face-full-integer")
    made = {}
    for io in ("int8", "float"):
        settings = Settings(
            targets=("litert",),
            runs=20,
            time_budget_s=2.0,
            io=io,
            require_int8=True,
            scores=ScoreMap(FACE_SCORES),
            max_drop=FACE_MAX_DROP,
            recipes=None,
        )
        out = folder / f"face_full_integer_{io}.tflite"
        report = quantize_model(model, out, calibration, evaluation, settings, warnings)
        assert report.int8, report.reason
        made[io] = out
    return made
