"""The RKNN backend (Rockchip NPUs): its .rknn reader on real models, its candidates and their
reasons on board roots, the core mask, and its session against a stand-in at the driver
boundary (tests/support/rknn_standin.py; no NPU, librknnrt or aarch64 here).

The .rknn files are real: the cls model converted by rknn-toolkit2 2.5.0 for RK3588 and
RK3566, fp16 and INT8 (scripts/fetch_test_data.py). The boards are real device trees (Debian's
RK3566 and RK3568 .dtb files; the test data has no RK3588 one, so that board is a root whose
device tree holds only its compatible strings) with the driver's sysfs and /dev entries and a
library file built here per test: a file named librknnrt.so holding the version string the
real one embeds, never loaded.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from backends import LoadOptions, device_nodes, get_backend, model_formats, probe_hardware
from backends.errors import BackendError, InputError, ModelError
from backends.formats import platform_of
from backends.model_info import inspect_model, signature, signature_mismatch
from backends.rknn.rknn_file import read_rknn
from backends.rknn.soc import SOCS, Soc, core_mask
from backends.tensors import TensorSpec
from sysconf.hardware import HardwareFacts, find_accelerators
from sysconf.sysroot import SysRoot
from tests.support import REPO, rknn_standin

CLS = "ppocr_cls.onnx"
BUILDS = {  # file -> (target_platform, precision)
    "ppocr_cls_rk3588_fp16.rknn": ("rk3588", "fp16"),
    "ppocr_cls_rk3588_int8.rknn": ("rk3588", "int8"),
    "ppocr_cls_rk3566_fp16.rknn": ("rk3566", "fp16"),
    "ppocr_cls_rk3566_int8.rknn": ("rk3566", "int8"),
}
RK3568 = "rockchip/rk3568-rock-3a.dtb"
RK3566 = "rockchip/rk3566-quartz64-a.dtb"
BACKEND = get_backend("rknn")


@pytest.fixture(scope="module")
def rknn_dir(models_dir: Path) -> Path:
    """The models folder with the .rknn builds (made by the fetch script if this cache
    predates them)."""
    if any(not (models_dir / name).exists() for name in BUILDS):
        script = REPO / "scripts" / "fetch_test_data.py"
        subprocess.run([sys.executable, str(script), "--only", "models"], check=True)
    return models_dir


# -- the .rknn reader ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_reads_the_real_models(rknn_dir: Path, name: str) -> None:
    """Format, target, precision and inputs/outputs, as the file says them: the same inputs
    and outputs as the ONNX original (NCHW float32 in, float32 out)."""
    target, precision = BUILDS[name]
    info = inspect_model(rknn_dir / name)
    assert (info.format, info.target, info.precision) == ("rknn", target, precision)
    assert "rknn-toolkit2 2.5.0" in info.precision_detail and target in info.precision_detail
    inputs, outputs = signature(rknn_dir / name)
    assert inputs == [TensorSpec("x", "float32", (1, 3, 48, 192))]
    assert outputs == [TensorSpec("save_infer_model/scale_0.tmp_1", "float32", (1, 2))]
    assert signature_mismatch(signature(rknn_dir / CLS), (inputs, outputs)) is None
    model = read_rknn(rknn_dir / name, (rknn_dir / name).read_bytes())
    assert model.version == 6 and model.toolkit == "2.5.0"
    assert model.npu == ("RKNPU v2" if target == "rk3588" else "RKNPU lite")
    assert [t.layout for t in model.inputs] == ["nchw"]


def test_the_format_is_registered(rknn_dir: Path, tmp_path: Path) -> None:
    """Told by its magic whatever the file is called; a .rknn that is not one says why."""
    fmt = model_formats()["rknn"]
    assert fmt.suffixes == (".rknn",) and platform_of("rknn") == "rknn"
    renamed = tmp_path / "model.bin"
    shutil.copy(rknn_dir / "ppocr_cls_rk3566_int8.rknn", renamed)
    assert inspect_model(renamed).format == "rknn"
    fake = tmp_path / "model.rknn"
    shutil.copy(rknn_dir / CLS, fake)
    with pytest.raises(ModelError, match="no RKNN magic at byte 0") as err:
        inspect_model(fake)
    assert str(fake) in str(err.value)


def _json_at(data: bytes) -> int:
    return 64 + struct.unpack_from("<Q", data, 16)[0]


@pytest.mark.parametrize(
    "cut",
    ["in the header", "in the model", "in the JSON length", "in the JSON", "last byte"],
)
def test_a_truncated_model_names_the_path(rknn_dir: Path, tmp_path: Path, cut: str) -> None:
    data = (rknn_dir / "ppocr_cls_rk3588_fp16.rknn").read_bytes()
    at = _json_at(data)
    keep = {
        "in the header": 20,
        "in the model": 64 + 1000,
        "in the JSON length": at + 4,
        "in the JSON": at + 200,
        "last byte": len(data) - 1,
    }[cut]
    path = tmp_path / "cut.rknn"
    path.write_bytes(data[:keep])
    with pytest.raises(ModelError, match="truncated RKNN model") as err:
        inspect_model(path)
    assert str(path) in str(err.value)


def _corrupted(data: bytes, how: str) -> bytes:
    buf = bytearray(data)
    at = _json_at(data)
    if how == "json":
        buf[at + 8] = ord("X")  # the JSON's opening brace
    elif how == "json-shape":
        text = bytes(buf[at + 8 :]).replace(b'"size":[1,3,48,192]', b'"size":"1x3x48x192"')
        buf[at + 8 :] = text
    elif how == "flatbuffer":
        buf[64:68] = struct.pack("<I", 0x7FFFFFF0)  # the root table's offset
    elif how == "version":
        buf[8:16] = struct.pack("<Q", 9)
    elif how == "encrypted":
        buf[:8] = b"CYPTRKNN"
    return bytes(buf)


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("json", "its JSON section does not parse"),
        ("json-shape", "a norm_tensor without a name or shape: .*'1x3x48x192'"),
        ("flatbuffer", "lies outside the file"),
        ("version", "RKNN file version 0x9 is not one edged reads"),
        ("encrypted", "an encrypted RKNN model"),
    ],
)
def test_a_corrupt_model_says_what_is_wrong(
    rknn_dir: Path, tmp_path: Path, how: str, says: str
) -> None:
    data = (rknn_dir / "ppocr_cls_rk3588_int8.rknn").read_bytes()
    path = tmp_path / f"{how}.rknn"
    path.write_bytes(_corrupted(data, how))
    with pytest.raises(ModelError, match=says) as err:
        inspect_model(path)
    assert str(path) in str(err.value)


# -- boards --------------------------------------------------------------------------------------


board = rknn_standin.board_root


@functools.lru_cache
def _board_facts(dtb: Path) -> HardwareFacts:
    return probe_hardware(dtb=dtb)


def facts(root: Path | None, dtb: Path | None) -> HardwareFacts:
    """probe_hardware(root, dtb): a .dtb's facts are probed once (writing its tree out takes
    seconds here), then given the root's devices as the probe would."""
    if dtb is None:
        return probe_hardware(SysRoot.at(root) if root else None)
    if root is None:
        return _board_facts(dtb)
    board = SysRoot.at(root)
    found = find_accelerators(board, device_nodes())
    return replace(_board_facts(dtb), root=str(board.root), accelerators=found)


