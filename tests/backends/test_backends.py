"""The three runtimes on the real models: metadata, runs, threads/CPU sets, what really ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from backends import LoadOptions, get_backend, probe_hardware
from backends.base import Candidate
from backends.errors import InputError
from backends.model_info import inspect_model
from edged.selection.accuracy import compare
from edged.selection.inputs import make_inputs

CLS_SHAPE = {"x": (1, 3, 48, 192)}


def candidate(hw, backend: str, device: str, model, precision: str | None = None) -> Candidate:
    for cand in get_backend(backend).candidates(hw, model):
        if cand.device == device and (precision is None or cand.precision == precision):
            return cand
    pytest.fail(f"no {backend}:{device}:{precision} candidate")


@pytest.fixture(scope="module")
def hw():
    return probe_hardware()


@pytest.mark.isa
def test_onnxruntime_runs_int8_cls(hw, models_dir: Path) -> None:
    model = inspect_model(models_dir / "ppocr_cls_int8.onnx")
    session = get_backend("onnxruntime").load(
        model, candidate(hw, "onnxruntime", "CPU", model), LoadOptions(threads=1)
    )
    [inp] = session.inputs
    assert (inp.name, inp.dtype, inp.shape) == ("x", "float32", (None, 3, None, None))
    assert session.outputs[0].shape == (None, 2)
    out = session.run(make_inputs(session.inputs, CLS_SHAPE))
    probs = next(iter(out.values()))
    assert probs.shape == (1, 2)
    assert np.allclose(probs.sum(), 1.0, atol=1e-2)  # softmax over the two directions
    assert session.info()["precision"] == "int8"


def _task_affinities() -> dict[int, str]:
    result = {}
    for tid in os.listdir("/proc/self/task"):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
        result[int(tid)] = line.split(":", 1)[1].strip()
    return result


@pytest.mark.needs_cpus(2)
def test_onnxruntime_pins_its_pool(hw, models_dir: Path) -> None:
    """The pool threads onnxruntime creates run on the CPU set (checked in /proc)."""
    target = max(os.sched_getaffinity(0))
    before = set(_task_affinities())
    model = inspect_model(models_dir / "ppocr_cls.onnx")
    session = get_backend("onnxruntime").load(
        model, candidate(hw, "onnxruntime", "CPU", model), LoadOptions(threads=2, cpus=[target])
    )
    session.run(make_inputs(session.inputs, CLS_SHAPE))
    new = {tid: cpus for tid, cpus in _task_affinities().items() if tid not in before}
    assert new, "onnxruntime created no pool thread"
    assert set(new.values()) == {str(target)}, new


@pytest.mark.needs_cpus(2)
def test_litert_pool_runs_on_the_worker_cpus(hw, models_dir: Path) -> None:
    """LiteRT has no affinity setting: XNNPACK's pool threads inherit the CPU set of the
    thread that creates them. Loaded and run as the model worker does (pinned to its CPU),
    every thread it starts is on that CPU, not on the housekeeping cores."""
    from edged.selection.bench import pinned_thread

    target = max(os.sched_getaffinity(0))
    full = _task_affinities()[threading.get_native_id()]
    before = set(_task_affinities())
    model = inspect_model(models_dir / "face_detection_short_range.tflite")
    with pinned_thread([target]):
        session = get_backend("litert").load(
            model, candidate(hw, "litert", "XNNPACK", model), LoadOptions(threads=2, cpus=[target])
        )
        session.run(make_inputs(session.inputs, {"input": (1, 128, 128, 3)}))
    new = {tid: cpus for tid, cpus in _task_affinities().items() if tid not in before}
    assert new, "LiteRT started no pool thread for num_threads=2"
    assert set(new.values()) == {str(target)}, new
    assert _task_affinities()[threading.get_native_id()] == full  # the caller is restored
    session.close()


@pytest.mark.isa
def test_openvino_reports_the_precision_that_ran(hw, models_dir: Path, tmp_path: Path) -> None:
    model = inspect_model(models_dir / "ppocr_cls.onnx")
    options = LoadOptions(threads=1, shapes=CLS_SHAPE, cache_root=tmp_path)
    fp32 = get_backend("openvino").load(
        model, candidate(hw, "openvino", "CPU", model, "fp32"), options
    )
    info = fp32.info()
    assert info["precision"] == "fp32" and info["precision_hint"] == "f32"
    assert fp32.inputs[0].shape == (1, 3, 48, 192)
    feeds = make_inputs(fp32.inputs, CLS_SHAPE)
    ref = fp32.run(feeds)
    assert any((tmp_path / "openvino-cache").iterdir()), "the model cache dir stayed empty"
    assert info["loaded_from_cache"] is False
    # A second compile with the same settings and cache dir (a restart) imports the blob.
    again = get_backend("openvino").load(
        model, candidate(hw, "openvino", "CPU", model, "fp32"), options
    )
    assert again.info()["loaded_from_cache"] is True
    assert compare(ref, again.run(feeds))[0] > 0.9999
    bf16_candidates = [
        c for c in get_backend("openvino").candidates(hw, model) if c.precision == "bf16"
    ]
    if bf16_candidates:  # this CPU can do bf16: the plugin's default, made explicit
        bf16 = get_backend("openvino").load(model, bf16_candidates[0], options)
        assert bf16.info()["precision"] == "bf16"
        cosine, _ = compare(ref, bf16.run(feeds))
        assert cosine > 0.99
    int8 = inspect_model(models_dir / "ppocr_cls_int8.onnx")
    q = get_backend("openvino").load(int8, candidate(hw, "openvino", "CPU", int8, "fp32"), options)
    assert q.info()["precision"] == "int8"
    assert q.info()["compute_layers"].get("int8", 0) > 0


def test_openvino_reads_tflite(hw, models_dir: Path) -> None:
    model = inspect_model(models_dir / "face_detection_short_range.tflite")
    session = get_backend("openvino").load(
        model, candidate(hw, "openvino", "CPU", model, "fp32"), LoadOptions(threads=1)
    )
    out = session.run(make_inputs(session.inputs, {"input": (1, 128, 128, 3)}))
    assert sorted(v.shape for v in out.values()) == [(1, 896, 1), (1, 896, 16)]


def test_litert_xnnpack_and_builtin(hw, models_dir: Path) -> None:
    model = inspect_model(models_dir / "face_detection_short_range.tflite")
    litert = get_backend("litert")
    xnn = litert.load(model, candidate(hw, "litert", "XNNPACK", model), LoadOptions(threads=2))
    plain = litert.load(model, candidate(hw, "litert", "CPU", model), LoadOptions(threads=1))
    assert [s.name for s in xnn.inputs] == ["input"]
    assert xnn.inputs[0].shape == (1, 128, 128, 3)
    # XNNPACK took the whole graph; the built-in path has no delegate at all.
    assert xnn.info()["delegate_coverage"] == 1.0
    assert xnn.info()["delegated_ops"] == xnn.info()["total_ops"] > 100
    assert plain.info()["delegated_ops"] == 0
    feeds = make_inputs(xnn.inputs, {"input": (1, 128, 128, 3)})
    cosine, max_abs = compare(plain.run(feeds), xnn.run(feeds))
    assert cosine > 0.9999 and max_abs < 1e-2


def test_npu_delegates_are_candidates_with_reasons(hw, models_dir: Path) -> None:
    """No NPU here: every delegate is listed, unavailable, and says what it looked for."""
    model = inspect_model(models_dir / "face_detection_short_range.tflite")
    npu = [
        c
        for c in get_backend("litert").candidates(hw, model)
        if c.device.startswith(("NPU", "EdgeTPU"))
    ]
    assert {c.device for c in npu} >= {"NPU-VX", "NPU-EthosU", "NPU-Neutron", "EdgeTPU"}
    for cand in npu:
        assert not cand.available
        assert "not on this device" in cand.reason


def test_delegate_load_failure_is_reported(hw, models_dir: Path) -> None:
    """On an i.MX8MP root (NPU node present) without the vendor delegate library installed,
    the VX candidate is unavailable with the dynamic loader's own message."""
    from dataclasses import replace

    from sysconf.hardware import Accelerator

    imx = replace(
        hw,
        soc_compatible=["fsl,imx8mp-evk", "fsl,imx8mp"],
        accelerators=[Accelerator("npu", "Vivante NPU (galcore)", "/dev/galcore", None)],
    )
    model = inspect_model(models_dir / "face_detection_short_range.tflite")
    [vx] = [c for c in get_backend("litert").candidates(imx, model) if c.device == "NPU-VX"]
    assert not vx.available
    assert "delegate did not load" in vx.reason
    assert "libvx_delegate.so" in vx.reason


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_wrong_inputs_name_the_input(hw, models_dir: Path, backend: str) -> None:
    model = inspect_model(models_dir / "ppocr_cls.onnx")
    cand = next(c for c in get_backend(backend).candidates(hw, model) if c.available)
    session = get_backend(backend).load(model, cand, LoadOptions(threads=1, shapes=CLS_SHAPE))
    good = make_inputs(session.inputs, CLS_SHAPE)["x"]
    with pytest.raises(InputError, match="unknown input 'image'"):
        session.run({"image": good})
    with pytest.raises(InputError, match="input 'x' has dtype float64, expected float32"):
        session.run({"x": good.astype(np.float64)})
    with pytest.raises(InputError, match=r"input 'x' has shape 3x48x192, expected"):
        session.run({"x": good[0]})
    with pytest.raises(InputError, match="'x' is missing"):
        session.run({})


