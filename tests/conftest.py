"""Shared fixtures: the real test data fetched by scripts/fetch_test_data.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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
def cls_u8s8(models_dir: Path, tmp_path_factory) -> Path:
    """The cls model as plain U8S8 QDQ (8-bit weights, no reduce_range): correct on CPUs with
    VNNI, saturated on x86 without it. Made here, the way the test data's INT8 models are."""
    sys.path.insert(0, str(REPO / "scripts"))
    from fetch_test_data import quantize_qdq

    out = tmp_path_factory.mktemp("u8s8") / "ppocr_cls_u8s8.onnx"
    quantize_qdq(models_dir / "ppocr_cls.onnx", out, (1, 3, 48, 192), "half",
                 reduce_range=False)
    return out