def candidate(root: Path | None, dtb: Path | None, model=None):
    [found] = BACKEND.candidates(facts(root, dtb), model)
    assert (found.backend, found.device) == ("rknn", "NPU")
    return found


def test_an_rk3568_board_runs_rknn(dtb_corpus: Path, tmp_path: Path) -> None:
    found = candidate(board(tmp_path), dtb_corpus / RK3568)
    assert found.available, found.reason
    assert found.options["soc"] == "rk3568" and found.options["cores"] == 1
    assert "Rockchip RK3568 NPU (RKNPU2-LITE, 1 core)" in found.note
    assert "rknpu 0.9.8, librknnrt 2.5.0" in found.note


def test_the_models_target_must_be_the_boards_npu(
    dtb_corpus: Path, rknn_dir: Path, tmp_path: Path
) -> None:
    """RK3566 and RK3568 share their NPU: a model built for either runs on both; one built for
    the RK3588 runs on neither, and the reason names both and the fix."""
    root = board(tmp_path)
    rk3566_model = inspect_model(rknn_dir / "ppocr_cls_rk3566_int8.rknn")
    assert candidate(root, dtb_corpus / RK3568, rk3566_model).available
    found = candidate(
        root, dtb_corpus / RK3568, inspect_model(rknn_dir / "ppocr_cls_rk3588_fp16.rknn")
    )
    assert not found.available
    assert "the model is built for rk3588 (RKNPU2-V2), this board is rk3568 (RKNPU2-LITE)" in (
        found.reason
    )
    assert "config(target_platform='rk3568')" in found.reason
    onnx = candidate(root, dtb_corpus / RK3568, inspect_model(rknn_dir / CLS))
    assert "RKNN runs only .rknn models" in onnx.reason and "not onnx" in onnx.reason


