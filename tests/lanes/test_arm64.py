"""The aarch64 lane (issue 11): edged's own code and the runtimes' aarch64 kernels, run for real
in an emulated arm64 root (qemu-aarch64, the CPU model EDGED_ARM64_CPU, default cortex-a76).

The host's pytest drives; only the programs under test run emulated (ROOT/opt/edged/bin/...),
so x86 and aarch64 answers are compared here in one process. Emulation is ~100x slower than
a board and its timings mean nothing: every run prints its time (`arm64-time:` lines), none
is gated on. The accuracy figures go to the lane's closing note: `arm64-figure:` lines.

Not covered yet: a full-integer TFLite model (issue 12 makes one; the test data has none, and
none is faked here). rknn-toolkit-lite2 imports in the root but needs librknnrt.so and
/dev/rknpu, so it never is a candidate under emulation: test_rknn_toolkit_lite2 checks the
reasons the RKNN backend gives there and that the real RKNNLite's failure is its error.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edged.quantize.defaults import DEFAULT_MAX_DROP
from edged.selection.accuracy import Accuracy, ScoreMap, accuracy
from tests.conftest import FACE_MAX_DROP, FACE_SCORES, face_samples
from tests.support import REPO
from tests.support import daemon_harness as harness
from tests.support.arm64 import (
    CPU_INT8_FEATURES,
    ROOT_ENV,
    Arm64Root,
    Run,
    build_root,
    lane_cpu,
)
from tests.support.roots import tree_state

pytestmark = [pytest.mark.arm64, pytest.mark.slow, pytest.mark.integration]

CLS, CLS_INT8 = "ppocr_cls.onnx", "ppocr_cls_int8.onnx"
DET, DET_INT8 = "ppocrv4_det.onnx", "ppocrv4_det_int8.onnx"
FACE = "face_detection_short_range.tflite"
SHAPES = {
    CLS: "x=1x3x48x192",
    CLS_INT8: "x=1x3x48x192",
    DET: "x=1x3x64x64",
    DET_INT8: "x=1x3x64x64",
}
ORIGINAL = {CLS: CLS, CLS_INT8: CLS, DET: DET, DET_INT8: DET, FACE: FACE}
# What `edgectl backends --model` and `edgectl bench` run on: the INT8 det and cls models
# and the face TFLite (det is dynamic: a small shape, as the isa tests use).
SELECTED = (CLS_INT8, DET_INT8, FACE)
V8_0 = ("cortex-a53", "cortex-a72")  # no dotprod: OpenVINO's INT8 convolution fails there


def shape_args(name: str) -> list[str]:
    return ["--shape", SHAPES[name]] if name in SHAPES else []


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


@pytest.fixture(scope="session")
def backends_runs(
    arm64_root: Arm64Root, models_dir: Path, arm64_state: Path, tmp_path_factory
) -> dict[str, tuple[Run, dict]]:
    """`edgectl backends --model M --json` for each of SELECTED in the root (all candidates,
    default policy: the OpenVINO compiles are most of the time), and the same on the host.
    Run side by side (each is one emulated thread; the machine has 2 cores); the times
    printed are wall times of concurrent runs."""
    host_state = tmp_path_factory.mktemp("x86-state")
    jobs = {}
    for name in SELECTED:
        # Three timed runs after one: emulated timings mean nothing, and each timed run of
        # the detector is seconds under the emulator (the default is at least 10 after 5).
        args = ["backends", "--model", models_dir / name, *shape_args(name), "--threads", "1"]
        args += ["--runs", "3", "--warmup", "1"]
        args += ["--json"]
        arm = [arm64_root.edgectl, *args, "--state-dir", arm64_state]
        x86 = [sys.executable, "-m", "edged.cli.main", *args, "--state-dir", host_state]
        jobs[f"arm64:{name}"] = ([str(a) for a in arm], arm64_root.env())
        jobs[f"x86:{name}"] = ([str(a) for a in x86], None)

    def run(argv: list[str], env: dict[str, str] | None) -> Run:
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=1200)
        return Run(argv, proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {label: pool.submit(run, *job) for label, job in jobs.items()}
    runs: dict[str, tuple[Run, dict]] = {}
    for label, future in futures.items():
        done = future.result()
        assert done.returncode == 0, done.why()
        if label.startswith("arm64:"):
            model = label.removeprefix("arm64:")
            print(f"arm64-time: edgectl backends --model {model}: {done.seconds:.1f} s emulated")
        runs[label] = (done, done.json())
    return runs


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


# -- 2. edgectl backends --model and edgectl bench ----------------------------------------------


@pytest.mark.parametrize("name", SELECTED)
def test_backends_and_bench(
    arm64_root: Arm64Root,
    models_dir: Path,
    arm64_state: Path,
    backends_runs: dict,
    name: str,
) -> None:
    """The pick among every candidate the root has, with its evidence, then `edgectl bench`
    on the pick (the cached decision: the same policy). Each (variant, candidate) that passes
    on x86 passes on aarch64 too."""
    _, report = backends_runs[f"arm64:{name}"]
    _, x86 = backends_runs[f"x86:{name}"]
    assert report["hardware"]["arch"] == "aarch64"
    assert {"onnxruntime", "openvino", "litert"} <= set(report["runtimes"])
    assert report["model"]["path"].endswith(name) and report["variants"] == []
    keys = {"backend", "device", "precision", "available", "reason", "note"}
    assert all(set(c) == keys for c in report["candidates"]), report["candidates"][0]
    selected = report["selected"]
    assert selected is not None and not selected["from_cache"], report.get("error")
    assert selected["variant"].endswith(name) and selected["p99_ms"] > 0
    measured = [e for e in report["evidence"] if e["status"] != "unavailable"]
    for ev in measured:
        print(
            f"arm64-evidence: {name} {ev['backend']}:{ev['device']}:{ev['requested_precision']} "
            f"{ev['status']} ran {ev['precision']} score "
            f"{ev['accuracy'] and ev['accuracy']['score']} load {ev['load_s']} s "
            f"{ev['reason']}"
        )
    [pick] = [e for e in measured if e["status"] == "selected"]
    assert (pick["backend"], pick["device"]) == (selected["backend"], selected["device"])
    assert pick["latency"]["runs"] == 3  # backends_runs' --runs
    failed = [e for e in measured if e["status"] == "failed"]
    if arm64_root.cpu in V8_0:
        # NOTES (issue 11): OpenVINO 2026.4 compiles the INT8 cls model on ARMv8.0 cores,
        # then its first inference fails ("Convolution node ... is not initialized").
        failed = [e for e in failed if not (e["backend"] == "openvino" and "int8" in name)]
    assert not failed, failed
    arm_status = {_key(e): e["status"] for e in measured}
    for ev in x86["evidence"]:
        if ev["status"] in ("passed", "selected") and _key(ev) in arm_status:
            assert arm_status[_key(ev)] in ("passed", "selected"), (
                f"{name} {_key(ev)}: passes on x86, {arm_status[_key(ev)]} on aarch64"
            )

    bench = arm64_root.run(
        "edgectl",
        "bench",
        models_dir / name,
        *shape_args(name),
        "--threads",
        "1",
        "--runs",
        "3",
        "--warmup",
        "1",
        "--json",
        "--state-dir",
        arm64_state,
        label=f"edgectl bench {name}",
    )
    assert bench.returncode == 0, bench.why()
    result = bench.json()
    assert result["model"].endswith(name) and result["threads"] == 1
    [row] = result["results"]
    assert "error" not in row, row
    assert (row["backend"], row["device"]) == (selected["backend"], selected["device"])
    assert row["runs"] == 3 and row["p99_ms"] >= row["p50_ms"] > 0
    print(f"arm64-bench: {name} {row['backend']}:{row['device']} ran {row['precision']}")


def _key(ev: dict) -> str:
    return f"{ev['backend']}:{ev['device']}:{ev['requested_precision']}"


# -- 3. outputs against x86 and against the original ----------------------------------------------


def test_outputs_match_x86_and_the_original(
    arm64_root: Arm64Root,
    models_dir: Path,
    arm64_state: Path,
    backends_runs: dict,
    face_full_integer: dict[str, Path],
    test_data: Path,
    tmp_path: Path,
) -> None:
    """Each model (the FP32 originals, their INT8 variants, the face TFLite and its
    full-integer version made by edgectl quantize, float IO) on every
    candidate that runs its own arithmetic or float32, on the inputs selection makes, in the
    root and on the host. With edged.selection.accuracy (selection's rule, budget
    DEFAULT_MAX_DROP): the same inputs on both (numpy's seeded generator); aarch64 against
    x86 where both ran the same precision; and against the original (its float32 reference,
    made on the same machine, as selection does) wherever x86 passes that way too."""
    face_int8 = str(face_full_integer["float"])  # absolute: models_dir / it is itself
    names = [CLS, CLS_INT8, DET, DET_INT8, FACE, face_int8]
    original_of = {**ORIGINAL, face_int8: FACE}
    # The face detector and its full-integer version see the held-out detector photos and
    # are judged as detectors (raw logits of a full-integer model step by about one).
    rule = {FACE: ScoreMap(FACE_SCORES), face_int8: ScoreMap(FACE_SCORES)}
    _, evaluation, _ = face_samples(test_data)
    photos = tmp_path / "face-eval.npz"
    feeds = evaluation.feeds
    np.savez(photos, **{k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})
    jobs = tmp_path / "jobs.json"
    jobs.write_text(
        json.dumps(
            [
                {
                    "model": str(models_dir / n),
                    "shapes": {"x": [int(d) for d in SHAPES[n][2:].split("x")]}
                    if n in SHAPES
                    else None,
                    "inputs": str(photos) if n in rule else None,
                }
                for n in names
            ]
        )
    )
    arm_out, x86_out = tmp_path / "arm64.pickle", tmp_path / "x86.pickle"
    run = arm64_root.run(
        "python3",
        "-m",
        "tests.support.arm64",
        "outputs",
        jobs,
        arm_out,
        arm64_state / "openvino-cache",
        label="outputs of 6 models on every runtime",
    )
    assert run.returncode == 0, run.why()
    host = subprocess.run(
        [sys.executable, "-m", "tests.support.arm64", "outputs", str(jobs), str(x86_out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert host.returncode == 0, host.stderr
    arm = pickle.loads(arm_out.read_bytes())
    x86 = pickle.loads(x86_out.read_bytes())
    assert (arm["arch"], x86["arch"]) == ("aarch64", "x86_64")
    print(f"arm64-figure: CPUs: aarch64 {arm64_root.cpu} ({arm['isa']}); x86 ({x86['isa']})")
    # The full-integer model's budget is its gate's: LiteRT's built-in int8 kernels round
    # differently on aarch64 and x86 (about 0.98 agreement on the photos; XNNPACK's are
    # bit-identical), and each stays within the budget of the original.
    max_drop = {face_int8: FACE_MAX_DROP}
    findings = []
    for name in names:
        path = str(models_dir / name)
        a, x = arm["models"][path], x86["models"][path]
        assert a["inputs_sha256"] == x["inputs_sha256"], f"{name}: other inputs on aarch64"
        original = str(models_dir / original_of[name])
        ref_arm = arm["models"][original]["runs"]["reference"]["outputs"]
        ref_x86 = x86["models"][original]["runs"]["reference"]["outputs"]
        if name == original_of[name]:
            refs = accuracy(ref_x86, ref_arm)
            print(f"arm64-figure: {name} float32 reference: aarch64 vs x86 {_fig(refs)}")
            assert refs.passes(DEFAULT_MAX_DROP), f"{name}: the references differ: {refs}"
        for key, got in a["runs"].items():
            if key == "reference":
                continue
            assert "error" not in got, f"{name} {key} on aarch64: {got['error']}"
            theirs = x["runs"].get(key)
            assert theirs is not None and "error" not in theirs, f"{name} {key} on x86: {theirs}"
            scores = rule.get(name)
            vs_x86 = accuracy(theirs["outputs"], got["outputs"], scores)
            vs_orig = accuracy(ref_arm, got["outputs"], scores)
            x86_orig = accuracy(ref_x86, theirs["outputs"], scores)
            same = got["precision"] == theirs["precision"]
            drop = max_drop.get(name, DEFAULT_MAX_DROP)
            budget = 1.0 - drop
            print(
                f"arm64-figure: {name} {key} ran {got['precision']} (x86 {theirs['precision']}): "
                f"vs x86 {_fig(vs_x86)}{'' if same else ' [precisions differ: not gated]'}; "
                f"vs original {_fig(vs_orig)} (x86 vs original {_fig(x86_orig)})"
            )
            if same and not vs_x86.passes(drop):
                findings.append(f"{name} {key}: aarch64 vs x86 {vs_x86.score:.4f} < {budget}")
            # Where the two ran other precisions (OpenVINO runs parts of the full-integer
            # face model in fp16 on aarch64: 0.94 against the original, x86 0.97), that is
            # what selection's own check on the device judges; printed above, not gated.
            if same and x86_orig.passes(drop) and not vs_orig.passes(drop):
                findings.append(
                    f"{name} {key}: vs the original {vs_orig.score:.4f} < {budget} on aarch64 "
                    f"only (x86 {x86_orig.score:.4f})"
                )
    assert not findings, "aarch64-only differences:\n" + "\n".join(findings)


def _fig(acc: Accuracy) -> str:
    top1 = "" if acc.top1_agreement is None else f" top-1 {acc.top1_agreement:.3f}"
    return (
        f"score {acc.score:.6f} ({acc.rule}) cosine {acc.cosine:.6f} min {acc.cosine_min:.6f} "
        f"max-abs {acc.max_abs:.3g}{top1}"
    )


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
    options = LoadOptions(1, shapes=shapes, cache_dir=cache)
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
    blob compiled for the other hint. Checked in the root and on the host."""
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
        [sys.executable, "-c", OV_CACHE, str(models_dir / CLS), str(tmp_path / "x86"), "bf16"],
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


# -- 4. a selection that caches its pick -----------------------------------------------------------


def test_selection_is_cached(
    arm64_root: Arm64Root, models_dir: Path, arm64_state: Path, backends_runs: dict
) -> None:
    """The cls INT8 selection of test_backends_and_bench, asked again with the same state dir:
    served from the cache (no verification, no benchmark), the same pick and figures."""
    _, first = backends_runs[f"arm64:{CLS_INT8}"]
    assert not first["selected"]["from_cache"]
    assert list((arm64_state / "selection").glob("*.json")), "nothing cached"
    run = arm64_root.run(
        "edgectl",
        "backends",
        "--model",
        models_dir / CLS_INT8,
        *shape_args(CLS_INT8),
        "--threads",
        "1",
        *("--runs", "3", "--warmup", "1"),  # as backends_runs: the same decision's key
        "--json",
        "--state-dir",
        arm64_state,
        label="edgectl backends --model cls INT8, again (cached)",
    )
    assert run.returncode == 0, run.why()
    second = run.json()["selected"]
    assert second["from_cache"], second
    for field in ("variant", "backend", "device", "precision", "p99_ms", "accuracy", "why"):
        assert second[field] == first["selected"][field], field


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
            f"arm64-figure: {CLS_INT8} served by edged on aarch64 vs x86 onnxruntime {_fig(served)}"
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
    backend.load(model, npu, LoadOptions(npu_cores=(0, 1)))
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