def test_litert_wrong_shape(hw, models_dir: Path) -> None:
    model = inspect_model(models_dir / "face_detection_short_range.tflite")
    session = get_backend("litert").load(
        model, candidate(hw, "litert", "XNNPACK", model), LoadOptions(threads=1)
    )
    with pytest.raises(InputError, match=r"'input' has shape 1x64x64x3, expected 1x128x128x3"):
        session.run({"input": np.zeros((1, 64, 64, 3), np.float32)})


def test_wrong_format_is_an_unavailable_candidate(hw, models_dir: Path) -> None:
    tflite = inspect_model(models_dir / "face_detection_short_range.tflite")
    [ort_cpu] = [c for c in get_backend("onnxruntime").candidates(hw, tflite) if c.device == "CPU"]
    assert not ort_cpu.available and "reads only ONNX" in ort_cpu.reason
    onnx = inspect_model(models_dir / "ppocr_cls.onnx")
    assert not any(c.available for c in get_backend("litert").candidates(hw, onnx))


@pytest.mark.integration
def test_loading_litert_does_not_import_openvino(models_dir: Path) -> None:
    """Lazy imports: running a .tflite with LiteRT imports neither OpenVINO nor onnxruntime."""
    code = textwrap.dedent(f"""
        import sys
        from backends import LoadOptions, get_backend
        from backends.base import Candidate
        from backends.model_info import inspect_model
        from edged.selection.inputs import make_inputs
        model = inspect_model({str(models_dir / "face_detection_short_range.tflite")!r})
        s = get_backend("litert").load(model, Candidate("litert", "XNNPACK", "model"),
                                       LoadOptions(threads=1))
        s.run(make_inputs(s.inputs, {{"input": (1, 128, 128, 3)}}))
        print(sorted(m for m in ("openvino", "onnxruntime", "ai_edge_litert") if m in sys.modules))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "['ai_edge_litert']"


def test_openvino_runs_an_ir_model(hw, models_dir: Path, tmp_path: Path) -> None:
    """OpenVINO IR (.xml + .bin), converted here from the real cls model."""
    import openvino as ov

    xml = tmp_path / "cls.xml"
    ov.save_model(
        ov.convert_model(str(models_dir / "ppocr_cls.onnx")), str(xml), compress_to_fp16=False
    )
    model = inspect_model(xml)
    assert model.format == "openvino-ir"
    session = get_backend("openvino").load(
        model,
        candidate(hw, "openvino", "CPU", model, "fp32"),
        LoadOptions(threads=1, shapes=CLS_SHAPE),
    )
    onnx_model = inspect_model(models_dir / "ppocr_cls.onnx")
    ref = get_backend("onnxruntime").load(
        onnx_model, candidate(hw, "onnxruntime", "CPU", onnx_model), LoadOptions(threads=1)
    )
    feeds = make_inputs(session.inputs, CLS_SHAPE)
    cosine, max_abs = compare(ref.run(feeds), session.run(feeds))
    assert cosine > 0.9999 and max_abs < 1e-3
    assert not any(c.available for c in get_backend("onnxruntime").candidates(hw, model))


@pytest.mark.needs_cpus(2)
@pytest.mark.integration
def test_openvino_threads_stay_on_the_cpu_set(models_dir: Path) -> None:
    """Two models, each loaded and run from a thread pinned to its CPU (what the daemon's
    loader and worker do): OpenVINO's stream threads land on that CPU. In a fresh process:
    OpenVINO reuses executors across compiles with equal settings, so an earlier unpinned
    load in the same process (as in this test module) would be measured instead."""
    code = textwrap.dedent(f"""
        import json, os, threading
        from pathlib import Path
        from backends import LoadOptions, get_backend
        from backends.base import Candidate
        from backends.model_info import inspect_model
        from edged.selection.bench import pinned_thread
        from edged.selection.inputs import make_inputs

        def tasks():
            out = {{}}
            for tid in os.listdir("/proc/self/task"):
                try:  # a runtime thread may end between the listing and the read
                    status = Path(f"/proc/self/task/{{tid}}/status").read_text()
                except (FileNotFoundError, ProcessLookupError):
                    continue
                out[tid] = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                                if line.startswith("Cpus_allowed_list"))
            return out

        model = inspect_model({str(models_dir / "ppocr_cls.onnx")!r})
        result = {{}}
        for cpu in (0, 1):
            before = set(tasks())
            with pinned_thread([cpu]):
                s = get_backend("openvino").load(model, Candidate("openvino", "CPU", "fp32"),
                    LoadOptions(threads=1, cpus=[cpu], shapes={{"x": (1, 3, 48, 192)}}))
            # Run from another thread that pins itself, as the daemon's worker does. OpenVINO
            # resets its caller's affinity on every infer (to the mask it kept at load, which
            # in the daemon is the housekeeping set); run() must put the caller back.
            caller = []
            def work():
                os.sched_setaffinity(0, {{cpu}})
                for _ in range(2):
                    s.run(make_inputs(s.inputs, {{"x": (1, 3, 48, 192)}}))
                caller.extend(sorted(os.sched_getaffinity(0)))
            with pinned_thread([1 - cpu]):  # the worker starts from the other CPU's mask
                t = threading.Thread(target=work)
                t.start()
            t.join()
            new = set(tasks()) - before
            result[cpu] = [sorted(set(c for t, c in tasks().items() if t in new)), caller]
        print(json.dumps(result))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == '{"0": [["0"], [0]], "1": [["1"], [1]]}', (
        out.stdout
    )