def test_the_misc_device_build_of_the_driver(dtb_corpus: Path, tmp_path: Path) -> None:
    """CONFIG_ROCKCHIP_RKNPU_DMA_HEAP: /dev/rknpu, no DRM node (the backend's DEVICES)."""
    found = candidate(board(tmp_path, driver="misc"), dtb_corpus / RK3566)
    assert found.available, found.reason
    assert found.options["soc"] == "rk3566"


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        ({"driver": None}, "no rknpu driver: neither /dev/rknpu nor a DRM render node"),
        ({"driver": "rocket"}, "mainline Linux's rocket driver (/dev/accel/accel0)"),
        ({"library": None}, "librknnrt.so is not in the image, looked for in /usr/lib, /usr/lib64"),
        ({"toolkit": False}, "rknn-toolkit-lite2 is not in the image's Python"),
        (
            {"driver_version": "0.9.3"},
            "rknpu driver 0.9.3 is older than librknnrt 2.5.0 is known to work with "
            "(driver 0.9.6 or later",
        ),
    ],
)
def test_what_is_missing_is_the_reason(
    dtb_corpus: Path, tmp_path: Path, setup: dict, says: str
) -> None:
    found = candidate(board(tmp_path, **setup), dtb_corpus / RK3568)
    assert not found.available
    assert found.reason.startswith("Rockchip RK3568 NPU: ") and says in found.reason


def test_every_missing_piece_at_once(dtb_corpus: Path, tmp_path: Path) -> None:
    found = candidate(
        board(tmp_path, driver=None, library=None, toolkit=False), dtb_corpus / RK3566
    )
    assert found.reason.count("; ") == 2, found.reason
    for part in ("no rknpu driver", "librknnrt.so is not in", "rknn-toolkit-lite2 is not"):
        assert part in found.reason


def test_the_driver_version_from_debugfs(dtb_corpus: Path, tmp_path: Path) -> None:
    """Without /sys/module/rknpu/version (an older driver), debugfs says "RKNPU driver:
    v0.9.2"; a library without a version string is named with "?"."""
    root = board(tmp_path, driver_version=None, library="2.5.0")
    debug = root / "sys" / "kernel" / "debug" / "rknpu"
    debug.mkdir(parents=True)
    (debug / "version").write_text("RKNPU driver: v0.9.2\n")
    found = candidate(root, dtb_corpus / RK3568)
    assert "rknpu driver 0.9.2 is older than librknnrt 2.5.0" in found.reason
    (debug / "version").write_text("RKNPU driver: v0.9.6\n")
    assert candidate(root, dtb_corpus / RK3568).available
    (root / "usr/lib/librknnrt.so").write_bytes(b"\x7fELF no version string here")
    found = candidate(root, dtb_corpus / RK3568)
    assert found.available and "librknnrt ?" in found.note


def test_an_rk3588_board_has_three_cores(tmp_path: Path) -> None:
    root = board(tmp_path, compatible=("radxa,rock-5b", "rockchip,rk3588"))
    found = candidate(root, None)
    assert found.available, found.reason
    assert found.options["cores"] == 3 and "RKNPU2-V2, 3 cores" in found.note


def test_an_image_and_a_dtb_alone(dtb_corpus: Path, tmp_path: Path) -> None:
    """Offline: an image (no /sys) is checked for the library and rknn-toolkit-lite2, not for
    the driver; a .dtb alone checks nothing of this machine and says so."""
    image = board(tmp_path, driver=None, running=False)
    found = candidate(image, dtb_corpus / RK3568)
    assert found.available, found.reason
    assert "librknnrt 2.5.0 in the image; driver not checked" in found.note
    shutil.rmtree(image / "usr")
    assert "librknnrt.so is not in the image" in candidate(image, dtb_corpus / RK3568).reason
    alone = candidate(None, dtb_corpus / RK3568)
    assert alone.available and "not checked: no --root image" in alone.note


def test_not_a_rockchip_npu(dtb_corpus: Path) -> None:
    """This machine, an i.MX8M Plus and an RK3399Pro (whose NPU is Rockchip's first
    generation): each says what was looked for and what the device tree says."""
    here = candidate(None, None)
    assert not here.available and "not a Rockchip NPU SoC (looked for rockchip,rk3562" in (
        here.reason
    )
    imx = candidate(None, dtb_corpus / "freescale" / "imx8mp-evk.dtb")
    assert "it says: fsl,imx8mp-evk, fsl,imx8mp" in imx.reason
    old = candidate(None, dtb_corpus / "rockchip" / "rk3399pro-rock-pi-n10.dtb")
    assert "RK3399PRO has a first-generation Rockchip NPU (RKNPU1)" in old.reason


