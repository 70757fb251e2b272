"""The Hailo backend without a Hailo: HEF files in the header layout HailoRT's source defines
(synthetic: no real .hef is downloadable here, none ships in a PyPI package), candidates on
device roots in tmp_path (a /dev/hailo0 node is a plain file there), and sessions against
the stand-in `hailo_platform` (tests/support/hailo_standin.py), which computes with
onnxruntime on the test data's ONNX models and fails the way a real device does."""

from __future__ import annotations

import importlib.util
import lzma
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import backends
from backends import hailo as hb
from backends.base import Candidate, LoadOptions
from backends.errors import BackendError, InputError, ModelError
from backends.formats import platform_of
from backends.hailo import hef_file
from backends.hailo import session as hailo_session
from backends.hailo import stack as hailo_stack
from backends.model_info import inspect_model, signature
from sysconf.hardware import HardwareFacts
from sysconf.sysroot import SysRoot
from tests.support import REPO
from tests.support import hailo_standin as standin

CLS_HW = (48, 192)  # the cls model's input, as a HEF would fix it


def write(root: Path, path: str, data: str | bytes = "") -> Path:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        target.write_bytes(data)
    else:
        target.write_text(data)
    return target


def hailo_root(
    root: Path,
    *,
    driver: str | None = "4.20.0",
    library: str | None = "4.20.0",
    binding: str | None = "4.20.0",
    nodes: tuple[str, ...] = ("hailo0",),
    pci: str = "0x2864",
    service: bool = False,
) -> Path:
    """A device's root as HailoRT and its driver leave it: the node, its sysfs (PCI id,
    PCIe address, driver link), the module's version, libhailort's file, the Python
    binding with its distribution metadata, and the service's socket."""
    for index, name in enumerate(nodes):
        write(root, f"/dev/{name}")
        base = root / f"sys/class/hailo_chardev/{name}"
        write(root, f"/sys/class/hailo_chardev/{name}/device/device", pci + "\n")
        write(root, f"/sys/class/hailo_chardev/{name}/board_location", f"0000:0{index + 1}:00.0")
        (base / "device/driver").symlink_to("../../../../bus/pci/drivers/hailo")
    if driver:
        write(root, "/sys/module/hailo_pci/version", driver + "\n")
    if library:
        write(root, f"/usr/lib/aarch64-linux-gnu/libhailort.so.{library}", b"\x7fELF")
    if binding:
        write(root, "/usr/lib/python3/dist-packages/hailo_platform/__init__.py")
        write(root, f"/usr/lib/python3/dist-packages/hailort-{binding}.dist-info/METADATA")
    if service:
        write(root, hailo_stack.SERVICE_SOCKET)
    return root


def facts(root: Path) -> HardwareFacts:
    return backends.probe_hardware(SysRoot(root))


def hef_model(tmp_path: Path, name: str = "synthetic-cls-hailo8l.hef", **kwargs):
    path = standin.write_hef(tmp_path / name, **kwargs)
    return inspect_model(path)


# -- the HEF format ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_a_hef_is_recognised_by_its_magic_and_read_from_its_headers(tmp_path, version):
    path = standin.write_hef(
        tmp_path / "synthetic.hef", version=version, hw_arch=3, sdk_version="3.28.0"
    )
    info = inspect_model(path)
    assert (info.format, info.precision, info.target) == ("hef", "int8", "hailo8l")
    assert f"Hailo HEF v{version}" in info.precision_detail
    assert "Dataflow Compiler 3.28.0" in info.precision_detail
    minimum = ".".join(map(str, hef_file.HEADER_READERS[version][:2]))
    assert f"HailoRT {minimum}+" in info.precision_detail
    # By content, whatever the suffix says.
    renamed = path.rename(tmp_path / "synthetic.bin")
    assert inspect_model(renamed).format == "hef"
    assert platform_of("hef") == "hailo"
    assert signature(renamed) is None  # only the protobuf's deep parts say; a runtime tells


