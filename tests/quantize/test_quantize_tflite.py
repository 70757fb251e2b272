"""Full-integer TFLite from MediaPipe's float detectors (the real face and palm models, the
fetched detector image sets): the graph edits the quantizer needs, the gate on LiteRT with
XNNPACK and the built-in kernels, the detector rule, mixed precision, the NPU form checks,
and bad input answered with exit 2 naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backends import tflite_edit
from backends.litert_backend import DELEGATES, form_problem
from backends.model_info import inspect_model, read_model_file
from backends.tflite_form import tflite_form
from edged.cli.main import main
from edged.quantize import tflite_graph
from edged.quantize.quantizer import load_session, run_all
from edged.quantize.recipes import Recipe
from edged.quantize.tflite_quantizer import RECIPES, TfliteQuantizer
from edged.selection.accuracy import ScoreMap, accuracy
from tests.conftest import FACE_MAX_DROP, FACE_SCORES, face_samples

FACE = "face_detection_short_range.tflite"
PALM = "palm_detection_lite.tflite"
FACE_ARGS = ["--resize", "128x128", "--mean", "0.5", "--std", "0.5", "--scores", FACE_SCORES]
QUICK = ["--runs", "20", "--time-budget", "2"]


def images(test_data: Path) -> list[str]:
    folder = test_data / "images"
    return [
        "--calibration",
        str(folder / "detector-calibration"),
        "--eval",
        str(folder / "detector-eval"),
    ]


# -- the graph edits ----------------------------------------------------------------------


def test_float16_folded_and_relus_fused_without_changing_the_answer(models_dir: Path) -> None:
    """MediaPipe's face detector: 74 float16 weights behind DEQUANTIZE become float32
    constants, 17 standalone RELUs fold into the ADD before them; LiteRT gives the same
    outputs for the edited graph as for the file."""
    original = read_model_file(models_dir / FACE)
    folded, count = tflite_graph.fold_float16(original)
    fused, relus = tflite_graph.fuse_activations(folded)
    assert (count, relus) == (74, 17)
    kinds = [kind for kind, _ in tflite_edit.op_types(fused)]
    assert "DEQUANTIZE" not in kinds and "RELU" not in kinds
    assert tflite_graph.fold_float16(fused) == (fused, 0)  # nothing left to fold

    from ai_edge_litert import interpreter

    x = np.random.default_rng(0).uniform(-1, 1, (1, 128, 128, 3)).astype(np.float32)
    outputs = []
    for data in (original, fused):
        it = interpreter.Interpreter(model_content=data)
        it.allocate_tensors()
        it.set_tensor(it.get_input_details()[0]["index"], x)
        it.invoke()
        outputs.append([it.get_tensor(d["index"]) for d in it.get_output_details()])
    for a, b in zip(*outputs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_mixed_precision_puts_the_named_ops_back_in_float(
    test_data: Path, models_dir: Path, tmp_path: Path
) -> None:
    """keep_float: the named convs compute in float32 from the float model's weights,
    between DEQUANTIZE and QUANTIZE; everything else stays int8, and the model still runs."""
    calibration, evaluation, _ = face_samples(test_data)
    quantizer = TfliteQuantizer(models_dir / FACE, tmp_path, calibration, "minmax", "float")
    ranked = quantizer.compute_nodes()  # named by their output (a fused RELU's, where one is)
    kinds = dict((n, k) for k, n in tflite_edit.op_types(quantizer.prepared.read_bytes()))
    assert len(ranked) == 37 and {kinds[n] for n in ranked} == {"CONV_2D", "DEPTHWISE_CONV_2D"}
    kept = tuple(ranked[:2])
    path = quantizer.quantize(Recipe("full", None, fp32_nodes=kept, scheme="s8s8"))
    data = path.read_bytes()
    model = tflite_edit.load(data)
    graph = model.subgraphs[0]
    float32 = tflite_edit.generated().TensorType.FLOAT32
    produced = {
        tflite_edit.tensor_name(graph.tensors[t]): graph.tensors[t].type
        for op in graph.operators
        for t in op.outputs
    }
    for name in kept:
        assert produced[f"{name}/float"] == float32  # computed in float ...
        assert produced[name] != float32  # ... and requantized for the int8 graph after it
    kinds = [kind for kind, _ in tflite_edit.op_types(data)]
    assert kinds.count("DEQUANTIZE") >= 2 and kinds.count("QUANTIZE") >= 2
    session = load_session(path, "litert:CPU", "model", None, None)
    outputs = run_all(session, evaluation.feeds[:2])
    assert all(np.all(np.isfinite(v)) for o in outputs for v in o.values())
    with pytest.raises(Exception, match="no op makes nope"):
        quantizer.quantize(Recipe("full", None, fp32_nodes=("nope",), scheme="s8s8"))


# -- the detector rule ----------------------------------------------------------------------


def test_score_map_rule_reads_detections_not_logits() -> None:
    """Background logits differ wildly and it does not matter; a missed face does."""
    rng = np.random.default_rng(1)
    boxes = rng.normal(size=(1, 8, 4))
    logits = np.full((1, 8, 1), -50.0)
    logits[0, 2, 0] = 3.0  # one detection, score 0.95
    ref = {"boxes": boxes, "scores": logits}
    noisy_background = {"boxes": boxes, "scores": np.where(logits < 0, -9.0, logits)}
    spec = ScoreMap("scores")
    assert accuracy([ref], [noisy_background], spec).score == pytest.approx(1.0)
    assert accuracy([ref], [noisy_background]).max_abs > 40  # what raw values would say
    missed = {"boxes": boxes, "scores": np.full((1, 8, 1), -50.0)}
    assert accuracy([ref], [missed], spec).score == pytest.approx(0.0, abs=1e-6)
    moved = {"boxes": -boxes, "scores": logits}  # same detection, box turned around
    assert accuracy([ref], [moved], spec).score < 0
    nothing = {"boxes": boxes, "scores": np.full((1, 8, 1), -50.0)}
    assert accuracy([nothing], [nothing], spec).score == 1.0  # neither detects: agree
    with pytest.raises(Exception, match="no output 'nope'"):
        accuracy([ref], [ref], ScoreMap("nope"))


# -- the gate, the CLI and the NPU targets -----------------------------------------------


@pytest.mark.slow
def test_face_becomes_full_integer_for_the_vx_npu(
    test_data: Path, models_dir: Path, tmp_path: Path, capsys
) -> None:
    """One command: the face detector becomes a full-integer model with int8 IO that passes
    the detection gate on LiteRT (XNNPACK and the built-in kernels) and is in the form the
    i.MX8M Plus VX delegate runs."""
    out = tmp_path / "face_int8.tflite"
    argv = ["quantize", str(models_dir / FACE), *images(test_data), *FACE_ARGS, *QUICK]
    argv += ["--target", "npu-vx", "--max-drop", str(FACE_MAX_DROP), "--output", str(out)]
    code = main([*argv, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["reason"]
    assert report["recipe"] == "full-s8s8" and report["io"] == "int8"
    assert report["accuracy"]["rule"].startswith("score-weighted agreement of classificators")
    assert report["accuracy"]["score"] >= 1 - FACE_MAX_DROP
    targets = {a["target"]: a for a in report["attempts"]}
    assert set(targets) == {"litert", "litert:CPU"} and all(a["passed"] for a in targets.values())
    assert any("clipped to +-10" in n for n in report["notes"])
    assert "NPU-VX: the model is in the form it runs" in report["notes"]
    form = tflite_form(out)
    assert form.full_integer and form.input_types == ("int8",)
    assert form.output_types == ("int8", "int8") and form.compiled_for is None
    for target in ("litert", "litert:CPU"):  # runs, fed float through its own scales
        _, evaluation, _ = face_samples(test_data)
        outputs = run_all(load_session(out, target, "model", None, None), evaluation.feeds[:3])
        assert outputs[0]["classificators"].dtype == np.float32


@pytest.mark.slow
def test_palm_is_quantized_and_the_report_says_why_it_is_kept_float(
    test_data: Path, models_dir: Path, tmp_path: Path, capsys
) -> None:
    """The palm detector's activations span thousands (minmax int8 makes false palms on
    these photos): every recipe, mixed precision included, fails the gate, the float model
    is written and the report names the best try (exit 1)."""
    out = tmp_path / "palm.tflite"
    few = tmp_path / "eval"  # 4 of the held-out photos: each try is quicker, none passes
    few.mkdir()
    for photo in sorted((test_data / "images" / "detector-eval").glob("*.png"))[:4]:
        (few / photo.name).write_bytes(photo.read_bytes())
    data = ["--calibration", str(test_data / "images" / "detector-calibration")]
    argv = ["quantize", str(models_dir / PALM), *data, "--eval", str(few), *QUICK]
    argv += ["--resize", "192x192", "--mean", "0.5", "--std", "0.5", "--scores", "Identity_1"]
    argv += ["--target", "litert", "--max-drop", "0.1", "--output", str(out), "--json"]
    code = main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["recipe"] == "fp32"
    assert "no INT8 recipe passes the accuracy gate" in report["reason"]
    mixed = [a for a in report["attempts"] if a["fp32_nodes"]]
    assert mixed, "mixed precision was not tried"
    assert all(a["accuracy"] and not a["passed"] for a in report["attempts"])
    assert inspect_model(out).sha256 == inspect_model(models_dir / PALM).sha256


def test_form_checks_for_each_npu(models_dir: Path, face_full_integer: dict[str, Path]) -> None:
    """What each delegate says about the float model and about the full-integer one."""
    by_name = {spec.name: spec for spec in DELEGATES}
    float_form = tflite_form(models_dir / FACE)
    int8_form = tflite_form(face_full_integer["int8"])
    assert "fp16 model" in form_problem(by_name["NPU-VX"], float_form)
    assert form_problem(by_name["NPU-VX"], int8_form) is None
    assert form_problem(by_name["NPU-Neutron"], int8_form) is None
    assert "full-integer but not Vela-compiled: edgectl compile MODEL --target ethos-u65-256" in (
        form_problem(by_name["NPU-EthosU"], int8_form)
    )
    assert "not Vela-compiled and not full-integer" in form_problem(
        by_name["NPU-EthosU"], float_form
    )
    edgetpu = form_problem(by_name["EdgeTPU"], int8_form)
    assert "edgetpu_compiler" in edgetpu and "not on the package registries" in edgetpu


# -- bad input -----------------------------------------------------------------------------


def test_bad_input_exits_2_naming_the_file(
    test_data: Path, models_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out.tflite"
    base = ["quantize", str(models_dir / FACE), *images(test_data), "--output", str(out)]

    def error(argv: list[str]) -> str:
        assert main(argv) == 2
        assert not out.exists()
        return capsys.readouterr().err

    # calibration arrays of the wrong shape (NCHW for an NHWC model)
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, input=np.zeros((4, 3, 128, 128), np.float32))
    argv = ["quantize", str(models_dir / FACE), "--calibration", str(wrong)]
    err = error([*argv, "--output", str(out)])
    assert str(wrong) in err and "shape" in err
    assert "minmax" in error([*base, *FACE_ARGS, "--method", "entropy"])
    assert "for a .tflite use auto, litert" in error([*base, "--target", "onnxruntime"])
    onnx = ["quantize", str(models_dir / "ppocr_cls.onnx"), *images(test_data)]
    assert "--io is for a .tflite" in error([*onnx, "--io", "int8", "--output", str(out)])
    corrupt = tmp_path / "corrupt.tflite"
    corrupt.write_bytes(read_model_file(models_dir / FACE)[:5000])
    err = error(["quantize", str(corrupt), *images(test_data), "--output", str(out)])
    assert str(corrupt) in err


def test_already_full_integer_is_refused(
    test_data: Path, face_full_integer: dict[str, Path], tmp_path: Path, capsys
) -> None:
    out = tmp_path / "again.tflite"
    argv = ["quantize", str(face_full_integer["float"]), *images(test_data), *FACE_ARGS]
    assert main([*argv, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already a full-integer model" in err and str(face_full_integer["float"]) in err
    assert not out.exists()


def test_the_recipes_are_full_integer_only() -> None:
    assert [r.label for r in RECIPES] == ["full-s8s8"]


@pytest.mark.slow
def test_one_command_from_float_to_ethos_u65(
    test_data: Path, models_dir: Path, tmp_path: Path, capsys
) -> None:
    """The issue's whole path: the float face detector in, a full-integer model that passes
    the gate and its Vela model for the i.MX93's Ethos-U65 out, every operator on the NPU,
    Vela's estimate in the report and inside the compiled model."""
    from backends.vela import is_vela_compiled, read_report

    out = tmp_path / "face_int8.tflite"
    argv = ["quantize", str(models_dir / FACE), *images(test_data), *FACE_ARGS, *QUICK]
    argv += ["--target", "ethos-u65-256", "--max-drop", str(FACE_MAX_DROP)]
    assert main([*argv, "--output", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    compiled = report["compiled"]
    assert compiled["accelerator"].lower().replace("_", "-") == "ethos-u65-256"
    assert compiled["cpu_ops"] == [] and compiled["npu_ops"] > 0
    assert compiled["estimate"]["inference_ms"] > 0 and compiled["kind"] == "estimate"
    vela_model = tmp_path / "face_int8_vela.tflite"
    assert compiled["output"] == str(vela_model) and is_vela_compiled(vela_model)
    assert not is_vela_compiled(out) and tflite_form(out).full_integer
    embedded = read_report(vela_model)
    assert embedded is not None and embedded.estimate == compiled["estimate"]


def test_ethos_u_target_checked_before_any_work(
    test_data: Path, models_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "face.tflite"
    argv = ["quantize", str(models_dir / FACE), *images(test_data), "--output", str(out)]
    assert main([*argv, "--target", "ethos-u99-1"]) == 2
    assert "Vela compiles for ethos-u55-32" in capsys.readouterr().err
    assert not out.exists()


def test_selection_judges_a_detector_variant_on_detections(
    models_dir: Path, face_full_integer: dict[str, Path], tmp_path: Path
) -> None:
    """The full-integer face model (float IO) as a variant of its float original: on raw
    outputs it fails the default budget, judged as a detector (`scores`, per model in the
    config, --scores for edgectl backends) it is measured and may be picked."""
    from backends import probe_hardware
    from edged.selection.policy import Policy
    from edged.selection.select import select

    hw = probe_hardware()
    quick = {"runs": 20, "time_budget_s": 1.0, "backend": "litert:XNNPACK", "max_drop": 0.05}
    variant = [face_full_integer["float"]]
    raw = select(models_dir / FACE, hw, Policy(**quick), tmp_path, variants=variant)
    as_detector = select(
        models_dir / FACE, hw, Policy(**quick, scores=FACE_SCORES), tmp_path, variants=variant
    )
    status = {
        name: {Path(e.variant).name: e.status for e in sel.evidence if e.status != "unavailable"}
        for name, sel in (("raw", raw), ("detector", as_detector))
    }
    int8 = face_full_integer["float"].name
    assert status["raw"][int8] == "rejected"
    assert status["detector"][int8] in ("passed", "selected")
    assert raw.cache_key != as_detector.cache_key  # the rule is part of the decision's cache key


def test_config_scores_must_be_an_output(models_dir: Path, tmp_path: Path) -> None:
    from edged.config import ConfigError, parse_config

    model = models_dir / FACE
    good = f'[[models]]\nname = "face"\npath = "{model}"\nscores = "classificators"\n'
    assert parse_config(good, tmp_path / "edged.toml").models[0].scores == "classificators"
    with pytest.raises(ConfigError, match=r"models\[0\]\.scores.*'boxes' is not an output"):
        parse_config(good.replace("classificators", "boxes"), tmp_path / "edged.toml")


def test_float_io_rounds_as_litert_quantize_does() -> None:
    """Half away from zero (LiteRT's QUANTIZE), not numpy's half to even; any float dtype."""
    from backends.base import FloatIO
    from backends.tensors import TensorSpec

    class Int8Session:  # an int8 model that returns its input: the conversions alone
        def __init__(self) -> None:
            self.candidate = None
            self.inputs = [TensorSpec("x", "int8", (4,))]
            self.outputs = [TensorSpec("y", "int8", (4,))]
            self.io_quantization = {"x": (0.5, 0), "y": (0.5, 0)}

        def run(self, feeds):
            return {"y": feeds["x"]}

    session = FloatIO(Int8Session())
    out = session.run({"x": np.array([0.25, -0.25, 0.75, 100.0], np.float64)})
    assert out["y"].tolist() == [0.5, -0.5, 1.0, 63.5]  # 0.5 -> 1, -0.5 -> -1, clipped at 127


def test_clipped_ranges_stay_ranges(test_data: Path, models_dir: Path, tmp_path: Path) -> None:
    """A score output calibrated wholly below -10 (no detection in any photo) is clipped
    to a range that is still one: min <= max, both within +-10."""
    calibration, _, _ = face_samples(test_data)
    quantizer = TfliteQuantizer(models_dir / FACE, tmp_path, calibration, "minmax", "float")
    data, clipped = tflite_graph.clip_ranges(quantizer.calibrated(), FACE_SCORES, -10.0, -20.0)
    assert FACE_SCORES in clipped
    graph = tflite_edit.load(data).subgraphs[0]
    for tensor in graph.tensors:
        if tflite_edit.tensor_name(tensor) in clipped:
            q = tensor.quantization
            assert np.all(q.min <= q.max) and np.all(q.min >= -20.0)


def test_scores_must_name_an_output(test_data: Path, models_dir: Path, tmp_path, capsys) -> None:
    out = tmp_path / "out.tflite"
    argv = ["quantize", str(models_dir / FACE), *images(test_data), "--output", str(out)]
    assert main([*argv, "--scores", "boxes"]) == 2
    assert "--scores boxes: not an output of" in capsys.readouterr().err
    assert not out.exists()
