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
import inspect
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from backends import BackendError, Candidate, LoadOptions, ModelError, get_backend
from backends.model_info import inspect_model
from edged.quantize.calibration import CalibrationError, Samples
from edged.selection.accuracy import DEFAULT_MAX_DROP, Accuracy, accuracy
from edged.selection.bench import benchmark, pinned_thread

Progress = Callable[[str, int, int], None]

TARGETS = ("onnxruntime", "openvino")
METHODS = ("minmax", "entropy", "percentile")
# INT8 must be at least this much faster (median) than FP32 to be worth its accuracy cost;
# the same 2 % band the backend selection treats as a tie.
MIN_SPEEDUP = 1.02
# Mixed precision: the FP32 set doubles from 1; give up past this share of the ranked compute
# nodes (the model is then mostly FP32 and FP32 itself wins anyway).
MAX_FP32_SHARE = 0.5
SENSITIVITY_SAMPLES = 8
# Op types that carry the arithmetic; "conv-matmul" quantizes only these.
COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


class QuantizeError(RuntimeError):
    """The model cannot be quantized; the message says at which step and why."""


# INT8 schemes (activations, weights): U8S8 is what VNNI/AMX/Arm dotprod kernels want; on
# x86 without VNNI, onnxruntime's U8S8 kernels multiply pairs with vpmaddubsw, whose int16
# sums saturate (its quantization guide: reduce_range, i.e. 7-bit weights, or U8U8 there).
SCHEMES = {"u8s8": ("QUInt8", "QInt8", False), "u8s8-rr": ("QUInt8", "QInt8", True),
           "u8u8": ("QUInt8", "QUInt8", False)}
NO_DOT_PRODUCT_SCHEMES = ("u8s8-rr", "u8u8")


@dataclass(frozen=True)
class Recipe:
    name: str
    op_types: tuple[str, ...] | None  # None: every op type onnxruntime can quantize
    fp32_nodes: tuple[str, ...] = ()
    only: tuple[str, ...] = ()  # quantize just these nodes (sensitivity probes)
    scheme: str = "u8s8"  # a key of SCHEMES

    @property
    def label(self) -> str:
        base = self.name if self.scheme == "u8s8" else f"{self.name}-{self.scheme}"
        return f"{base}+{len(self.fp32_nodes)}fp32" if self.fp32_nodes else base


BASE_RECIPES = (Recipe("full", None), Recipe("conv-matmul", COMPUTE_OPS))


def recipes_for(int8_dot_product: bool) -> tuple[Recipe, ...]:
    """The recipes worth trying on this CPU: U8S8 where it has an 8-bit dot product; where
    it has none, 7-bit-weight U8S8 and U8U8 instead (plain U8S8 saturates there, and a
    model that passes on such a CPU passes on every other as well)."""
    if int8_dot_product:
        return BASE_RECIPES
    return tuple(replace(r, scheme=s) for s in NO_DOT_PRODUCT_SCHEMES for r in BASE_RECIPES)


@dataclass
class Attempt:
    """One recipe quantized and checked on one target."""

    target: str
    recipe: Recipe
    path: Path
    accuracy: Accuracy | None = None
    passed: bool = False
    error: str = ""
    p50_ms: float | None = None
    speedup: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "recipe": self.recipe.label,
                "scheme": self.recipe.scheme,
                "fp32_nodes": list(self.recipe.fp32_nodes),
                "accuracy": self.accuracy.to_dict() if self.accuracy else None,
                "passed": self.passed, "error": self.error or None,
                "p50_ms": self.p50_ms, "speedup": self.speedup}


@dataclass
class Report:
    output: str
    target: str
    recipe: str  # the recipe written, or "fp32" when no INT8 recipe passed and beat FP32
    fp32_nodes: list[str]
    accuracy: dict[str, Any] | None
    speedup: float | None
    warnings: list[str]
    samples: dict[str, int]
    method: str
    max_drop: float
    fp32_ms: dict[str, float] = field(default_factory=dict)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    cpu: str = ""  # the ISA the recipes were chosen for and timed on (`isa_summary`)

    @property
    def int8(self) -> bool:
        return self.recipe != "fp32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- preparation and quantization -----------------------------------------------------------

