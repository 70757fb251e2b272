"""Property-based fuzzing of the model file readers edged runs before any runtime: real files
of each format (the fetched .onnx, .tflite and .rknn, a .hef laid out as HailoRT's headers
are), damaged at random (bytes overwritten, cut short, a slice repeated or moved). Whatever
comes out, `detect`, the format's `read` and its `signature` answer or raise the project's
ModelError naming the file: never another exception, never a hang.

The readers are what `edged --check-config`, a SIGHUP reload and a client's repository load
run on a file someone else wrote; anything but ModelError there is a traceback and exit 1,
or a 500 where a 400 belongs. (Device trees are fuzzed the same way in tests/sysconf/test_fdt.py,
the KServe JSON and binary bodies in tests/serving/test_protocol.py, gRPC requests below.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.errors import ModelError
from backends.formats import detect
from tests.support import hailo_standin

pytestmark = [pytest.mark.slow]

# A hang guard, not a speed target: one damaged file read is milliseconds; a walk gone
# quadratic or a loop that never ends is what this catches on a loaded 2-core machine.
HANG_S = 10.0

SEEDS = {
    "onnx": "ppocr_cls_int8.onnx",
    "tflite": "face_detection_short_range.tflite",
    "rknn": "ppocr_cls_rk3588_int8.rknn",
}


# One damage: (what, where, where to, length, new bytes, times). Drawn as these small
# tuples rather than as the damaged file, so that a failure prints the recipe, not megabytes.
DAMAGE = st.tuples(
    st.sampled_from(["overwrite", "cut", "repeat", "move"]),
    st.one_of(st.integers(0, 4096), st.floats(0, 1)),  # an offset near the start, or a fraction
    st.one_of(st.integers(0, 4096), st.floats(0, 1)),
    st.integers(1, 256),
    st.one_of(
        st.binary(min_size=1, max_size=8),
        st.sampled_from([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff"]),
    ),
    st.integers(1, 64),
)
DAMAGES = st.lists(DAMAGE, min_size=1, max_size=4)


def damaged(data: bytes, damages: list[tuple]) -> bytes:
    """`data` with each damage done in turn: bytes overwritten, cut at a point, a slice
    repeated or moved elsewhere. Offsets lean towards the file's start, where headers and
    root tables are, since a damaged weight byte tells a reader nothing."""
    out = bytearray(data)
    for kind, at, to, length, new, times in damages:
        if not out:
            break
        at = _offset(at, len(out))
        if kind == "overwrite":
            out[at : at + len(new)] = new
        elif kind == "cut":
            del out[at:]
        else:
            piece = bytes(out[at : at + length])
            if kind == "move":
                del out[at : at + length]
            out[_offset(to, len(out) + 1) : _offset(to, len(out) + 1)] = piece * (
                times if kind == "repeat" else 1
            )
    return bytes(out)


def _offset(where: int | float, size: int) -> int:
    index = int(where * size) if isinstance(where, float) else where
    return min(index, size - 1) if size else 0


def read_all(path: Path, data: bytes) -> None:
    """What inspect_model and signature do with a file's bytes: format, facts, signature."""
    fmt = detect(path, data)
    fmt.read(path, data)
    if fmt.signature is not None:
        fmt.signature(path, data)


def check_damaged(path: Path, data: bytes) -> None:
    started = time.monotonic()
    try:
        read_all(path, data)
    except ModelError as exc:
        assert str(path) in str(exc), f"the error does not name the file: {exc}"
    took = time.monotonic() - started
    assert took < HANG_S, f"{path.name}: {took:.1f} s on a damaged file of {len(data)} bytes"


FUZZ = settings(
    max_examples=int(os.environ.get("EDGED_FUZZ_EXAMPLES", "150")),
    deadline=None,  # the hang bound is asserted in check_damaged
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)


@pytest.mark.parametrize("fmt", sorted(SEEDS))
def test_damaged_model_files_are_model_errors_naming_the_file(fmt, models_dir, tmp_path):
    original = (models_dir / SEEDS[fmt]).read_bytes()
    path = tmp_path / SEEDS[fmt]
    read_all(path, original)  # the undamaged file reads: the seed is a real one

    @FUZZ
    @given(damages=DAMAGES)
    def one(damages: list[tuple]) -> None:
        check_damaged(path, damaged(original, damages))

    one()


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_damaged_hef_files_are_model_errors_naming_the_file(version, tmp_path):
    path = tmp_path / "synthetic-hailo8l.hef"
    original = hailo_standin.hef_bytes(version=version)
    read_all(path, original)

    @FUZZ
    @given(damages=DAMAGES)
    def one(damages: list[tuple]) -> None:
        check_damaged(path, damaged(original, damages))

    one()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512), suffix=st.sampled_from([".onnx", ".tflite", ".rknn", ".hef"]))
def test_random_bytes_under_any_suffix_are_model_errors(tmp_path_factory, data, suffix):
    path = tmp_path_factory.getbasetemp() / f"random{suffix}"
    check_damaged(path, data)
