"""edgectl as a user runs it: JSON shapes scripts rely on, text output, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.daemon_harness import python_argv

REPO = Path(__file__).resolve().parents[2]


def edgectl(*args: str, state: Path, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGED_STATE_DIR": str(state)}
    proc = subprocess.run(
        [*python_argv(), "-m", "edged.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


@pytest.mark.integration
def test_backends_json(tmp_path: Path) -> None:
    report = json.loads(edgectl("backends", "--json", state=tmp_path).stdout)
    assert set(report) >= {"hardware", "candidates", "selected"}
    assert report["selected"] is None
    assert report["hardware"]["cpu_count"] == len(report["hardware"]["cpus_online"]) >= 1
    for cand in report["candidates"]:
        assert set(cand) >= {"backend", "device", "available", "reason", "note"}
        # "reason" is only ever a why-not; what a candidate is goes under "note".
        assert bool(cand["reason"]) != cand["available"], cand
    available = {(c["backend"], c["device"]) for c in report["candidates"] if c["available"]}
    assert ("onnxruntime", "CPU") in available and ("openvino", "CPU") in available
    assert ("litert", "XNNPACK") in available


@pytest.mark.integration
def test_backends_with_model(models_dir: Path, tmp_path: Path) -> None:
    model = str(models_dir / "ppocr_cls.onnx")
    args = ("backends", "--model", model, "--shape", "x=1x3x48x192", "--threads", "1")
    report = json.loads(edgectl(*args, "--json", state=tmp_path).stdout)
    sel = report["selected"]
    assert set(sel) >= {"backend", "device", "precision", "p50_ms", "p99_ms"}
    assert sel["p99_ms"] >= sel["p50_ms"] > 0
    assert sel["from_cache"] is False
    assert report["model"]["precision"] == "fp32" and report["model"]["int8"] is False
    again = json.loads(edgectl(*args, "--json", state=tmp_path).stdout)
    assert again["selected"]["from_cache"] is True
    text = edgectl(*args, state=tmp_path).stdout
    assert "FP32 alone: give INT8 variants" in text  # a float model runs but is flagged
    assert f"Selected      ppocr_cls.onnx on {sel['backend']}:{sel['device']}" in text
    assert "cached decision" in text and "Why           original on" in text


@pytest.mark.integration
def test_backends_with_variants_and_calibration(
    models_dir: Path, tmp_path: Path, cls_u8s8: Path
) -> None:
    """The family through the CLI: the given U8S8 variant and the INT8 variants made here
    from rendered text lines (held-out part: the evaluation set), each row against the
    original; on x86 without VNNI the U8S8 row names the cause."""
    from edged.selection.inputs import rendered_text_lines

    data = tmp_path / "calib"
    data.mkdir()
    for index, image in enumerate(rendered_text_lines(30, seed=11)):
        image.save(data / f"{index:02d}.png")
    model = str(models_dir / "ppocr_cls.onnx")
    args = (
        "backends",
        "--model",
        model,
        "--shape",
        "x=1x3x48x192",
        "--threads",
        "1",
        "--variant",
        str(cls_u8s8),
        "--calibration",
        str(data),
        "--mean",
        "0.5",
        "--std",
        "0.5",
    )
    report = json.loads(edgectl(*args, "--json", state=tmp_path / "state").stdout)
    made = report["made_variants"]
    assert made["variants"] and not made["cached"]
    assert all(
        Path(v).exists() and Path(v).parent.parent.name == "variants" for v in made["variants"]
    )
    assert report["variants"] == [str(cls_u8s8), *made["variants"]]
    rows = [e for e in report["evidence"] if e["status"] != "unavailable"]
    assert {e["variant"] for e in rows} == {model, *report["variants"]}
    assert all(e["accuracy"]["rule"] == "top-1 agreement" for e in rows)
    assert report["selected"]["why"] and report["selected"]["against_original"]
    text = edgectl(*args, state=tmp_path / "state").stdout
    assert "6 samples held out of" in text and "accuracy against the original" in text
    again = json.loads(edgectl(*args, "--json", state=tmp_path / "state").stdout)
    assert again["made_variants"]["cached"] and again["selected"]["from_cache"]


@pytest.mark.integration
def test_backends_bad_calibration_and_variant(models_dir: Path, tmp_path: Path) -> None:
    """Data that does not fit exits 2 naming the file and the input; so does a variant
    with other outputs, naming both files. Nothing is left in the state folder."""
    import numpy as np

    np.savez(tmp_path / "wrong.npz", image=np.zeros((4, 3, 48, 192), np.float32))
    model = str(models_dir / "ppocr_cls.onnx")
    state = tmp_path / "state"
    proc = edgectl(
        "backends",
        "--model",
        model,
        "--calibration",
        str(tmp_path / "wrong.npz"),
        state=state,
        check_rc=2,
    )
    assert "wrong.npz: no array for input(s) x" in proc.stderr
    proc = edgectl(
        "backends",
        "--model",
        model,
        "--variant",
        str(models_dir / "ppocrv4_det_int8.onnx"),
        state=state,
        check_rc=2,
    )
    assert "ppocrv4_det_int8.onnx does not match its original" in proc.stderr
    assert "ppocr_cls.onnx: outputs are" in proc.stderr
    assert not list(state.rglob("*.json")) and not list(state.rglob("*.onnx"))


@pytest.mark.integration
def test_bench_json_all(models_dir: Path, tmp_path: Path) -> None:
    out = edgectl(
        "bench",
        str(models_dir / "ppocr_cls_int8.onnx"),
        "--backend",
        "all",
        "--shape",
        "x=1x3x48x192",
        "--runs",
        "20",
        "--warmup",
        "2",
        "--threads",
        "1",
        "--json",
        state=tmp_path,
    ).stdout
    report = json.loads(out)
    assert report["model"].endswith("ppocr_cls_int8.onnx")
    keys = {
        "backend",
        "device",
        "precision",
        "runs",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "p999_ms",
        "max_ms",
        "mean_ms",
        "stdev_ms",
    }
    backends = set()
    for result in report["results"]:
        assert keys <= set(result)
        assert result["runs"] == 20
        assert result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"] <= result["max_ms"]
        backends.add(result["backend"])
    assert backends == {"onnxruntime", "openvino"}


@pytest.mark.integration
def test_bench_tflite_text(models_dir: Path, tmp_path: Path) -> None:
    out = edgectl(
        "bench",
        str(models_dir / "face_detection_short_range.tflite"),
        "--backend",
        "litert:XNNPACK",
        "--runs",
        "15",
        "--cpus",
        "0",
        state=tmp_path,
    ).stdout
    assert "litert:XNNPACK:model" in out and "p99" in out


@pytest.mark.integration
def test_pinned_bench_imports_only_its_runtime(models_dir: Path, tmp_path: Path) -> None:
    """`bench --backend litert:XNNPACK` lists and loads LiteRT only: neither openvino nor
    onnxruntime ends up in sys.modules (checked in the process that ran the command)."""
    code = textwrap.dedent(f"""
        import sys
        from edged.cli.main import main
        rc = main(["bench", {str(models_dir / "face_detection_short_range.tflite")!r},
                   "--backend", "litert:XNNPACK", "--runs", "5", "--warmup", "1", "--json"])
        runtimes = ("openvino", "onnxruntime", "ai_edge_litert", "tflite_runtime")
        print(rc, sorted(m for m in runtimes if m in sys.modules), file=sys.stderr)
    """)
    env = {**os.environ, "EDGED_STATE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=True,
    )
    assert json.loads(proc.stdout)["results"][0]["backend"] == "litert"
    assert proc.stderr.strip().splitlines()[-1] == "0 ['ai_edge_litert']", proc.stderr


@pytest.mark.integration
def test_failed_selection_shows_its_evidence(models_dir: Path, tmp_path: Path) -> None:
    """No candidate passes: exit 1, the JSON still carries what each candidate did."""
    proc = edgectl(
        "backends",
        "--model",
        str(models_dir / "ppocr_cls.onnx"),
        "--shape",
        "x=1x3x48x192",
        "--threads",
        "1",
        "--max-abs",
        "-1",
        "--json",
        state=tmp_path,
        check_rc=1,
    )
    report = json.loads(proc.stdout)
    assert report["selected"] is None and "no candidate ran it correctly" in report["error"]
    measured = [e for e in report["evidence"] if e["status"] != "unavailable"]
    assert measured and all(e["status"] == "rejected" for e in measured)
    assert all("max-abs" in e["reason"] and e["accuracy"]["score"] == 1.0 for e in measured)
    proc = edgectl(
        "backends",
        "--model",
        str(models_dir / "ppocr_cls.onnx"),
        "--min-cosine",
        "1.5",
        state=tmp_path,
        check_rc=2,
    )
    assert "--max-drop -0.5: must be at least 0 and below 1" in proc.stderr


def test_bench_failed_candidate_keeps_every_key(
    models_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """A candidate that fails (made to fail here: nothing on this machine fails on its
    own) keeps every stat key, null, plus "error"; the others are measured as usual."""
    from backends import get_backend
    from backends.errors import BackendError
    from edged.cli.main import main

    def broken_load(model, candidate, options):
        raise BackendError(f"{model.name}: openvino cannot compile it for {candidate.device}")

    monkeypatch.setattr(get_backend("openvino"), "load", broken_load)
    monkeypatch.setenv("EDGED_STATE_DIR", str(tmp_path))
    rc = main(
        [
            "bench",
            str(models_dir / "ppocr_cls_int8.onnx"),
            "--backend",
            "all",
            "--shape",
            "x=1x3x48x192",
            "--runs",
            "5",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    keys = {
        "backend",
        "device",
        "precision",
        "runs",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "p999_ms",
        "max_ms",
        "mean_ms",
        "stdev_ms",
    }
    failed = [r for r in report["results"] if "error" in r]
    ok = [r for r in report["results"] if "error" not in r]
    assert failed and ok and {r["backend"] for r in failed} == {"openvino"}
    for result in report["results"]:
        assert keys <= set(result)
    assert all(r["p99_ms"] is None and r["runs"] is None for r in failed)
    assert all(r["p99_ms"] > 0 for r in ok)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bench", "{missing}"), "no such file"),
        (("bench", "{truncated}"), "not a valid ONNX model"),
        (("bench", "{text}"), "unsupported model format"),
        (("bench", "{cls}", "--shape", "image=1x3x48x192"), "unknown input 'image'"),
        (("bench", "{cls}", "--shape", "x=1x3"), "the model takes ?x3x?x?"),
        (("bench", "{cls}", "--shape", "x=1xAx3"), "--shape 'x=1xAx3'"),
        (("bench", "{cls}", "--cpus", "4096"), "CPU 4096 is not available"),
        (("bench", "{cls}", "--cpus", "3-1"), "bad CPU list"),
        (("bench", "{cls}", "--backend", "litert"), "nothing available"),
        (("backends", "--model", "{truncated}"), "not a valid ONNX model"),
        (("bench", "{cls}", "--runs", "0"), "--runs must be at least 1"),
        (("backends", "--model", "{cls}", "--runs", "0"), "--runs must be at least 1"),
        (("backends", "--model", "{cls}", "--warmup", "-1"), "--warmup at least 0"),
        (
            ("bench", "{face}", "--backend", "litert:XNNPACK", "--shape", "input=1x64x64x3"),
            "the model takes 1x128x128x3",
        ),
    ],
)
@pytest.mark.integration
def test_bad_input_exit_2(models_dir: Path, tmp_path: Path, args, message: str) -> None:
    data = (models_dir / "ppocr_cls.onnx").read_bytes()
    (tmp_path / "truncated.onnx").write_bytes(data[: len(data) // 3])
    (tmp_path / "notes.txt").write_text("not a model\n")
    paths = {
        "missing": str(tmp_path / "missing.onnx"),
        "truncated": str(tmp_path / "truncated.onnx"),
        "text": str(tmp_path / "notes.txt"),
        "cls": str(models_dir / "ppocr_cls.onnx"),
        "face": str(models_dir / "face_detection_short_range.tflite"),
    }
    argv = [a.format(**paths) for a in args]
    proc = edgectl(*argv, state=tmp_path / "state", check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgectl: error: "), proc.stderr
    assert message in lines[0]
    assert not (tmp_path / "state" / "selection").exists() or not list(
        (tmp_path / "state" / "selection").iterdir()
    )


@pytest.mark.integration
def test_backends_on_board_root(dtb_corpus: Path, tmp_path: Path) -> None:
    """`--root`: the hardware facts of an image/fixture root (an i.MX8MP EVK tree)."""
    from sysconf.fdt import load_fdt, materialize

    root = tmp_path / "root"
    materialize(
        load_fdt(dtb_corpus / "freescale" / "imx8mp-evk.dtb"),
        root / "sys" / "firmware" / "devicetree" / "base",
    )
    (root / "dev").mkdir()
    (root / "dev" / "galcore").touch()
    report = json.loads(edgectl("backends", "--root", str(root), "--json", state=tmp_path).stdout)
    hw = report["hardware"]
    assert "fsl,imx8mp" in hw["soc_compatible"]
    assert [a["name"] for a in hw["accelerators"]] == ["Vivante NPU (galcore)"]
    [vx] = [c for c in report["candidates"] if c["device"] == "NPU-VX"]
    # Offline the delegate library is looked for in the image, never loaded.
    assert not vx["available"]
    assert "delegate /usr/lib/libvx_delegate.so is not in the image" in vx["reason"]
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "usr" / "lib" / "libvx_delegate.so").write_bytes(b"\x7fELF not loaded")
    report = json.loads(edgectl("backends", "--root", str(root), "--json", state=tmp_path).stdout)
    [vx] = [c for c in report["candidates"] if c["device"] == "NPU-VX"]
    assert vx["available"] and "not loaded offline" in vx["note"]


@pytest.mark.integration
def test_fleet_is_an_edgectl_command(tmp_path: Path) -> None:
    proc = edgectl("fleet", "--broker", "http://nope", "--once", state=tmp_path, check_rc=2)
    assert proc.stderr.startswith("edgectl: error: ") and "--broker" in proc.stderr


@pytest.mark.integration
def test_audit_is_an_edgectl_command(tmp_path: Path) -> None:
    proc = edgectl("audit", "--dtb", str(tmp_path / "none.dtb"), state=tmp_path, check_rc=2)
    assert proc.stderr.startswith("edgectl: error: ") and "none.dtb" in proc.stderr
    report = json.loads(
        edgectl("audit", "--format", "json", "--only", "THM", state=tmp_path, check_rc=None).stdout
    )
    assert set(report) == {"findings", "summary"}


def test_a_reader_that_goes_away_is_not_a_traceback(monkeypatch, capsys) -> None:
    """`edgectl backends --json | head -c 1`: the pipe closes under edgectl. Exit 141 (what a
    shell shows for SIGPIPE), nothing on stderr, and stdout no longer fails at exit."""
    import os

    from edged.cli.main import main

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    broken = os.fdopen(write_end, "w")
    monkeypatch.setattr("sys.stdout", broken)
    try:
        assert main(["backends", "--json"]) == 141
        assert capsys.readouterr().err == ""
        broken.write("more")
        broken.flush()  # now /dev/null: the interpreter's last flush cannot fail
    finally:
        broken.close()


@pytest.mark.parametrize("address", ["garbage", "http://[::1", "unix:", "host:0", "h:99999"])
@pytest.mark.integration
def test_malformed_address_is_bad_input(address: str, tmp_path: Path) -> None:
    proc = edgectl("status", "--address", address, state=tmp_path, check_rc=2)
    assert f"--address {address!r}: expected unix:PATH, HOST:PORT" in proc.stderr
    proc = edgectl("reload", "--address", "127.0.0.1:8000", state=tmp_path, check_rc=2)
    assert "expected unix:PATH" in proc.stderr
