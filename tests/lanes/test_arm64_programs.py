"""The aarch64 lane's programs one by one (split from test_arm64.py, which holds the
selections of `edgectl backends` and what hangs on them, so the two files run side by side):
the hardware probe, OpenVINO's compile cache, the daemon serving the host, audit/provision/
revert of the root, and rknn-toolkit-lite2. Run emulated in the root (tests/support/arm64.py);
timings mean nothing and none is gated on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edged.quantize.defaults import DEFAULT_MAX_DROP
from edged.selection.accuracy import accuracy
from tests.support import REPO
from tests.support import daemon_harness as harness
from tests.support.arm64 import (
    CLS,
    CLS_INT8,
    CPU_INT8_FEATURES,
    Arm64Root,
    figure,
    lane_cpu,
)
from tests.support.roots import tree_state

pytestmark = [pytest.mark.arm64, pytest.mark.slow, pytest.mark.integration]


# -- 1. the hardware probe ------------------------------------------------------------------


PROBE = (
    "import json; from sysconf.hardware import probe; h = probe(); "
    "print(json.dumps({**h.to_dict(), 'int8_dot_product': h.int8_dot_product, "
    "'isa_summary': h.isa_summary(), 'fingerprint': h.fingerprint()}))"
)


@pytest.mark.parametrize("cpu", sorted({lane_cpu(), "cortex-a53"}))
def test_hardware_probe(arm64_root: Arm64Root, cpu: str) -> None:
    """arch aarch64, the emulated core's name and its INT8 features (QEMU writes cpuinfo for
    the -cpu model; numpy's AT_HWCAP table cross-checks it): dotprod on cortex-a76, none on
    cortex-a53 (ARMv8.0, the i.MX8M Plus's core)."""
    run = arm64_root.run("python3", "-c", PROBE, label=f"hardware probe, {cpu}", cpu=cpu)
    assert run.returncode == 0, run.why()
    facts = run.json()
    print(f"arm64 probe {cpu}: {facts}")
    assert facts["arch"] == "aarch64"
    assert set(facts["core_types"]) == {cpu.replace("cortex-a", "Cortex-A")}, facts["core_types"]
    assert sorted(c for cpus in facts["core_types"].values() for c in cpus) == facts["cpus_online"]
    if cpu in CPU_INT8_FEATURES:
        assert facts["isa_int8"] == CPU_INT8_FEATURES[cpu]
    else:
        assert "asimd" in facts["isa_int8"]
    # On ARM an 8-bit dot product is dotprod (asimddp) or i8mm.
    assert facts["int8_dot_product"] == bool({"asimddp", "i8mm"} & set(facts["isa_int8"]))
    if not facts["int8_dot_product"]:
        assert facts["isa_summary"].endswith(", no dotprod")


OV_CACHE = """
import json, sys
from pathlib import Path
from backends import Candidate, LoadOptions, get_backend
from backends.model_info import inspect_model
from edged.selection.inputs import make_inputs
model, cache, reduced = inspect_model(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
shapes = {"x": (1, 3, 48, 192)}
report = {}
for precision in (reduced, "fp32"):
    candidate = Candidate("openvino", "CPU", precision)
    options = LoadOptions(1, shapes=shapes, cache_root=cache)
    session = get_backend("openvino").load(model, candidate, options)
    out = session.run(make_inputs(session.inputs, shapes))
    report[precision] = {**session.info(), "output": next(iter(out.values())).tolist()}
print(json.dumps(report))
"""


def test_openvino_cache_keeps_precisions_apart(
    arm64_root: Arm64Root, models_dir: Path, tmp_path: Path
) -> None:
    """Selection compiles the OpenVINO candidates of a model one after the other with one
    CACHE_DIR (<state dir>/openvino-cache). Each must run the precision it asked for: the
    reduced one (fp16 on ARM, bf16 on x86) first, then fp32, which must be float32, not a
    blob compiled for the other hint. Checked in the root and on the host (bf16 only where
    its CPU has it, as selection offers it: else fp32 twice, the second from the cache)."""
    import openvino

    host_caps = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    host_reduced = "bf16" if "BF16" in host_caps else "fp32"
    arm = arm64_root.run(
        "python3",
        "-c",
        OV_CACHE,
        models_dir / CLS,
        tmp_path / "arm64-cache",
        "fp16",
        label="OpenVINO cls fp16 then fp32, one cache dir",
    )
    assert arm.returncode == 0, arm.why()
    host = subprocess.run(
        [
            sys.executable,
            "-c",
            OV_CACHE,
            str(models_dir / CLS),
            str(tmp_path / "x86"),
            host_reduced,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert host.returncode == 0, host.stderr
    wrong = []
    for side, report in (("aarch64", arm.json()), ("x86", json.loads(host.stdout))):
        for precision, info in report.items():
            print(
                f"arm64-ovcache: {side} requested {precision}: ran {info['precision']} "
                f"(hint {info['precision_hint']}, from cache {info['loaded_from_cache']}) "
                f"{info['output']}"
            )
            if info["precision"] != precision:
                wrong.append(f"{side}: asked {precision}, ran {info['precision']}: {info}")
    assert not wrong, "OpenVINO ran another precision than asked:\n" + "\n".join(wrong)


# -- 5. the daemon in the root, asked from the host -----------------------------------------------


def test_daemon_serves_the_host(
    arm64_root: Arm64Root, models_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """`ROOT/opt/edged/bin/edged --config` (cls INT8 pinned to onnxruntime, so start-up is
    one short selection), answering unmodified tritonclient.http over TCP and edged's client
    over the Unix socket; the answer is the host's for the same input."""
    import onnxruntime as ort
    import tritonclient.http as th

    from edged.client import Client
    from edged.selection.inputs import text_like_images

    models = f"""
[[models]]
name = "cls"
path = "{models_dir / CLS_INT8}"
backend = "onnxruntime"
threads = 1
shapes = {{ x = [1, 3, 48, 192] }}

[telemetry]
enabled = false
"""
    config = harness.write_config(tmp_path, models)
    monkeypatch.setattr(harness, "python_argv", arm64_root.daemon_argv)
    daemon = harness.Daemon(config, env=arm64_root.env())
    start = time.perf_counter()
    try:
        daemon.wait_ready(timeout=600)
        print(f"arm64-time: edged ready: {time.perf_counter() - start:.1f} s emulated")
        x = (
            np.repeat(next(text_like_images(48, 192, 1, 0))[None, None], 3, axis=1) * 2 - 1
        ).astype(np.float32)
        expected = ort.InferenceSession(str(models_dir / CLS_INT8)).run(None, {"x": x})[0]
        client = th.InferenceServerClient(daemon.address, network_timeout=300)
        assert client.is_server_ready() and client.is_model_ready("cls")
        assert client.get_model_metadata("cls")["platform"] == "onnxruntime_onnx"
        inp = th.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        [out_name] = [o["name"] for o in client.get_model_metadata("cls")["outputs"]]
        tcp = client.infer("cls", [inp]).as_numpy(out_name)
        with Client(f"unix:{tmp_path / 'edged.sock'}") as unix:
            assert unix.ready()
            via_socket = unix.infer("cls", {"x": x})[out_name]
        served = accuracy([{"y": expected}], [{"y": tcp}])
        print(
            f"arm64-figure: {CLS_INT8} served by edged on aarch64 vs x86 onnxruntime "
            f"{figure(served)}"
        )
        print(f"arm64-served: aarch64 {tcp.tolist()} x86 {expected.tolist()}")
        assert np.array_equal(tcp, via_socket)
        assert served.passes(DEFAULT_MAX_DROP) and served.cosine >= 1 - DEFAULT_MAX_DROP, served
    finally:
        code = daemon.stop(timeout=120)
    assert code == 0, daemon.log_text()


# -- 6. audit, provision and revert of the root's own tree ----------------------------------------


def test_audit_provision_revert(arm64_root: Arm64Root, dtb_corpus: Path, tmp_path: Path) -> None:
    """edgectl, running on aarch64: audits the root itself (a real Debian tree, read only),
    then provisions a copy of its etc/, var/ and systemd units for an i.MX8M Plus board and
    reverts it to the byte."""
    etc_before = tree_state(arm64_root.path / "etc")
    audit = arm64_root.run(
        "edgectl", "audit", "--root", arm64_root.path, "--format", "json", label="audit the root"
    )
    assert audit.returncode in (0, 1), audit.why()
    report = audit.json()
    assert report["findings"] and set(report["summary"]) >= {"pass", "warn", "fail", "error"}
    assert all({"id", "status"} <= set(f) for f in report["findings"])
    assert not [f for f in report["findings"] if f["status"] == "error"], report["summary"]
    assert tree_state(arm64_root.path / "etc") == etc_before  # read only
    print(f"arm64 audit of the root: {report['summary']}")

    image = tmp_path / "image"
    for part in ("etc", "var", "lib/systemd", "usr/lib/systemd", "boot"):
        if (arm64_root.path / part).is_dir():
            shutil.copytree(arm64_root.path / part, image / part, symlinks=True)
    before = tree_state(image)
    dtb = str(dtb_corpus / "freescale" / "imx8mp-evk.dtb")  # 4 Cortex-A53
    board = ["--root", str(image), "--dtb", dtb]
    audited = arm64_root.run(
        "edgectl", "audit", *board, "--format", "json", label="audit the copy with the dtb"
    )
    assert audited.returncode in (0, 1), audited.why()
    assert not [f for f in audited.json()["findings"] if f["status"] == "error"]
    provision = arm64_root.run(
        "edgectl", "provision", *board, "--inference-cpus", "3", "--json", label="provision"
    )
    assert provision.returncode == 0, provision.why()
    done = provision.json()
    assert done["applied"] and not done["skipped"], done["skipped"]
    assert (
        "CPUAffinity=0-2"
        in (image / "etc/systemd/system.conf.d/90-edged-cpuaffinity.conf").read_text()
    )
    assert (image / "etc/systemd/system/multi-user.target.wants/edged.service").is_symlink()
    assert tree_state(image) != before
    revert = arm64_root.run("edgectl", "revert", "--root", image, label="revert")
    assert revert.returncode == 0, revert.why()
    assert tree_state(image) == before


# -- 7. rknn-toolkit-lite2 in the root ----------------------------------------------------------

RKNN_LANE = """
import json, sys
from dataclasses import replace
import rknnlite.api
from backends import LoadOptions, get_backend, probe_hardware
from backends.base import Candidate
from backends.errors import BackendError
from backends.model_info import inspect_model

backend, model, hw = get_backend("rknn"), inspect_model(sys.argv[1]), probe_hardware()
out = {"mask": rknnlite.api.RKNNLite.NPU_CORE_0_1, "model": model.to_dict()}
out["here"] = [c.to_dict() for c in backend.candidates(hw, model)]
for soc in ("rockchip,rk3588", "rockchip,rk3566"):
    board = replace(hw, soc_compatible=["vendor,board", soc])
    out[soc] = [c.to_dict() for c in backend.candidates(board, model)]
npu = Candidate("rknn", "NPU", "model", True, "", {"soc": "rk3588", "cores": 3, "root": "/"})
try:
    backend.load(model, npu, LoadOptions(backend_options={"rknn": {"npu_cores": (0, 1)}}))
except BackendError as exc:
    out["load"] = str(exc)
print(json.dumps(out))
"""


def test_rknn_toolkit_lite2(arm64_root: Arm64Root, models_dir: Path) -> None:
    """In the root, on aarch64: rknn-toolkit-lite2 imports, edged reads the real .rknn model,
    and the RKNN backend's reasons are what is missing (here: no device tree; as an RK3588 or
    an RK3566 board: no rknpu driver and no librknnrt.so, which is not on PyPI, and the
    RK3566 is not the model's target). Loading on a made-up candidate reaches the real
    RKNNLite, whose init_runtime fails without the device: a BackendError, and rknnlite's
    messages stay off stdout."""
    name = "ppocr_cls_rk3588_int8.rknn"
    if not (models_dir / name).exists():  # a test-data cache older than the .rknn models
        script = REPO / "scripts" / "fetch_test_data.py"
        subprocess.run([sys.executable, str(script), "--only", "models"], check=True)
    run = arm64_root.run("python3", "-c", RKNN_LANE, models_dir / name, label="rknn-toolkit-lite2")
    assert run.returncode == 0, run.why()
    out = run.json()  # all of stdout: JSON only
    assert out["mask"] == 3  # RKNNLite.NPU_CORE_0_1, from the real module
    model = out["model"]
    assert (model["format"], model["target"], model["precision"]) == ("rknn", "rk3588", "int8")
    [here] = out["here"]
    assert not here["available"] and "not a Rockchip NPU SoC" in here["reason"]
    [rk3588] = out["rockchip,rk3588"]
    assert rk3588["reason"].startswith("Rockchip RK3588 NPU: no rknpu driver")
    assert "librknnrt.so is not in this system" in rk3588["reason"]
    assert "rknn-toolkit-lite2" not in rk3588["reason"] and "built for" not in rk3588["reason"]
    [rk3566] = out["rockchip,rk3566"]
    assert "the model is built for rk3588 (RKNPU2-V2), this board is rk3566" in rk3566["reason"]
    assert out["load"] == (
        f"{name}: RKNNLite.init_runtime failed on rk3588 (NPU_CORE_0_1): returned -1 "
        "(librknnrt says why on stderr)"
    )