@pytest.mark.parametrize(
    ("hw_arch", "target"),
    [
        (0, "hailo8"),
        (1, "hailo8"),
        (2, "hailo8r"),
        (3, "hailo8l"),
        (103, "hailo15h"),
        (5, "hailo10h"),
    ],
)
def test_the_target_chip_comes_from_the_protobuf_header(tmp_path, hw_arch, target):
    assert hef_model(tmp_path, hw_arch=hw_arch).target == target


def test_a_hef_without_a_protobuf_header_states_no_target(tmp_path):
    info = hef_model(tmp_path, hw_arch=None)
    assert info.target is None
    assert "target not stated" in info.precision_detail


def test_truncated_hefs_are_model_errors_naming_the_file(tmp_path):
    whole = standin.hef_bytes(version=2)
    header = hef_file._HEADER_SIZES[2]
    for cut in (3, 11, 20, header, header + 5, len(whole) - 1):
        path = tmp_path / f"cut-{cut}.hef"
        path.write_bytes(whole[:cut])
        with pytest.raises(ModelError, match=r"truncated") as err:
            inspect_model(path)
        assert str(path) in str(err.value)
    padded = tmp_path / "padded.hef"
    padded.write_bytes(whole + b"\0")
    with pytest.raises(ModelError, match=rf"{padded}: trailing bytes"):
        inspect_model(padded)


def test_files_that_are_not_hefs_say_why(tmp_path):
    fake = write(tmp_path, "fake.hef", b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ModelError, match=rf"{fake}: not a Hailo HEF model \(no HEF magic 01 48"):
        inspect_model(fake)
    future = tmp_path / "future.hef"
    data = bytearray(standin.hef_bytes(version=2))
    data[4:8] = (9).to_bytes(4, "big")
    future.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=rf"{future}: HEF header version 9 is unknown"):
        inspect_model(future)
    # The lengths agree, but the protobuf's first field claims more bytes than there are.
    broken = standin.hef_bytes(version=2, proto=b"\x0a\x7f\x08\x03")
    bad = write(tmp_path, "bad-proto.hef", broken)
    with pytest.raises(ModelError, match=rf"{bad}: corrupt HEF: its protobuf part"):
        inspect_model(bad)


# -- candidates ----------------------------------------------------------------------------------


def test_the_probe_lists_the_node_and_the_backend_is_registered(tmp_path):
    hailo_root(tmp_path)
    accs = [a for a in facts(tmp_path).accelerators if a.node == "/dev/hailo0"]
    assert [(a.kind, a.name) for a in accs] == [("npu", "Hailo AI accelerator")]
    assert backends.get_backend("hailort") is hb.BACKEND
    assert "hef" in backends.model_formats()
    assert hb.BACKEND.reference(hef_model(tmp_path)) is None


def test_a_matching_stack_gives_an_available_candidate_for_each_node(tmp_path):
    hailo_root(tmp_path / "root")
    (candidate,) = hb.BACKEND.candidates(facts(tmp_path / "root"), hef_model(tmp_path))
    assert candidate.available, candidate.reason
    assert (candidate.backend, candidate.device, candidate.precision) == (
        "hailo",
        "hailo0",
        "model",
    )
    assert candidate.options == {
        "device_node": "/dev/hailo0",
        "multi_process_service": False,
        "group_id": "SHARED",
    }
    assert "hailo_pci 4.20.0" in candidate.note and "HailoRT 4.20.0" in candidate.note
    assert "Hailo-8/8L/8R" in candidate.note


def test_two_devices_are_two_candidates_pinned_by_pcie_address(tmp_path):
    hailo_root(tmp_path, nodes=("hailo0", "hailo1"))
    got = hb.BACKEND.candidates(facts(tmp_path), None)
    assert [c.device for c in got] == ["hailo0", "hailo1"]
    assert [c.options["device_id"] for c in got] == ["0000:01:00.0", "0000:02:00.0"]
    assert len({c.options["group_id"] for c in got}) == 2


def test_no_node_no_candidate(tmp_path):
    write(tmp_path, "/proc/cpuinfo", "processor\t: 0\n")
    (candidate,) = hb.BACKEND.candidates(facts(tmp_path), None)
    assert not candidate.available
    assert (
        candidate.reason
        == "no Hailo device: no /dev/hailo* node in the image, and no Hailo software in it"
    )