# -- the core mask -------------------------------------------------------------------------------

RK3588 = SOCS["rockchip,rk3588"]
RK3576 = SOCS["rockchip,rk3576"]
SINGLE = SOCS["rockchip,rk3566"]


@pytest.mark.parametrize(
    ("soc", "cores", "mask"),
    [
        (RK3588, None, "NPU_CORE_AUTO"),
        (RK3588, (), "NPU_CORE_AUTO"),
        (RK3588, (0,), "NPU_CORE_0"),
        (RK3588, (1,), "NPU_CORE_1"),
        (RK3588, (2,), "NPU_CORE_2"),
        (RK3588, (1, 0), "NPU_CORE_0_1"),
        (RK3588, (2, 0, 1, 1), "NPU_CORE_0_1_2"),
        (RK3576, (0, 1), "NPU_CORE_0_1"),
        (SINGLE, (0,), "NPU_CORE_AUTO"),  # librknnrt takes no mask on a one-core NPU
    ],
)
def test_core_masks(soc: Soc, cores, mask: str) -> None:
    assert core_mask(soc, cores) == mask
    assert hasattr(rknn_standin.RKNNLite, mask)  # a constant RKNNLite has


@pytest.mark.parametrize(
    ("soc", "cores", "says"),
    [
        (RK3588, (1, 2), "cores [1, 2] cannot be run together"),
        (RK3588, (0, 2), "cores [0, 2] cannot be run together"),
        (RK3588, (3,), "RK3588 has NPU cores 0-2; there is no core 3"),
        (RK3588, (-1,), "there is no core -1"),
        (RK3576, (0, 1, 2), "RK3576 has NPU cores 0-1; there is no core 2"),
        (SINGLE, (1,), "RK3566 has one NPU core (0); there is no core 1"),
    ],
)
def test_impossible_core_masks(soc: Soc, cores, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        core_mask(soc, cores)


# -- the session, against the stand-in -----------------------------------------------------------


@pytest.fixture
def rk3588(tmp_path: Path) -> Path:
    root = board(tmp_path, compatible=("radxa,rock-5b", "rockchip,rk3588"))
    debug = root / "sys" / "kernel" / "debug" / "rknpu"
    debug.mkdir(parents=True)
    (debug / "load").write_text("NPU load:  Core0: 12%, Core1:   %, Core2: 40%,\n")
    for i, kind in enumerate(("soc-thermal", "bigcore0-thermal", "npu-thermal")):
        zone = root / "sys" / "class" / "thermal" / f"thermal_zone{i}"
        zone.mkdir(parents=True)
        (zone / "type").write_text(kind + "\n")
        (zone / "temp").write_text(f"{40000 + 5600 * i}\n")
    return root


def _load(monkeypatch, rknn_dir: Path, root: Path, name: str, cores=None, board_cores=3):
    stand_in = rknn_standin.install(monkeypatch, {rknn_dir / name: rknn_dir / CLS}, board_cores)
    model = inspect_model(rknn_dir / name)
    found = candidate(root, None, model)
    assert found.available, found.reason
    options = LoadOptions(backend_options={"rknn": {"npu_cores": cores}})
    return stand_in, model, BACKEND.load(model, found, options)


def _cls_input() -> np.ndarray:
    return np.random.default_rng(7).uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)


@pytest.mark.parametrize("name", ["ppocr_cls_rk3588_fp16.rknn", "ppocr_cls_rk3588_int8.rknn"])
def test_the_session_computes_what_the_original_does(
    monkeypatch, rknn_dir: Path, rk3588: Path, name: str
) -> None:
    """NCHW float32 in, as the ONNX original takes it: the session tells the runtime so
    (data_format), or the stand-in, like librknnrt, would take the buffer as NHWC."""
    stand_in, model, session = _load(monkeypatch, rknn_dir, rk3588, name, cores=(0, 1, 2))
    x = _cls_input()
    got = session.run({"x": x})
    original = ort.InferenceSession(str(rknn_dir / CLS), providers=["CPUExecutionProvider"])
    want = original.run(None, {"x": x})[0]
    [out] = session.outputs
    assert list(got) == [out.name] and got[out.name].dtype == np.float32
    assert got[out.name].shape == (1, 2)
    np.testing.assert_allclose(got[out.name], want, atol=2e-3)
    misread = x.reshape(1, 48, 192, 3).transpose(0, 3, 1, 2)  # what NHWC would have meant
    assert np.abs(original.run(None, {"x": misread})[0] - want).max() > 2e-2
    [rk] = stand_in.made
    assert rk.core_mask == stand_in.NPU_CORE_0_1_2 and rk.calls == 1
    info = session.info()
    assert info["precision"] == model.precision and info["core_mask"] == "NPU_CORE_0_1_2"
    assert info["device"] == "rk3588 NPU" and "librknnrt version: 2.5.0" in info["runtime"]
    session.close()
    assert rk.released
    with pytest.raises(BackendError, match="the RKNN session is closed"):
        session.run({"x": x})