def prepare(model_path: Path, workdir: Path) -> Path:
    """Opset 13 or newer, shapes inferred and the graph optimised: what quantize_static
    wants. Returns the prepared model's path in `workdir`."""
    import onnx
    from onnx import version_converter
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        model = onnx.load(str(model_path))
    except Exception as exc:  # onnx raises DecodeError, ValueError, OSError...
        raise ModelError(f"{model_path}: not a readable ONNX model ({exc})") from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        # QDQ with per-channel axes needs opset 13; on 11/12 the quantized model is invalid.
        try:
            model = version_converter.convert_version(model, 13)
        except Exception as exc:
            raise QuantizeError(f"{model_path}: cannot upgrade opset {opset} to 13 ({exc})"
                                ) from None
    staged = workdir / "opset13.onnx"
    onnx.save(model, str(staged))
    prepared = workdir / "prepared.onnx"
    # chdir: the pre-processing may leave temporary models in the working folder.
    # Symbolic shape inference gives up on dynamic spatial dims ("Incomplete symbolic shape
    # inference"); ONNX shape inference plus optimisation are what the quantizer needs.
    with contextlib.chdir(workdir):
        try:
            quant_pre_process(str(staged), str(prepared), skip_symbolic_shape=True)
        except Exception as exc:
            raise QuantizeError(f"{model_path}: shape inference / pre-processing failed "
                                f"({exc})") from None
    return prepared


class _Reader:
    """A CalibrationDataReader over in-memory feeds (subclassed lazily: importing
    onnxruntime.quantization costs ~1 s and the CLI's other commands never need it)."""

    @staticmethod
    def make(feeds: Sequence[Mapping[str, np.ndarray]], progress: Progress | None = None,
             phase: str = "calibrate"):
        from onnxruntime.quantization import CalibrationDataReader

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.index = 0

            def get_next(self):
                if self.index >= len(feeds):
                    return None
                if progress:
                    progress(phase, self.index, len(feeds))
                self.index += 1
                return dict(feeds[self.index - 1])

            def __len__(self) -> int:
                return len(feeds)

        return Reader()


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    return {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile}[name]


class Quantizer:
    """Quantizes the prepared model with any recipe, calibrating only once when the
    installed onnxruntime can cache ranges (`calibration_cache_path`, 1.2x+)."""

    def __init__(self, prepared: Path, workdir: Path, calibration: Samples, method: str,
                 progress: Progress | None = None) -> None:
        self.prepared = prepared
        self.workdir = workdir
        self.calibration = calibration
        self.method = method
        self.progress = progress
        self.cache = workdir / f"ranges-{method}.json"
        from onnxruntime.quantization import quantize_static

        self._can_cache = "calibration_cache_path" in inspect.signature(quantize_static
                                                                        ).parameters

    def quantize(self, recipe: Recipe, keep: bool = True) -> Path:
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

        activation, weight, reduce_range = SCHEMES[recipe.scheme]
        out = self.workdir / f"{recipe.label}.onnx"
        if keep and out.exists():
            return out
        kwargs: dict[str, Any] = {}
        if self._can_cache:
            kwargs["calibration_cache_path"] = str(self.cache)
        if self.method == "percentile":
            kwargs["extra_options"] = {"CalibPercentile": 99.99}
        # Ranges are calibrated for every tensor the first time (op_types None); a recipe
        # that quantizes fewer op types reads the subset it needs from the cache.
        if self._can_cache and not self.cache.exists() and recipe.op_types is not None:
            self.quantize(Recipe("full", None))
        reader = _Reader.make(self.calibration.feeds, self.progress)
        # The Entropy/Percentile calibrators print() their progress: keep stdout for --json.
        with contextlib.chdir(self.workdir), contextlib.redirect_stdout(sys.stderr):
            try:
                quantize_static(
                    str(self.prepared), str(out), reader,
                    quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=getattr(QuantType, activation),
                    weight_type=getattr(QuantType, weight), reduce_range=reduce_range,
                    op_types_to_quantize=list(recipe.op_types) if recipe.op_types else None,
                    nodes_to_quantize=list(recipe.only) or None,
                    nodes_to_exclude=list(recipe.fp32_nodes),
                    calibrate_method=_method(self.method), **kwargs)
            except Exception as exc:
                out.unlink(missing_ok=True)
                raise QuantizeError(f"quantizing with recipe {recipe.label} failed: {exc}"
                                    ) from None
        return out


# -- measuring --------------------------------------------------------------------------------

def load_session(model_path: Path, target: str, precision: str, threads: int | None,
                 cpus: Sequence[int] | None):
    model = inspect_model(model_path)
    candidate = Candidate(target, "CPU", precision)
    return get_backend(target).load(model, candidate, LoadOptions(threads=threads, cpus=cpus))