def test_an_image_without_the_node_still_shows_a_version_mismatch(tmp_path):
    # An image's /dev is made at boot: CI sees what software it carries and whether it opens.
    hailo_root(tmp_path, driver=None, nodes=())
    ko = tmp_path / "lib/modules/6.6.51+rpt-rpi-2712/updates/dkms/hailo_pci.ko.xz"
    ko.parent.mkdir(parents=True)
    modinfo = b"\x7fELF....\x00srcversion=4.99.0\x00version=4.19.0\x00license=GPL v2\x00"
    ko.write_bytes(lzma.compress(modinfo))
    (candidate,) = hb.BACKEND.candidates(facts(tmp_path), None)
    assert not candidate.available
    assert "no /dev/hailo* node in the image (it appears at boot)" in candidate.reason
    assert "hailo_pci is 4.19.0, HailoRT (libhailort) is 4.20.0" in candidate.reason


def test_driver_and_library_versions_must_match_and_both_are_named(tmp_path):
    hailo_root(tmp_path, driver="4.19.0", library="4.20.0", binding="4.20.0")
    (candidate,) = hb.BACKEND.candidates(facts(tmp_path), None)
    assert not candidate.available
    assert "driver and library versions differ: hailo_pci is 4.19.0, HailoRT" in candidate.reason
    assert "(libhailort) is 4.20.0" in candidate.reason
    assert "same major.minor.revision" in candidate.reason


def test_left_over_libraries_count_only_when_the_binding_does_not_say(tmp_path):
    hailo_root(tmp_path, driver="4.20.0", library="4.20.0", binding=None)
    write(tmp_path, "/usr/lib/python3/dist-packages/hailo_platform/__init__.py")
    write(tmp_path, "/usr/lib/libhailort.so.4.19.0", b"\x7fELF")
    (candidate,) = hb.BACKEND.candidates(facts(tmp_path), None)
    assert candidate.available, candidate.reason  # 4.20.0 is among them
    (tmp_path / "sys/module/hailo_pci/version").write_text("4.18.0\n")
    (candidate,) = hb.BACKEND.candidates(facts(tmp_path), None)
    assert "hailo_pci driver is 4.18.0 but the HailoRT libraries installed are 4.19.0, 4.20.0" in (
        candidate.reason
    )


def test_no_binding_no_driver_or_an_old_hailort_are_clear_reasons(tmp_path):
    hailo_root(tmp_path / "a", binding=None)
    (c,) = hb.BACKEND.candidates(facts(tmp_path / "a"), None)
    assert "hailo_platform (HailoRT's Python API) is not installed in the image" in c.reason
    assert "python3-hailort" in c.reason and "--system-site-packages" in c.reason
    hailo_root(tmp_path / "b", driver=None)
    (c,) = hb.BACKEND.candidates(facts(tmp_path / "b"), None)
    assert "no Hailo PCIe driver (hailo_pci.ko)" in c.reason
    hailo_root(tmp_path / "c", driver="4.17.0", library="4.17.0", binding="4.17.0")
    (c,) = hb.BACKEND.candidates(facts(tmp_path / "c"), None)
    assert "HailoRT 4.17.0 is too old" in c.reason and "4.18" in c.reason


def test_a_hef_for_another_chip_family_is_refused_by_name(tmp_path):
    hailo_root(tmp_path / "root")
    model = hef_model(tmp_path, "synthetic-h15.hef", hw_arch=103)
    (c,) = hb.BACKEND.candidates(facts(tmp_path / "root"), model)
    assert not c.available
    assert c.reason.startswith(
        "synthetic-h15.hef is compiled for hailo15h; hailo0 is a Hailo-8/8L/8R"
    )
    assert "hailo8, hailo8l, hailo8r" in c.reason
    # 8 and 8L share a PCI id: only the firmware tells them apart, at load.
    ok = hef_model(tmp_path, "synthetic-h8.hef", hw_arch=1)
    assert hb.BACKEND.candidates(facts(tmp_path / "root"), ok)[0].available