def test_backends_are_found_by_file_name_in_their_order_without_a_runtime():
    # One file per backend: the registry is what the package holds, ordered by ORDER, and
    # building it imports no runtime (config validation and `edgectl --help` rely on that).
    code = textwrap.dedent("""
        import importlib, json, sys
        import backends
        mods = [importlib.import_module(m) for m in backends.REGISTRY.values()]
        print(json.dumps({
            "names": list(backends.REGISTRY),
            "orders": [m.ORDER for m in mods],
            "match": all(m.BACKEND.name == m.NAME == n for m, n in zip(mods, backends.REGISTRY)),
            "aliases": backends.ALIASES,
            "runtimes": [r for r in ("onnxruntime", "openvino", "ai_edge_litert", "tflite_runtime",
                                     "rknnlite", "hailo_platform") if r in sys.modules],
            "formats": {f: backends.format_owner(f) for f in backends.model_formats()},
            "platforms": {f: m.platform for f, m in backends.model_formats().items()},
        }))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["names"] == ["onnxruntime", "openvino", "litert", "rknn", "hailo"]
    assert got["orders"] == sorted(got["orders"])
    assert got["match"]
    assert got["aliases"] == {
        "ort": "onnxruntime",
        "ov": "openvino",
        "tflite": "litert",
        "rockchip": "rknn",
        "rknpu": "rknn",
        "hailort": "hailo",
    }
    assert got["runtimes"] == []
    # Each format is declared by the one backend that owns it, with its protocol platform.
    assert got["formats"] == {
        "onnx": "onnxruntime",
        "openvino-ir": "openvino",
        "tflite": "litert",
        "rknn": "rknn",
        "hef": "hailo",
    }
    assert got["platforms"] == {
        "onnx": "onnxruntime_onnx",
        "openvino-ir": "openvino",
        "tflite": "tensorflow_lite",
        "rknn": "rknn",
        "hef": "hailo",
    }


@pytest.mark.parametrize("ci", [None, "false"])
def test_openvino_sends_no_usage_event_and_writes_nothing_home(
    models_dir: Path, tmp_path: Path, ci: str | None
) -> None:
    """`import openvino` sends a Google Analytics event from a forked child, and writes a
    client id under ~/intel, unless the user opted out or CI=true (openvino_telemetry). Through
    edged's backend it does neither: a fresh HOME stays empty, the telemetry package is not
    imported, and the process exits at once (that child, forked from a threaded process, once
    hung a daemon's exit for good)."""
    code = textwrap.dedent(f"""
        import sys
        from backends import LoadOptions, get_backend, probe_hardware
        from backends.model_info import inspect_model
        model = inspect_model({str(models_dir / "ppocr_cls.onnx")!r})
        backend = get_backend("openvino")
        found = backend.candidates(probe_hardware(), model)
        [cpu] = [c for c in found if c.key == "openvino:CPU:fp32"]
        backend.load(model, cpu, LoadOptions(threads=1, shapes={{"x": (1, 3, 48, 192)}})).close()
        print(sys.modules.get("openvino_telemetry", "absent"))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL")}
    env["HOME"] = str(tmp_path)
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"  # blocked, so its converter uses its own stub
    assert list(tmp_path.iterdir()) == [], "openvino wrote into HOME"