def input_specs(model_path: Path) -> list:
    """The model's inputs (names, dtypes, dynamic dims) as onnxruntime sees them."""
    model = inspect_model(model_path)
    if model.format != "onnx":
        raise ModelError(f"{model_path}: edgectl quantize takes an ONNX model, not "
                         f"{model.format}")
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


def sensitive_nodes(quantizer: Quantizer, evaluation: Samples, reference, settings: Settings,
                    progress: Progress | None = None, scheme: str = "u8s8") -> list[str]:
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
        path = quantizer.quantize(Recipe(f"only-{index}", COMPUTE_OPS, only=(name,),
                                         scheme=scheme), keep=False)
        acc, _ = _check(path, "onnxruntime", subset, reference[:SENSITIVITY_SAMPLES],
                        settings)
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

@dataclass(frozen=True)
class Settings:
    targets: tuple[str, ...] = TARGETS
    method: str = "minmax"
    max_drop: float = DEFAULT_MAX_DROP
    threads: int | None = None
    cpus: Sequence[int] | None = None
    runs: int = 200
    time_budget_s: float = 20.0
    recipes: tuple[Recipe, ...] | None = None  # None: `recipes_for` this machine's CPU


@dataclass
class Measurement:
    """Every recipe's attempts on every target and the FP32 p50 per target; the attempts'
    model files exist while the `measure` context is open."""

    attempts: list[Attempt]
    fp32_ms: dict[str, float]
    settings: Settings  # with the recipes resolved for this CPU
    cpu: str  # `HardwareFacts.isa_summary()` of the CPU that measured


@contextlib.contextmanager
def measure(model_path: Path, calibration: Samples, evaluation: Samples, settings: Settings,
            progress: Progress | None = None) -> Iterator[Measurement]:
    """Quantize with every recipe, gate each on every target (mixed precision where a
    recipe fails) and time the passing ones against FP32; the files live until exit."""
    if settings.method not in METHODS:
        raise QuantizeError(f"calibration method {settings.method!r}: use one of "
                            f"{', '.join(METHODS)}")
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
                    fp32_sessions[target] = load_session(model_path, target, "fp32",
                                                         settings.threads, settings.cpus)
                except (BackendError, ImportError) as exc:
                    attempts.append(Attempt(target, Recipe("fp32", ()), model_path,
                                            error=f"FP32 model does not load: {exc}"))
                    continue
                for recipe in settings.recipes or ():
                    attempts.extend(_gate(quantizer, prepared, target, recipe, evaluation,
                                          reference, settings, ranking, progress))
            fp32_ms = _time(attempts, fp32_sessions, evaluation, settings, progress)
        finally:
            for session in fp32_sessions.values():
                session.close()
        yield Measurement(attempts, fp32_ms, settings, hw.isa_summary())


def quantize_model(model_path: Path, output: Path, calibration: Samples, evaluation: Samples,
                   settings: Settings, warnings: Sequence[str] = (),
                   progress: Progress | None = None) -> Report:
    """Quantize, gate, time and write `output`; the report says what was written and why."""
    with measure(model_path, calibration, evaluation, settings, progress) as m:
        return _decide(Path(model_path), output, m.attempts, m.fp32_ms, calibration,
                       evaluation, m.settings, list(warnings), m.cpu)


def _reference(model_path: Path, evaluation: Samples, settings: Settings
               ) -> list[dict[str, np.ndarray]]:
    """FP32 outputs on onnxruntime's CPU EP, the reference every INT8 run is held to."""
    try:
        session = load_session(model_path, "onnxruntime", "fp32", settings.threads,
                               settings.cpus)
    except BackendError as exc:
        raise QuantizeError(f"{model_path}: the FP32 model does not load on onnxruntime "
                            f"({exc})") from None
    try:
        with pinned_thread(settings.cpus):
            return run_all(session, evaluation.feeds)
    except BackendError as exc:
        raise CalibrationError(f"evaluation data does not fit the model: {exc}") from None
    finally:
        session.close()