def test_bad_feeds_are_input_errors(monkeypatch, rknn_dir: Path, rk3588: Path) -> None:
    _, _, session = _load(monkeypatch, rknn_dir, rk3588, "ppocr_cls_rk3588_fp16.rknn")
    with pytest.raises(InputError, match="has dtype float64, expected float32"):
        session.run({"x": _cls_input().astype(np.float64)})
    with pytest.raises(InputError, match="unknown input 'y'"):
        session.run({"y": _cls_input()})
    with pytest.raises(InputError, match="has shape 1x3x48x96"):
        session.run({"x": _cls_input()[..., :96]})


def test_a_device_that_goes_away(monkeypatch, rknn_dir: Path, rk3588: Path) -> None:
    """inference() returning None (the NPU gone or hung) and raising are BackendErrors that
    name the model (the engine fails over on them); so is a device gone before loading."""
    name = "ppocr_cls_rk3588_int8.rknn"
    stand_in, _, session = _load(monkeypatch, rknn_dir, rk3588, name)
    assert session.run({"x": _cls_input()})
    stand_in.unplug()
    with pytest.raises(BackendError, match=f"{name}: RKNNLite.inference failed .it returned None"):
        session.run({"x": _cls_input()})
    monkeypatch.setattr(stand_in, "raises", RuntimeError("rknn_run: device lost"))
    with pytest.raises(BackendError, match="RuntimeError: rknn_run: device lost"):
        session.run({"x": _cls_input()})
    model = inspect_model(rknn_dir / name)
    with pytest.raises(BackendError, match=f"{name}: RKNNLite.init_runtime failed on rk3588"):
        BACKEND.load(model, candidate(rk3588, None, model), LoadOptions())
    assert stand_in.made[-1].released  # a failed load leaves no context open


def test_an_impossible_core_mask_is_refused_at_load(
    monkeypatch, rknn_dir: Path, dtb_corpus: Path, tmp_path: Path
) -> None:
    rknn_standin.install(monkeypatch, {}, cores=1)
    model = inspect_model(rknn_dir / "ppocr_cls_rk3566_fp16.rknn")
    found = candidate(board(tmp_path), dtb_corpus / RK3566, model)
    with pytest.raises(BackendError, match=r"npu_cores \[1\]: RK3566 has one NPU core"):
        BACKEND.load(model, found, LoadOptions(backend_options={"rknn": {"npu_cores": (1,)}}))


def test_sensors(monkeypatch, rknn_dir: Path, rk3588: Path) -> None:
    """The driver's load (a zero load prints blank before the "%") and the NPU zone's
    temperature, in base units; nothing, not an error, once they cannot be read."""
    _, _, session = _load(monkeypatch, rknn_dir, rk3588, "ppocr_cls_rk3588_fp16.rknn")
    readings = session.sensors()
    assert readings["temperature_celsius"] == pytest.approx(51.2)
    assert readings["core0_load_ratio"] == pytest.approx(0.12)
    assert readings["core1_load_ratio"] == 0.0
    assert readings["load_ratio"] == pytest.approx((0.12 + 0.40) / 3)
    shutil.rmtree(rk3588 / "sys" / "kernel")
    shutil.rmtree(rk3588 / "sys" / "class" / "thermal")
    assert session.sensors() == {}


def test_an_npu_only_runtime(rknn_dir: Path) -> None:
    """No float reference of its own (the family's ONNX original is the reference), its
    version from package metadata, and importing the backends imports no rknnlite."""
    assert BACKEND.reference(inspect_model(rknn_dir / "ppocr_cls_rk3588_fp16.rknn")) is None
    installed = importlib.util.find_spec("rknnlite") is not None  # aarch64 wheels only
    assert (BACKEND.version() is not None) == installed
    code = "import sys, backends; assert 'rknnlite' not in sys.modules; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "ok", done.stderr