def test_a_newer_hef_header_than_the_library_reads_is_refused(tmp_path):
    hailo_root(tmp_path / "root", driver="4.19.0", library="4.19.0", binding="4.19.0")
    model = hef_model(tmp_path, version=2)
    (c,) = hb.BACKEND.candidates(facts(tmp_path / "root"), model)
    assert not c.available
    assert "has a v2 HEF header, which HailoRT 4.20 and later read; this HailoRT is 4.19.0" in (
        c.reason
    )
    assert hb.BACKEND.candidates(facts(tmp_path / "root"), hef_model(tmp_path, version=1))[
        0
    ].available


def test_other_formats_are_not_for_hailo(tmp_path, models_dir):
    hailo_root(tmp_path)
    (c,) = hb.BACKEND.candidates(facts(tmp_path), inspect_model(models_dir / "ppocr_cls.onnx"))
    assert not c.available
    assert "only HEF models" in c.reason and "not onnx" in c.reason


def test_the_service_is_followed_when_it_is_there_or_forced(tmp_path):
    hailo_root(tmp_path / "sock", service=True)
    (c,) = hb.BACKEND.candidates(facts(tmp_path / "sock"), None)
    assert c.options["multi_process_service"] is True
    assert f"hailort_service listens on {hailo_stack.SERVICE_SOCKET}" in c.note
    hailo_root(tmp_path / "unit")
    link = tmp_path / "unit/etc/systemd/system/multi-user.target.wants/hailort.service"
    link.parent.mkdir(parents=True)
    link.symlink_to("/lib/systemd/system/hailort.service")  # absolute: into the image
    (c,) = hb.BACKEND.candidates(facts(tmp_path / "unit"), None)
    assert c.options["multi_process_service"] is True
    assert "enabled in the image" in c.note
    (c,) = hb.HailoBackend(multi_process_service=False).candidates(facts(tmp_path / "sock"), None)
    assert c.options["multi_process_service"] is False
    assert "this process only" in c.note
    hailo_root(tmp_path / "none")
    (c,) = hb.HailoBackend(multi_process_service=True).candidates(facts(tmp_path / "none"), None)
    assert c.options["multi_process_service"] is True and "forced on" in c.note


def test_live_facts_read_the_service_address_and_the_importable_binding(tmp_path, monkeypatch):
    hailo_root(tmp_path)
    monkeypatch.delenv("HAILORT_SERVICE_ADDRESS", raising=False)
    monkeypatch.delitem(sys.modules, "hailo_platform", raising=False)
    stack = hailo_stack.stack_facts(SysRoot(tmp_path), live=True, node="/dev/hailo0")
    assert (stack.driver_module, stack.driver_version) == ("hailo_pci", "4.20.0")
    assert stack.libraries == ("4.20.0",)
    assert stack.service is None
    if importlib.util.find_spec("hailo_platform") is None:  # no real HailoRT on this machine
        assert stack.binding is False
    standin.install(monkeypatch, standin.Board())
    write(tmp_path, "/run/custom.sock")
    monkeypatch.setenv("HAILORT_SERVICE_ADDRESS", "unix:///run/custom.sock")
    stack = hailo_stack.stack_facts(SysRoot(tmp_path), live=True, node="/dev/hailo0")
    assert stack.binding is True
    assert stack.service == "hailort_service listens on /run/custom.sock"


def test_a_dtb_alone_cannot_show_a_pcie_accelerator():
    hw = HardwareFacts("aarch64", "Cortex-A76", [0, 1], {}, [], [], None, {}, None, dtb="pi5.dtb")
    (c,) = hb.BACKEND.candidates(hw, None)
    assert ".dtb does not list PCIe devices" in c.reason