def _check(path: Path, target: str, evaluation: Samples, reference, settings: Settings
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


def _gate(quantizer: Quantizer, prepared: Path, target: str, recipe: Recipe,
          evaluation: Samples, reference, settings: Settings, ranking: list[str],
          progress: Progress | None) -> list[Attempt]:
    """Quantize with `recipe`, check it on `target`; on a failed gate keep the most
    sensitive compute nodes in FP32, doubling their number until it passes or half of them
    are FP32. Every try is returned (the report shows them all); at most the last passes."""
    if progress:
        progress(f"gate {target} {recipe.name}", 0, 1)
    path = quantizer.quantize(recipe)
    acc, error = _check(path, target, evaluation, reference, settings)
    attempt = Attempt(target, recipe, path, acc, bool(acc and acc.passes(settings.max_drop)),
                      error)
    tries = [attempt]
    if attempt.passed or acc is None:
        return tries
    if not ranking:  # measured once, shared by every recipe and target
        ranking.extend(sensitive_nodes(quantizer, evaluation, reference, settings, progress,
                                       recipe.scheme))
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
        trial = Attempt(target, trial_recipe, trial_path, trial_acc,
                        bool(trial_acc and trial_acc.passes(settings.max_drop)), trial_error)
        tries.append(trial)
        if trial.passed:
            break
        count *= 2
    return tries


def _time(attempts: list[Attempt], fp32_sessions: Mapping[str, Any], evaluation: Samples,
          settings: Settings, progress: Progress | None) -> dict[str, float]:
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
                    attempt.path, target, "model", settings.threads, settings.cpus)
                runners[attempt.recipe.label] = lambda s=session: s.run(feeds)
            total = settings.runs * len(runners)
            done = [0]

            def tick(n: int, target: str = target, total: int = total,
                     done: list[int] = done) -> None:
                done[0] += n
                if progress:
                    progress(f"benchmark {target}", done[0], total)

            with pinned_thread(settings.cpus):
                stats = benchmark(runners, settings.runs, warmup=5,
                                  time_budget_s=settings.time_budget_s, progress=tick)
        finally:
            for session in sessions.values():
                session.close()
        fp32_ms[target] = stats["fp32"].p50_ms
        for attempt in passing:
            attempt.p50_ms = stats[attempt.recipe.label].p50_ms
            attempt.speedup = round(stats["fp32"].p50_ms / attempt.p50_ms, 3)
    return fp32_ms


def _decide(model_path: Path, output: Path, attempts: list[Attempt], fp32_ms: dict[str, float],
            calibration: Samples, evaluation: Samples, settings: Settings,
            warnings: list[str], cpu: str = "") -> Report:
    passing = [a for a in attempts if a.passed and a.speedup is not None]
    winners = [a for a in passing if a.speedup >= MIN_SPEEDUP]
    common = {"warnings": warnings, "method": settings.method, "max_drop": settings.max_drop,
              "samples": {"calibration": len(calibration), "evaluation": len(evaluation)},
              "fp32_ms": fp32_ms, "attempts": [a.to_dict() for a in attempts], "cpu": cpu}
    if winners:
        # Across targets: the lowest latency wins (auto); within one, the fastest recipe.
        pick = min(winners, key=lambda a: a.p50_ms)
        _write(pick.path, output)
        return Report(str(output), pick.target, pick.recipe.label, list(pick.recipe.fp32_nodes),
                      pick.accuracy.to_dict() if pick.accuracy else None, pick.speedup,
                      **common)
    if passing:
        best = max(passing, key=lambda a: a.speedup)
        reason = (f"no INT8 recipe beats FP32 (best: {best.recipe.label} on {best.target}, "
                  f"{best.speedup:.2f}x); FP32 kept")
    elif any(a.accuracy for a in attempts):
        best = max((a for a in attempts if a.accuracy), key=lambda a: a.accuracy.score)
        reason = (f"no INT8 recipe passes the accuracy gate (max drop {settings.max_drop}; best: "
                  f"{best.recipe.label} on {best.target}, cosine {best.accuracy.cosine:.4f}"
                  + (f", top-1 agreement {best.accuracy.top1_agreement:.3f}"
                     if best.accuracy.top1_agreement is not None else "") + "); FP32 kept")
    else:
        errors = "; ".join(f"{a.target} {a.recipe.label}: {a.error}" for a in attempts if a.error)
        reason = f"no INT8 recipe ran ({errors}); FP32 kept"
    fastest = min(fp32_ms, key=fp32_ms.get) if fp32_ms else settings.targets[0]
    _write(model_path, output)
    return Report(str(output), fastest, "fp32", [], None, None, reason=reason, **common)


def _write(source: Path, output: Path) -> None:
    """Copy to `output` whole or not at all (via OUTPUT.part, which a failure removes)."""
    partial = output.with_name(output.name + ".part")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, partial)
        partial.replace(output)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise QuantizeError(f"cannot write {output}: {exc.strerror or exc}") from None
