"""`edgectl quantize`: FP32 ONNX -> INT8 QDQ, and float TFLite -> full-integer TFLite, by
measurement, per target backend.

Steps: the model is upgraded to opset 13 (per-channel QDQ needs it) and pre-processed
(ONNX shape inference and graph optimisation, onnxruntime.quantization's `quant_pre_process`);
activation ranges are calibrated once on the calibration set (cached, so every recipe and
every mixed-precision retry reuses them); each candidate recipe — full QDQ and Conv/MatMul
only — is quantized (static, per-channel weights; U8S8 on CPUs with an 8-bit dot product,
else 7-bit-weight U8S8 and U8U8, see `recipes_for`), run on the target backend over the
evaluation set and compared with the FP32 model (`edged.selection.accuracy`: cosine, or top-1
agreement for classifiers). A recipe that fails the gate is retried with its most sensitive nodes
kept in FP32: compute nodes (Conv, MatMul, Gemm) ranked by the output error when each alone is
quantized, the FP32 set doubling until the gate passes or half of them are FP32. Only
compute nodes are ranked: on PP-OCRv4 det the full recipe's loss sits in its Add/Mul/Div
nodes, which this does not rescue (the Conv/MatMul-only recipe then wins; see
docs/BENCHMARKS.md). The recipes that pass are timed against the FP32 model on the
target with the selection's interleaved micro-benchmark; the fastest that beats FP32 is
written, else FP32 is kept and the report says so.

A float .tflite goes the same way through LiteRT's quantizer (`tflite_quantizer`: int8
weights per channel, int8 activations, int8/uint8/float inputs and outputs), gated on LiteRT
with XNNPACK and with the built-in kernels against the float model on the built-in kernels;
mixed precision keeps the most sensitive conv/depthwise/fully-connected ops in float. For an
NPU target (`Settings.require_int8`) the passing full-integer model is written whether or not
it beats float on this CPU: the NPU runs nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from backends import (
    BackendError,
    Candidate,
    LoadOptions,
    ModelError,
    get_backend,
    quantize_targets,
    target_device,
)
from backends.base import float_io
from backends.model_info import inspect_model
from edged.quantize.calibration import Samples
from edged.quantize.calibration_spec import CalibrationError
from edged.quantize.defaults import METHODS
from edged.quantize.recipes import (
    COMPUTE_OPS,
    Progress,
    QuantizeError,
    Quantizer,
    Recipe,
    Settings,
    prepare,
    recipes_for,
)
from edged.quantize.report import Attempt, Report, decide
from edged.quantize.tflite_quantizer import LOGIT_CLIP, TfliteQuantizer
from edged.quantize.tflite_quantizer import RECIPES as TFLITE_RECIPES
from edged.selection.accuracy import Accuracy, accuracy
from edged.selection.bench import benchmark, pinned_thread

# Mixed precision: the FP32 set doubles from 1; give up past this share of the ranked compute
# nodes (the model is then mostly FP32 and FP32 itself wins anyway).
MAX_FP32_SHARE = 0.5
SENSITIVITY_SAMPLES = 8


# -- measuring --------------------------------------------------------------------------------


# Where each format's float reference runs, and so where its inputs are read.
REFERENCE_TARGET = {"onnx": Quantizer.reference_target, "tflite": TfliteQuantizer.reference_target}


def load_session(
    model_path: Path, target: str, precision: str, threads: int | None, cpus: Sequence[int] | None
):
    """`model_path` loaded on `target`, taking and giving float32 (a full-integer TFLite with
    int8 IO is fed through its own scales, `float_io`)."""
    model = inspect_model(model_path)
    backend, device = target_device(target)
    candidate = Candidate(backend, device, precision)
    options = LoadOptions(threads=threads, cpus=cpus)
    return float_io(get_backend(backend).load(model, candidate, options))


def input_specs(model_path: Path) -> list:
    """The model's inputs (names, dtypes, dynamic dims) as its reference runtime sees them."""
    model = inspect_model(model_path)
    if model.format not in REFERENCE_TARGET:
        raise ModelError(
            f"{model_path}: edgectl quantize takes an ONNX or TFLite model, not {model.format}"
        )
    target = REFERENCE_TARGET[model.format]
    try:
        session = load_session(model_path, target, "fp32", None, None)
    except BackendError as exc:
        raise ModelError(f"{model_path}: {target} cannot load it ({exc})") from None
    try:
        return list(session.inputs)
    finally:
        session.close()