def test_importing_the_backend_and_asking_its_version_imports_no_runtime():
    code = textwrap.dedent("""
        import sys, backends
        from backends import hailo
        hailo.BACKEND.version()
        print("hailo_platform" in sys.modules)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "False"


# -- sessions on the stand-in --------------------------------------------------------------------


@pytest.fixture
def board(monkeypatch, tmp_path, models_dir) -> standin.Board:
    board = standin.install(monkeypatch, standin.Board())
    monkeypatch.setattr(hailo_session, "SENSOR_MIN_INTERVAL_S", 0.0)
    hailo_root(tmp_path / "root")
    return board


def register(board, tmp_path, models_dir, name="synthetic-cls-hailo8l.hef", **kwargs):
    """A synthetic HEF the stand-in runs as the cls model; its ModelInfo."""
    arch = kwargs.pop("arch", "hailo8l")
    model = hef_model(tmp_path, name, hw_arch=standin.HW_ARCH[arch])
    onnx = kwargs.pop("onnx", models_dir / "ppocr_cls.onnx")
    height, width = kwargs.pop("hw", CLS_HW)
    board.models[str(model.path)] = standin.HefModel(onnx, height, width, arch=arch, **kwargs)
    return model


def candidate_for(tmp_path, model=None, backend=hb.BACKEND):
    (c,) = backend.candidates(facts(tmp_path / "root"), model)
    assert c.available, c.reason
    return c


def reference(models_dir, frames, quant=(1 / 255, 0), model="ppocr_cls.onnx"):
    """What the network computes, straight from onnxruntime: frames dequantized, NCHW."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(models_dir / model))
    scale, zero = quant
    x = ((frames.astype(np.float32) - zero) * scale).transpose(0, 3, 1, 2)
    return [session.run(None, {"x": x[i : i + 1]}) for i in range(len(x))]


def frames(n, hw=CLS_HW, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *hw, 3), dtype=np.uint8)


def test_a_session_runs_batches_as_hailort_would(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir, input_quant=(1 / 128, 128))
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    assert [(s.name, s.dtype, s.shape) for s in session.inputs] == [
        ("x", "uint8", (None, 48, 192, 3))
    ]
    (out,) = session.outputs
    assert (out.dtype, out.shape) == ("float32", (None, 2))
    assert session.io_quantization == {"x": (1 / 128, 128)}
    batch = frames(3)
    got = session.run({"x": batch})[out.name]
    want = np.concatenate([r[0] for r in reference(models_dir, batch, (1 / 128, 128))])
    assert got.shape == (3, 2) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got[0], got[1])  # different frames, different answers
    assert session.run({"x": batch[:1]})[out.name].shape == (1, 2)
    assert session.run({"x": batch[:0]})[out.name].shape == (0, 2)
    params = board.vdevice_params[-1]
    assert params["scheduling_algorithm"] == standin.HailoSchedulingAlgorithm.ROUND_ROBIN
    assert (params["group_id"], params["multi_process_service"]) == ("SHARED", False)
    assert board.run_timeouts[-1] == hailo_session.RUN_TIMEOUT_MS
    assert board.batch_sizes == [1]  # frames are bindings; HailoRT's burst is one frame
    info = session.info()
    assert info["precision"] == "int8" and info["architecture"] == "HAILO8L"
    assert (info["device"], info["api"], info["hailort"]) == ("/dev/hailo0", "InferModel", "4.20.0")
    session.close()


def test_wrong_inputs_are_refused_before_the_device(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir)
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    before = board.frames_run
    with pytest.raises(InputError, match="input 'x' has dtype float32, expected uint8"):
        session.run({"x": frames(1).astype(np.float32)})
    with pytest.raises(InputError, match="has shape 1x48x192, expected"):
        session.run({"x": frames(1)[..., 0]})
    assert board.frames_run == before


