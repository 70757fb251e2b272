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
import pickle
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edged.quantize.defaults import DEFAULT_MAX_DROP
from edged.selection.accuracy import ScoreMap, accuracy
from tests.conftest import FACE_MAX_DROP, FACE_SCORES, face_samples
from tests.support import REPO
from tests.support.arm64 import (
    CLS,
    CLS_INT8,
    DET,
    DET_INT8,
    FACE,
    Arm64Root,
    Run,
    figure,
)

pytestmark = [pytest.mark.arm64, pytest.mark.slow, pytest.mark.integration]

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

    # On the pick by name: `--backend auto` would select again with bench's own (full) timing,
    # a decision apart from the quick look above (test_selection_is_cached covers reuse).
    bench = arm64_root.run(
        "edgectl",
        "bench",
        models_dir / name,
        *shape_args(name),
        "--backend",
        f"{pick['backend']}:{pick['device']}:{pick['requested_precision']}",
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
        arm64_state,
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
            print(f"arm64-figure: {name} float32 reference: aarch64 vs x86 {figure(refs)}")
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
                f"vs x86 {figure(vs_x86)}{'' if same else ' [precisions differ: not gated]'}; "
                f"vs original {figure(vs_orig)} (x86 vs original {figure(x86_orig)})"
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
