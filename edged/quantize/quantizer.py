"""`edgectl quantize`: FP32 ONNX -> INT8 QDQ by measurement, per target backend.

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
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from backends import BackendError, Candidate, LoadOptions, ModelError, get_backend
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
from edged.selection.accuracy import Accuracy, accuracy
from edged.selection.bench import benchmark, pinned_thread

# Mixed precision: the FP32 set doubles from 1; give up past this share of the ranked compute
# nodes (the model is then mostly FP32 and FP32 itself wins anyway).
MAX_FP32_SHARE = 0.5
SENSITIVITY_SAMPLES = 8


# -- measuring --------------------------------------------------------------------------------


def load_session(
    model_path: Path, target: str, precision: str, threads: int | None, cpus: Sequence[int] | None
):
    model = inspect_model(model_path)
    candidate = Candidate(target, "CPU", precision)
    return get_backend(target).load(model, candidate, LoadOptions(threads=threads, cpus=cpus))


def input_specs(model_path: Path) -> list:
    """The model's inputs (names, dtypes, dynamic dims) as onnxruntime sees them."""
    model = inspect_model(model_path)
    if model.format != "onnx":
        raise ModelError(f"{model_path}: edgectl quantize takes an ONNX model, not {model.format}")
    try:
        session = load_session(model_path, "onnxruntime", "fp32", None, None)
    except BackendError as exc:
        raise ModelError(f"{model_path}: onnxruntime cannot load it ({exc})") from None
    try:
        return list(session.inputs)
    finally:
        session.close()


def run_all(session, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return [session.run(f) for f in feeds]


def sensitive_nodes(
    quantizer: Quantizer,
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
    import onnx

    graph = onnx.load(str(quantizer.prepared), load_external_data=False).graph
    nodes = [n.name for n in graph.node if n.op_type in COMPUTE_OPS and n.name]
    subset = replace(evaluation, feeds=evaluation.feeds[:SENSITIVITY_SAMPLES])
    scores = []
    for index, name in enumerate(nodes):
        if progress:
            progress("sensitivity", index, len(nodes))
        path = quantizer.quantize(
            Recipe(f"only-{index}", COMPUTE_OPS, only=(name,), scheme=scheme), keep=False
        )
        acc, _ = _check(path, "onnxruntime", subset, reference[:SENSITIVITY_SAMPLES], settings)
        path.unlink(missing_ok=True)
        # Ties on the gated figure (top-1 agreement over a few samples often is 1.0 for most
        # nodes) are broken by the cosine, then by graph order.
        scores.append((acc.score if acc else -1.0, acc.cosine if acc else -1.0, index, name))
    return [name for *_, name in sorted(scores)]


def data_producers(prepared: Path, nodes: Sequence[str]) -> list[str]:
    """The non-compute nodes producing the data input of `nodes`: in the full recipe they
    would quantize that tensor anyway, so an FP32 node takes its producer along."""
    import onnx

    graph = onnx.load(str(prepared), load_external_data=False).graph
    producer = {out: n for n in graph.node for out in n.output}
    by_name = {n.name: n for n in graph.node}
    extra = []
    for name in nodes:
        node = by_name.get(name)
        if node is None or not node.input:
            continue
        src = producer.get(node.input[0])
        if src is not None and src.op_type not in COMPUTE_OPS:
            extra.append(src.name)
    return extra


# -- the whole run ------------------------------------------------------------------------------


@dataclass
class Measurement:
    """Every recipe's attempts on every target and the FP32 p50 per target; the attempts'
    model files exist while the `measure` context is open."""

    attempts: list[Attempt]
    fp32_ms: dict[str, float]
    settings: Settings  # with the recipes resolved for this CPU
    cpu: str  # `HardwareFacts.isa_summary()` of the CPU that measured


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
    if inspect_model(model_path).format != "onnx":
        raise ModelError(f"{model_path}: edgectl quantize takes an ONNX model")
    from sysconf.hardware import probe

    hw = probe()
    if settings.recipes is None:
        settings = replace(settings, recipes=recipes_for(hw.int8_dot_product))
    with tempfile.TemporaryDirectory(prefix="edged-quantize-") as tmp:
        workdir = Path(tmp)
        prepared = prepare(model_path, workdir)
        quantizer = Quantizer(prepared, workdir, calibration, settings.method, progress)
        reference = _reference(model_path, evaluation, settings)
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
                            prepared,
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
        yield Measurement(attempts, fp32_ms, settings, hw.isa_summary())


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
        )


def _reference(
    model_path: Path, evaluation: Samples, settings: Settings
) -> list[dict[str, np.ndarray]]:
    """FP32 outputs on onnxruntime's CPU EP, the reference every INT8 run is held to."""
    try:
        session = load_session(model_path, "onnxruntime", "fp32", settings.threads, settings.cpus)
    except BackendError as exc:
        raise QuantizeError(
            f"{model_path}: the FP32 model does not load on onnxruntime ({exc})"
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
        return accuracy(reference, outputs), ""
    except BackendError as exc:
        return None, f"outputs differ in form on {target}: {exc}"


def _gate(
    quantizer: Quantizer,
    prepared: Path,
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
            fp32 += data_producers(prepared, fp32)
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
        runners: dict[str, Callable[[], Any]] = {"fp32": lambda s=fp32: s.run(feeds)}
        sessions = {}
        passing = [a for a in attempts if a.target == target and a.passed]
        try:
            for attempt in passing:
                sessions[attempt.recipe.label] = session = load_session(
                    attempt.path, target, "model", settings.threads, settings.cpus
                )
                runners[attempt.recipe.label] = lambda s=session: s.run(feeds)
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