def test_nhwc_outputs_are_hailos_layout_of_the_networks_nchw(board, tmp_path, models_dir):
    model = register(
        board,
        tmp_path,
        models_dir,
        "synthetic-det.hef",
        onnx=models_dir / "ppocrv4_det.onnx",
        hw=(64, 96),
    )
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    (out,) = session.outputs
    assert out.shape == (None, 64, 96, 1)
    batch = frames(2, (64, 96))
    got = session.run({"x": batch})[out.name]
    want = np.concatenate(
        [r[0].transpose(0, 2, 3, 1) for r in reference(models_dir, batch, model="ppocrv4_det.onnx")]
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    session.close()


def test_on_chip_nms_outputs_are_served_in_tf_format(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir, nms=("save_infer_model/scale_0.tmp_1", 2, 4))
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    nms = next(s for s in session.outputs if s.name == "nms_out")
    assert nms.shape == (None, 2, 5, 4)
    batch = frames(2)
    got = session.run({"x": batch})
    assert got["nms_out"].shape == (2, 2, 5, 4)
    scores = got["save_infer_model/scale_0.tmp_1"]
    np.testing.assert_allclose(got["nms_out"][:, :, 4, 0], scores, rtol=1e-6)
    np.testing.assert_array_equal(got["nms_out"][:, :, :4, 0], np.tile([0, 0, 1, 1], (2, 2, 1)))
    assert not got["nms_out"][:, :, :, 1:].any()  # padding
    session.close()


def test_a_byte_mask_nms_output_is_a_model_error(board, tmp_path, models_dir):
    model = register(
        board,
        tmp_path,
        models_dir,
        nms=("save_infer_model/scale_0.tmp_1", 2, 4),
        nms_order="HAILO_NMS_WITH_BYTE_MASK",
    )
    with pytest.raises(ModelError, match=rf"{model.path}: output 'nms_out' is HAILO_NMS_WITH"):
        hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    assert board.open_groups == {"SHARED": 0}  # what it had opened is released


def test_models_of_one_process_share_the_device(board, tmp_path, models_dir):
    first = register(board, tmp_path, models_dir, "synthetic-a.hef")
    second = register(board, tmp_path, models_dir, "synthetic-b.hef")
    a = hb.BACKEND.load(first, candidate_for(tmp_path, first), LoadOptions())
    b = hb.BACKEND.load(second, candidate_for(tmp_path, second), LoadOptions())
    assert board.open_groups == {"SHARED": 2}
    batch = frames(1)
    np.testing.assert_allclose(
        a.run({"x": batch})[a.outputs[0].name], b.run({"x": batch})[b.outputs[0].name]
    )
    # A VDevice of its own (HailoRT's default group) would not get the device.
    with pytest.raises(standin.HailoRTException, match="HAILO_OUT_OF_PHYSICAL_DEVICES"):
        standin.VDevice(standin.VDevice.create_params())
    a.close()
    b.close()
    assert board.open_groups == {"SHARED": 0}


def test_another_process_holding_the_device_names_the_service_as_the_way(
    board, tmp_path, models_dir
):
    model = register(board, tmp_path, models_dir)
    board.held_elsewhere = True
    with pytest.raises(BackendError) as err:
        hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    message = str(err.value)
    assert message.startswith(f"{model.name}: HailoRT could not open hailo0:")
    assert "HAILO_OUT_OF_PHYSICAL_DEVICES" in message and "hailort.service" in message


def test_through_the_service_the_vdevice_is_opened_for_sharing(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir)
    board.service_running = True
    write(tmp_path / "root", hailo_stack.SERVICE_SOCKET)
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    params = board.vdevice_params[-1]
    assert params["multi_process_service"] is True and params["group_id"] == "SHARED"
    assert params["scheduling_algorithm"] == standin.HailoSchedulingAlgorithm.ROUND_ROBIN
    assert session.info()["multi_process_service"] is True
    batch = frames(2)
    assert session.run({"x": batch})[session.outputs[0].name].shape == (2, 2)
    board.unplug()  # the service's connection drops
    with pytest.raises(BackendError, match=r"HailoCommunicationClosedException.*hailort_service"):
        session.run({"x": batch})
    session.close()


def test_a_service_that_is_not_running_is_named(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir)
    forced = hb.HailoBackend(multi_process_service=True)
    with pytest.raises(BackendError, match=r"HAILO_RPC_FAILED.*is hailort.service running"):
        forced.load(model, candidate_for(tmp_path, model, forced), LoadOptions())


def test_unplugging_fails_runs_as_backend_errors_and_close_still_releases(
    board, tmp_path, models_dir
):
    model = register(board, tmp_path, models_dir)
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    batch = frames(1)
    session.run({"x": batch})
    assert "temperature_celsius" in session.sensors()
    board.unplug()
    with pytest.raises(BackendError) as err:
        session.run({"x": batch})
    assert str(err.value).startswith(f"{model.name}: HailoRT run on hailo0 failed:")
    assert "HailoRTDriverOperationFailedException" in str(err.value) and "dmesg" in str(err.value)
    calls = board.control_calls
    with pytest.raises(BackendError, match="hailo0 failed earlier"):
        session.run({"x": batch})
    assert session.sensors() == {}
    assert board.control_calls == calls  # a failed device is not asked again
    session.close()
    session.close()
    assert (board.shutdowns, board.released, board.open_groups) == (1, 1, {"SHARED": 0})


def test_a_device_that_stops_answering_times_out_into_a_backend_error(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir)
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    board.hung = True
    with pytest.raises(BackendError, match=r"HailoRTTimeout.*did not answer in time"):
        session.run({"x": frames(1)})
    assert board.run_timeouts == [hailo_session.RUN_TIMEOUT_MS]
    session.close()


def test_sensors_read_the_hotter_sensor_and_power_where_the_module_measures_it(
    board, tmp_path, models_dir
):
    model = register(board, tmp_path, models_dir)
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    board.temperatures = (51.0, 49.5)
    assert session.sensors() == {"temperature_celsius": 51.0}  # a Hailo-8L: no power monitor
    session.close()
    assert session.sensors() == {}
    board.architecture, board.current_monitoring, board.power_watts = "HAILO8", True, 2.5
    board.temperatures = (44.0, 46.75)
    model8 = register(board, tmp_path, models_dir, "synthetic-h8.hef", arch="hailo8")
    session = hb.BACKEND.load(model8, candidate_for(tmp_path, model8), LoadOptions())
    assert session.sensors() == {"temperature_celsius": 46.75, "power_watts": 2.5}
    board.power_watts = 3.0
    assert session.sensors()["power_watts"] == 3.0
    session.close()


def test_sensor_readings_are_kept_briefly(board, tmp_path, models_dir, monkeypatch):
    model = register(board, tmp_path, models_dir)
    session = hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    monkeypatch.setattr(hailo_session, "SENSOR_MIN_INTERVAL_S", 60.0)
    first = session.sensors()
    board.temperatures = (90.0, 90.0)
    assert session.sensors() == first
    session.close()


def test_a_hef_for_the_bigger_chip_is_refused_on_a_hailo8l_by_name(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir, "synthetic-h8.hef", arch="hailo8")
    with pytest.raises(ModelError) as err:
        hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())
    assert str(err.value).startswith(f"{model.path}: compiled for hailo8; hailo0 is a HAILO8L")
    assert board.open_groups == {"SHARED": 0}
    # The other way round a Hailo-8 runs it (HailoRT warns it is slower).
    board.architecture = "HAILO8"
    small = register(board, tmp_path, models_dir, "synthetic-h8l.hef", arch="hailo8l")
    hb.BACKEND.load(small, candidate_for(tmp_path, small), LoadOptions()).close()


def test_a_hef_hailort_rejects_is_a_model_error_naming_the_file(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir, corrupt=True)  # e.g. its xxh3 is wrong
    with pytest.raises(ModelError, match=rf"{model.path}: HailoRT cannot load this HEF: .*Invalid"):
        hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())


def test_a_driver_library_mismatch_at_open_is_named(board, tmp_path, models_dir):
    model = register(board, tmp_path, models_dir)
    board.driver_version = "4.19.0"
    with pytest.raises(BackendError, match=r"HAILO_INVALID_DRIVER_VERSION.*versions differ"):
        hb.BACKEND.load(model, candidate_for(tmp_path, model), LoadOptions())


def test_a_missing_runtime_at_load_is_a_backend_error(tmp_path, models_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "hailo_platform", None)  # import fails
    model = hef_model(tmp_path)
    candidate = Candidate("hailo", "hailo0", "model")
    with pytest.raises(BackendError, match=r"hailo_platform .* is not installed"):
        hb.BACKEND.load(model, candidate, LoadOptions())
