"""The aarch64 lane's root, for test_arm64.py and test_arm64_programs.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.arm64 import ROOT_ENV, Arm64Root, build_root, lane_cpu


@pytest.fixture(scope="session")
def arm64_root() -> Arm64Root:
    """The built root: EDGED_ARM64_ROOT, else scripts/arm64_root.py's ensure() (cached in the
    test data; built on first use)."""
    given = os.environ.get(ROOT_ENV)
    path = Path(given) if given else build_root()
    if path is None:
        pytest.skip("scripts/arm64_root.py does not exist yet (or set EDGED_ARM64_ROOT)")
    root = Arm64Root(path, lane_cpu())
    assert root.python.exists(), f"{root.python} missing: not an aarch64 lane root"
    print(f"arm64 root: {root.path} (-cpu {root.cpu})")
    return root


@pytest.fixture(scope="session")
def arm64_state(tmp_path_factory) -> Path:
    """One state dir for the lane's selections (their cache, OpenVINO's compiled models)."""
    return tmp_path_factory.mktemp("arm64-state")