def run_all(session, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return [session.run(f) for f in feeds]


def sensitive_nodes(
    quantizer: Quantizer | TfliteQuantizer,
    evaluation: Samples,
    reference,
    settings: Settings,
    progress: Progress | None = None,
    scheme: str = "u8s8",
) -> list[str]:
    """The compute nodes (Conv, MatMul, Gemm...) of the float graph, most sensitive first.

    A node's sensitivity is the error at the model's outputs when that node alone is
    quantized (its weights and input activations; the ranges come from the calibration
    cache) and everything else stays FP32: measured on onnxruntime's CPU EP over a few
    evaluation samples. Errors in a chain accumulate, so a node's own contribution cannot be
    read from the fully quantized model's intermediate tensors (each is already buried in
    the noise of every node before it); quantizing one node at a time isolates it. The
    weights are where INT8 loses most (depthwise and early layers with wide per-channel
    ranges), and these nodes are the ones worth keeping FP32.
    """
    nodes = quantizer.compute_nodes()
    subset = replace(evaluation, feeds=evaluation.feeds[:SENSITIVITY_SAMPLES])
    scores = []
    for index, name in enumerate(nodes):
        if progress:
            progress("sensitivity", index, len(nodes))
        path = quantizer.quantize(
            Recipe(f"only-{index}", COMPUTE_OPS, only=(name,), scheme=scheme), keep=False
        )
        acc, _ = _check(
            path, quantizer.reference_target, subset, reference[:SENSITIVITY_SAMPLES], settings
        )
        path.unlink(missing_ok=True)
        # Ties on the gated figure (top-1 agreement over a few samples often is 1.0 for most
        # nodes) are broken by the cosine, then by graph order.
        scores.append((acc.score if acc else -1.0, acc.cosine if acc else -1.0, index, name))
    return [name for *_, name in sorted(scores)]


# -- the whole run ------------------------------------------------------------------------------


@dataclass
class Measurement:
    """Every recipe's attempts on every target and the FP32 p50 per target; the attempts'
    model files exist while the `measure` context is open."""

    attempts: list[Attempt]
    fp32_ms: dict[str, float]
    settings: Settings  # with the recipes resolved for this CPU
    cpu: str  # `HardwareFacts.isa_summary()` of the CPU that measured
    notes: list[str]  # what the quantizer did beyond the recipe (e.g. clipped ranges)


@contextlib.contextmanager
def measure(
    model_path: Path,
    calibration: Samples,
    evaluation: Samples,
    settings: Settings,
    progress: Progress | None = None,
) -> Iterator[Measurement]:
    """Quantize with every recipe, gate each on every target (mixed precision where a
    recipe fails) and time the passing ones against FP32; the files live until exit."""
    if settings.method not in METHODS:
        raise QuantizeError(
            f"calibration method {settings.method!r}: use one of {', '.join(METHODS)}"
        )
    model_path = Path(model_path)
    fmt = inspect_model(model_path).format
    if fmt not in REFERENCE_TARGET:
        raise ModelError(f"{model_path}: edgectl quantize takes an ONNX or TFLite model")
    gates = quantize_targets(fmt)
    settings = replace(settings, targets=settings.targets or gates)
    wrong = [t for t in settings.targets if t not in gates]
    if wrong:
        raise QuantizeError(f"{model_path}: a {fmt} model cannot be gated on {', '.join(wrong)}")
    from backends import probe_hardware

    hw = probe_hardware()
    if settings.recipes is None:
        recipes = TFLITE_RECIPES if fmt == "tflite" else recipes_for(hw.int8_dot_product)
        settings = replace(settings, recipes=recipes)
    with tempfile.TemporaryDirectory(prefix="edged-quantize-") as tmp:
        workdir = Path(tmp)
        quantizer: Quantizer | TfliteQuantizer
        if fmt == "tflite":
            quantizer = TfliteQuantizer(
                model_path,
                workdir,
                calibration,
                settings.method,
                settings.io or "float",
                progress,
                settings.scores,
            )
        else:
            prepared = prepare(model_path, workdir)
            quantizer = Quantizer(prepared, workdir, calibration, settings.method, progress)
        reference = _reference(model_path, evaluation, settings, quantizer.reference_target)
        attempts: list[Attempt] = []
        fp32_sessions: dict[str, Any] = {}
        ranking: list[str] = []  # compute nodes, most sensitive first (filled on demand)
        try:
            for target in settings.targets:
                try:
                    fp32_sessions[target] = load_session(
                        model_path, target, "fp32", settings.threads, settings.cpus
                    )
                except (BackendError, ImportError) as exc:
                    attempts.append(
                        Attempt(
                            target,
                            Recipe("fp32", ()),
                            model_path,
                            error=f"FP32 model does not load: {exc}",
                        )
                    )
                    continue
                for recipe in settings.recipes or ():
                    attempts.extend(
                        _gate(
                            quantizer,
                            target,
                            recipe,
                            evaluation,
                            reference,
                            settings,
                            ranking,
                            progress,
                        )
                    )
            fp32_ms = _time(attempts, fp32_sessions, evaluation, settings, progress)
        finally:
            for session in fp32_sessions.values():
                session.close()
        notes = []
        clipped = getattr(quantizer, "clipped", None)
        if clipped:
            notes.append(
                f"score logits: the calibrated ranges of {', '.join(clipped)} clipped to "
                f"+-{LOGIT_CLIP:g}"
            )
        yield Measurement(attempts, fp32_ms, settings, hw.isa_summary(), notes)


def quantize_model(
    model_path: Path,
    output: Path,
    calibration: Samples,
    evaluation: Samples,
    settings: Settings,
    warnings: Sequence[str] = (),
    progress: Progress | None = None,
) -> Report:
    """Quantize, gate, time and write `output`; the report says what was written and why."""
    with measure(model_path, calibration, evaluation, settings, progress) as m:
        return decide(
            Path(model_path),
            output,
            m.attempts,
            m.fp32_ms,
            calibration,
            evaluation,
            m.settings,
            list(warnings),
            m.cpu,
            m.notes,
        )


def _reference(
    model_path: Path, evaluation: Samples, settings: Settings, target: str
) -> list[dict[str, np.ndarray]]:
    """FP32 outputs on the format's reference CPU runtime (onnxruntime's CPU EP, LiteRT's
    built-in kernels), the reference every INT8 run is held to."""
    try:
        session = load_session(model_path, target, "fp32", settings.threads, settings.cpus)
    except BackendError as exc:
        raise QuantizeError(
            f"{model_path}: the FP32 model does not load on {target} ({exc})"
        ) from None
    try:
        with pinned_thread(settings.cpus):
            return run_all(session, evaluation.feeds)
    except BackendError as exc:
        raise CalibrationError(f"evaluation data does not fit the model: {exc}") from None
    finally:
        session.close()


def _check(
    path: Path, target: str, evaluation: Samples, reference, settings: Settings
) -> tuple[Accuracy | None, str]:
    try:
        session = load_session(path, target, "model", settings.threads, settings.cpus)
    except (BackendError, ModelError, ImportError) as exc:
        return None, f"does not load on {target}: {exc}"
    try:
        with pinned_thread(settings.cpus):
            outputs = run_all(session, evaluation.feeds)
    except BackendError as exc:
        return None, f"fails on {target}: {exc}"
    finally:
        session.close()
    try:
        return accuracy(reference, outputs, settings.scores), ""
    except BackendError as exc:
        return None, f"outputs differ in form on {target}: {exc}"


def _gate(
    quantizer: Quantizer | TfliteQuantizer,
    target: str,
    recipe: Recipe,
    evaluation: Samples,
    reference,
    settings: Settings,
    ranking: list[str],
    progress: Progress | None,
) -> list[Attempt]:
    """Quantize with `recipe`, check it on `target`; on a failed gate keep the most
    sensitive compute nodes in FP32, doubling their number until it passes or half of them
    are FP32. Every try is returned (the report shows them all); at most the last passes."""
    if progress:
        progress(f"gate {target} {recipe.name}", 0, 1)
    path = quantizer.quantize(recipe)
    acc, error = _check(path, target, evaluation, reference, settings)
    attempt = Attempt(target, recipe, path, acc, bool(acc and acc.passes(settings.max_drop)), error)
    tries = [attempt]
    if attempt.passed or acc is None:
        return tries
    if not ranking:  # measured once, shared by every recipe and target
        ranking.extend(
            sensitive_nodes(quantizer, evaluation, reference, settings, progress, recipe.scheme)
        )
    limit = max(1, int(len(ranking) * MAX_FP32_SHARE))
    count = 1
    while count <= limit:
        if progress:
            progress(f"mixed precision {target} {recipe.name}", count, limit)
        fp32 = list(ranking[:count])
        if recipe.op_types is None:
            fp32 += quantizer.data_producers(fp32)
        trial_recipe = replace(recipe, fp32_nodes=tuple(dict.fromkeys(fp32)))
        trial_path = quantizer.quantize(trial_recipe)
        trial_acc, trial_error = _check(trial_path, target, evaluation, reference, settings)
        trial = Attempt(
            target,
            trial_recipe,
            trial_path,
            trial_acc,
            bool(trial_acc and trial_acc.passes(settings.max_drop)),
            trial_error,
        )
        tries.append(trial)
        if trial.passed:
            break
        count *= 2
    return tries


def _time(
    attempts: list[Attempt],
    fp32_sessions: Mapping[str, Any],
    evaluation: Samples,
    settings: Settings,
    progress: Progress | None,
) -> dict[str, float]:
    """Median latency of FP32 and of every passing recipe, per target, interleaved; sets
    each passing attempt's p50 and speedup, returns FP32's p50 per target."""
    feeds = evaluation.feeds[0]
    fp32_ms = {}
    for target, fp32 in fp32_sessions.items():
        runners: dict[str, Callable[[], Any]] = {"fp32": functools.partial(fp32.run, feeds)}
        sessions = {}
        passing = [a for a in attempts if a.target == target and a.passed]
        try:
            for attempt in passing:
                sessions[attempt.recipe.label] = session = load_session(
                    attempt.path, target, "model", settings.threads, settings.cpus
                )
                runners[attempt.recipe.label] = functools.partial(session.run, feeds)
            total = settings.runs * len(runners)
            done = [0]

            def tick(
                n: int, target: str = target, total: int = total, done: list[int] = done
            ) -> None:
                done[0] += n
                if progress:
                    progress(f"benchmark {target}", done[0], total)

            with pinned_thread(settings.cpus):
                stats = benchmark(
                    runners,
                    settings.runs,
                    warmup=5,
                    time_budget_s=settings.time_budget_s,
                    progress=tick,
                )
        finally:
            for session in sessions.values():
                session.close()
        fp32_ms[target] = stats["fp32"].p50_ms
        for attempt in passing:
            attempt.p50_ms = stats[attempt.recipe.label].p50_ms
            attempt.speedup = round(stats["fp32"].p50_ms / attempt.p50_ms, 3)
    return fp32_ms
