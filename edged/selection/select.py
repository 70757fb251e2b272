"""Measured selection: which variant of a model, on which (backend, device, precision), runs
best here while staying within the accuracy budget of the model's original.

A model is a family: the original the user trained (FP32 ONNX, TFLite or IR) and its INT8
variants (given, or made on the device from calibration data by `edged.quantize.variants`). Every
available candidate of every variant loads its model, runs the evaluation inputs and is
compared with the original's float32 CPU output (`edged.selection.accuracy`: mean cosine, or top-1
agreement for classifiers, with max-abs against the output's range for nearly constant
samples); the ones within `max_drop` are micro-benchmarked together, interleaved, and the
lowest p99 wins. Near-ties (within TIE_FRACTION) go to the lower precision (less memory and
power), then the smaller memory growth. A lone INT8 model with no original is held to its
own arithmetic in float (its QDQ pairs unfused), and its evidence says accuracy against an
original was not checked.

The decision and its evidence are cached under the state dir, keyed by the sha256 of every
file of the family, the hardware fingerprint, the runtime versions, the evaluation data and
the settings, so a restart does not re-benchmark. Nothing is cached when no candidate passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from backends import Candidate, LoadOptions, backend_names, canonical_name, get_backend
from backends.base import BackendError, InputError, ModelError, Session
from backends.model_info import ModelInfo, inspect_model, signature, signature_mismatch
from edged.selection.accuracy import DEFAULT_MAX_DROP, Accuracy, accuracy, constant_outputs
from edged.selection.bench import LatencyStats, benchmark, pinned_thread
from edged.selection.inputs import make_inputs, resolve_shapes
from sysconf.hardware import HardwareFacts

TIE_FRACTION = 0.02  # p99s this close are a tie: measurement noise on a busy device
# Generated evaluation inputs when no data is given: one small output (a 2-class softmax)
# makes a figure that swings with a single sample; several make it about the runtime.
VERIFY_SAMPLES = 4
# 3: model families, accuracy against the original (edged.selection.accuracy), max_drop.
CACHE_VERSION = 3
PRECISIONS = ("auto", "int8")  # Policy.precision: any variant, or INT8 variants only
# What ran, lowest first: the tie-break order ("int8+bf16" is INT8 with bf16 in between).
PRECISION_RANK = {"int8": 0, "fp16": 1, "bf16": 1, "fp32": 2}


class SelectionError(RuntimeError):
    """No candidate could run the model correctly (nothing is cached).

    `evidence` holds what was measured before giving up, so `edgectl backends --json` can
    show why each candidate failed rather than an empty list."""

    def __init__(self, message: str, evidence: Sequence[Evidence] = ()) -> None:
        super().__init__(message)
        self.evidence = list(evidence)


@dataclass(frozen=True)
class Policy:
    # At most `runs` timed runs per candidate, and at most its share of `time_budget_s` (but
    # at least 10): a 0.5 ms model gets hundreds of runs, so its p99 is not decided by one
    # preemption, and a 50 ms model still finishes in seconds.
    runs: int = 1000
    warmup: int = 5
    time_budget_s: float = 6.0  # for the whole benchmark phase
    max_drop: float = DEFAULT_MAX_DROP  # accuracy budget against the original
    max_abs: float | None = None  # None: reported, not gated
    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    shapes: Mapping[str, tuple[int, ...]] | None = None
    backend: str = "auto"  # or "openvino", "openvino:CPU", "openvino:CPU:bf16"
    precision: str = "auto"  # "int8": choose among the INT8 variants only

    def key_parts(self) -> dict[str, Any]:
        return {
            "max_drop": self.max_drop,
            "max_abs": self.max_abs,
            "threads": self.threads,
            "cpus": list(self.cpus) if self.cpus else None,
            "shapes": {k: list(v) for k, v in sorted((self.shapes or {}).items())},
            "backend": self.backend,
            "precision": self.precision,
            "verify_samples": VERIFY_SAMPLES,
        }


@dataclass
class Evidence:
    candidate: Candidate
    status: str  # "selected", "passed", "rejected" (accuracy), "failed", "unavailable"
    reason: str = ""
    precision: str | None = None  # what really ran
    cosine: float | None = None  # against the original (or, lone INT8, its own float)
    max_abs: float | None = None
    latency: LatencyStats | None = None
    load_s: float | None = None
    rss_growth_bytes: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    variant: str = ""  # the model file this ran ("" in evidence cached before families)
    accuracy: Accuracy | None = None
    # p50 of the original on the same backend:device over this one's (above 1: faster).
    speedup_vs_original: float | None = None

    @property
    def key(self) -> str:
        """Unique within a selection: the variant's file and the candidate."""
        return f"{self.variant}|{self.candidate.key}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "backend": self.candidate.backend,
            "device": self.candidate.device,
            "requested_precision": self.candidate.precision,
            "precision": self.precision,
            "status": self.status,
            "reason": self.reason,
            "cosine": self.cosine,
            "max_abs": self.max_abs,
            "accuracy": self.accuracy.to_dict() if self.accuracy else None,
            "speedup_vs_original": self.speedup_vs_original,
            "latency": self.latency.to_dict() if self.latency else None,
            "load_s": self.load_s,
            "rss_growth_bytes": self.rss_growth_bytes,
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        latency = data.get("latency")
        acc = data.get("accuracy")
        return cls(
            candidate=Candidate(data["backend"], data["device"], data["requested_precision"]),
            status=data["status"],
            reason=data.get("reason", ""),
            precision=data.get("precision"),
            cosine=data.get("cosine"),
            max_abs=data.get("max_abs"),
            latency=LatencyStats(**latency) if latency else None,
            load_s=data.get("load_s"),
            rss_growth_bytes=data.get("rss_growth_bytes"),
            info=dict(data.get("info") or {}),
            variant=data.get("variant", ""),
            accuracy=Accuracy.from_dict(acc) if acc else None,
            speedup_vs_original=data.get("speedup_vs_original"),
        )


@dataclass
class Selection:
    model: ModelInfo  # the variant that was selected (the file the daemon loads)
    selected: Evidence | None
    evidence: list[Evidence]
    shapes: dict[str, tuple[int, ...]]
    cache_key: str
    from_cache: bool = False
    created: float = field(default_factory=time.time)
    warnings: list[str] = field(default_factory=list)
    original: ModelInfo | None = None  # the family's original (None: the model alone)
    models: dict[str, ModelInfo] = field(default_factory=dict)  # variant path -> info
    against_original: bool = True  # False: a lone INT8 model, held to its own float
    why: str = ""  # one line: why the pick won (and what lost, and why)
    evaluation: str = ""  # what the outputs were compared on

    def summary(self) -> dict[str, Any] | None:
        """The `selected` object of `edgectl backends --json` (a stable shape)."""
        ev = self.selected
        if ev is None:
            return None
        return {
            "variant": str(self.model.path),
            "model_precision": self.model.precision,
            "backend": ev.candidate.backend,
            "device": ev.candidate.device,
            "precision": ev.precision,
            "p50_ms": ev.latency.p50_ms if ev.latency else None,
            "p99_ms": ev.latency.p99_ms if ev.latency else None,
            "cosine": ev.cosine,
            "max_abs": ev.max_abs,
            "accuracy": ev.accuracy.to_dict() if ev.accuracy else None,
            "against_original": self.against_original,
            "why": self.why,
            "from_cache": self.from_cache,
            "warnings": self.warnings,
        }

    def model_of(self, ev: Evidence) -> ModelInfo:
        """The model file `ev` ran (the selected model for evidence without a variant)."""
        return self.models.get(ev.variant, self.model)

    def load_candidate(self, hw: HardwareFacts | None = None) -> Candidate:
        """The selected candidate with its backend options, ready for `load`.

        Asks only the selected backend, so loading a cached decision imports one runtime."""
        assert self.selected is not None
        return find_candidate(hw, self.model, self.selected.candidate)


def runtime_versions() -> dict[str, str | None]:
    return {name: get_backend(name).version() for name in backend_names()}


def all_candidates(hw: HardwareFacts | None, model: ModelInfo | None) -> list[Candidate]:
    if hw is None:
        from sysconf.hardware import probe

        hw = probe()
    result: list[Candidate] = []
    for name in backend_names():
        result.extend(get_backend(name).candidates(hw, model))
    return result


def backend_candidates(hw: HardwareFacts | None, model: ModelInfo | None,
                       spec: str = "auto") -> list[Candidate]:
    """The candidates matching `spec`. A named backend is asked alone, so pinning one (or
    loading a cached decision) imports only its runtime; "auto"/"all" ask every backend."""
    if spec in ("auto", "all"):
        return all_candidates(hw, model)
    name = canonical_name(spec.split(":")[0])
    if name not in backend_names():
        return []
    if hw is None:
        from sysconf.hardware import probe

        hw = probe()
    return [c for c in get_backend(name).candidates(hw, model) if matches(c, spec)]


def find_candidate(hw: HardwareFacts | None, model: ModelInfo | None,
                   wanted: Candidate) -> Candidate:
    """`wanted` as its backend lists it now (with its options), else `wanted` itself."""
    for candidate in backend_candidates(hw, model, wanted.backend):
        if candidate.key == wanted.key:
            return candidate
    return wanted


def matches(candidate: Candidate, spec: str) -> bool:
    """`spec` is "auto", "all", "backend", "backend:device" or "backend:device:precision"."""
    if spec in ("auto", "all"):
        return True
    parts = spec.split(":")
    if canonical_name(parts[0]) != candidate.backend:
        return False
    if len(parts) > 1 and parts[1].upper() != candidate.device.upper():
        return False
    return len(parts) <= 2 or parts[2].lower() == candidate.precision.lower()


def reference_candidates(model: ModelInfo) -> list[Candidate]:
    """Float32 CPU references, best first: each runtime's most literal CPU path."""
    ov_cpu = Candidate("openvino", "CPU", "fp32")
    if model.format == "onnx":
        # Optimisations off: an FP32 graph runs as written; in a QDQ graph the pairs stay
        # unfused, i.e. the quantized arithmetic in float32 (the lone-INT8 reference).
        return [Candidate("onnxruntime", "CPU", "model",
                          options={"provider": "CPUExecutionProvider",
                                   "optimization": "disable_all"}), ov_cpu]
    if model.format == "tflite":
        return [Candidate("litert", "CPU", "model"), ov_cpu]
    return [ov_cpu]


@dataclass(frozen=True)
class Evaluation:
    """Evaluation inputs given by the user (samples held out from calibration data, or an
    eval set), with an id for the cache key; None in `select` means generated inputs."""

    feeds: list[dict[str, np.ndarray]]
    source: str  # for people: "12 images held out of calib/"

    def digest(self) -> str:
        from edged.quantize.calibration import digest

        return digest(self.feeds)


def cache_key(model: ModelInfo, hw: HardwareFacts, policy: Policy,
              variants: Sequence[ModelInfo] = (), evaluation: Evaluation | None = None) -> str:
    parts = {
        "v": CACHE_VERSION,
        "model": model.sha256,
        "variants": [v.sha256 for v in variants],
        "evaluation": evaluation.digest() if evaluation else None,
        "hardware": hw.fingerprint(),
        "runtimes": runtime_versions(),
        "policy": policy.key_parts(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _cache_path(state_dir: Path, key: str) -> Path:
    return state_dir / "selection" / f"{key}.json"


def load_cached(state_dir: Path | None, family: Sequence[ModelInfo], key: str
                ) -> Selection | None:
    if state_dir is None:
        return None
    path = _cache_path(state_dir, key)
    models = {str(m.path): m for m in family}
    try:
        data = json.loads(path.read_text())
        evidence = [Evidence.from_dict(e) for e in data["evidence"]]
        selected = next(e for e in evidence if e.status == "selected")
        model = models[selected.variant]
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return None  # missing, unreadable or from another layout: measure again
    shapes = {k: tuple(v) for k, v in data.get("shapes", {}).items()}
    return Selection(model, selected, evidence, shapes, key, True, data.get("created", 0.0),
                     list(data.get("warnings", [])), family[0], models,
                     bool(data.get("against_original", True)), data.get("why", ""),
                     data.get("evaluation", ""))


def store(state_dir: Path, selection: Selection) -> None:
    path = _cache_path(state_dir, selection.cache_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "warnings": selection.warnings,
        "model": str(selection.model.path),
        "model_sha256": selection.model.sha256,
        "original": str(selection.original.path) if selection.original else None,
        "against_original": selection.against_original,
        "why": selection.why,
        "evaluation": selection.evaluation,
        "created": selection.created,
        "shapes": {k: list(v) for k, v in selection.shapes.items()},
        "evidence": [e.to_dict() for e in selection.evidence],
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # atomic: a crash never leaves half a decision behind


def family_of(model_path: str | Path, variants: Sequence[str | Path] = ()
              ) -> list[ModelInfo]:
    """The original first, then each variant (duplicates dropped); ModelError names the
    file that cannot be read, and a variant whose inputs/outputs differ from the original's
    is a ModelError naming both files."""
    original = inspect_model(model_path)
    family = [original]
    seen = {original.path.resolve()}
    for path in variants:
        info = inspect_model(path)
        if info.path.resolve() in seen:
            continue
        seen.add(info.path.resolve())
        check_variant(original.path, info.path)
        family.append(info)
    return family


def check_variant(original: Path, variant: Path) -> None:
    """Raise ModelError when `variant` cannot stand in for `original`: other input/output
    names, dtypes or fixed dims (read from the files; formats without a file-level signature
    are checked on their loaded sessions instead)."""
    want, got = signature(original), signature(variant)
    if want is None or got is None:
        return
    problem = signature_mismatch(want, got)
    if problem:
        raise ModelError(f"variant {variant} does not match its original {original}: "
                         f"{problem}")


def select(
    model_path: str | Path,
    hw: HardwareFacts,
    policy: Policy = Policy(),
    state_dir: Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    variants: Sequence[str | Path] = (),
    evaluation: Evaluation | None = None,
    refresh: bool = False,
) -> Selection:
    """Pick the variant and backend for a model family (cached; `refresh` measures again).
    `model_path` is the original; `variants` its INT8 (or other) versions. Raises
    ModelError, InputError, SelectionError."""
    family = family_of(model_path, variants)
    key = cache_key(family[0], hw, policy, family[1:], evaluation)
    cached = None if refresh else load_cached(state_dir, family, key)
    if cached is not None:
        return cached
    before = _cache_files(state_dir)
    try:
        return _measure(family, key, hw, policy, state_dir, progress, evaluation)
    except BaseException:
        _forget_new_files(state_dir, before)
        raise


def _cache_files(state_dir: Path | None) -> tuple[bool, set[Path]] | None:
    """What the state dir and its compiled-model cache held before a selection."""
    if state_dir is None:
        return None
    cache = state_dir / "openvino-cache"
    return state_dir.exists(), set(cache.rglob("*")) if cache.exists() else set()


def _forget_new_files(state_dir: Path | None, before: tuple[bool, set[Path]] | None) -> None:
    """Undo what a failed selection wrote: the compiled-model blobs it added (OpenVINO writes
    them during compile, before verification can fail) and the folders it created. Only that
    cache is touched: the state dir may hold a running daemon's other files."""
    if state_dir is None or before is None:
        return
    existed, old = before
    cache = state_dir / "openvino-cache"
    if cache.exists():
        for path in sorted(set(cache.rglob("*")) - old, reverse=True):
            if path.is_dir():
                with contextlib.suppress(OSError):
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)
        if not old:
            with contextlib.suppress(OSError):
                cache.rmdir()
    if not existed:
        with contextlib.suppress(OSError):
            state_dir.rmdir()


def _measure(family: list[ModelInfo], key: str, hw: HardwareFacts, policy: Policy,
             state_dir: Path | None, progress: Callable[[str, int, int], None] | None,
             evaluation: Evaluation | None) -> Selection:
    original = family[0]
    against_original = not original.is_int8
    members = [m for m in family if policy.precision != "int8" or m.is_int8]
    if not members:
        raise SelectionError(f"{original.path}: precision = \"int8\" but the family has no "
                             f"INT8 variant (give variants, or calibration data to make "
                             f"them)")
    per_member = [(m, [c for c in backend_candidates(hw, m, policy.backend)
                       if matches(c, policy.backend)]) for m in members]
    if not any(cands for _, cands in per_member):
        raise SelectionError(f"{original.path}: no backend matches {policy.backend!r}")
    evidence = [Evidence(c, "unavailable", c.reason, variant=str(m.path))
                for m, cands in per_member for c in cands if not c.available]
    if not any(c.available for _, cands in per_member for c in cands):
        reasons = "; ".join(f"{e.candidate.key}: {e.reason}" for e in evidence)
        raise SelectionError(f"{original.path}: no available backend for {policy.backend!r} "
                             f"({reasons})", evidence)
    options = LoadOptions(threads=policy.threads, cpus=policy.cpus,
                          cache_dir=state_dir / "openvino-cache" if state_dir else None)
    models = {str(m.path): m for m in family}
    with pinned_thread(policy.cpus):
        shapes, samples, reference, specs = _reference(original, policy, options, evaluation)
        feeds = samples[0]
        options = replace(options, shapes=shapes)
        sessions: dict[str, Session] = {}
        work = [(m, c) for m, cands in per_member for c in cands if c.available]
        for index, (member, candidate) in enumerate(work):
            if progress:
                progress(f"verify {member.name} {candidate.key}", index, len(work))
            ev, session = _verify(member, candidate, options, samples, reference, specs,
                                  policy, hw, against_original)
            evidence.append(ev)
            if session is not None:
                sessions[ev.key] = session
        if sessions:
            total = policy.runs * len(sessions)
            done = [0]

            def tick(n: int) -> None:
                done[0] += n
                if progress:
                    progress("benchmark", done[0], total)

            stats = benchmark({k: (lambda s=s: s.run(feeds)) for k, s in sessions.items()},
                              policy.runs, policy.warmup, policy.time_budget_s, progress=tick)
            for ev in evidence:
                if ev.key in stats:
                    ev.latency = stats[ev.key]
        for session in sessions.values():
            session.close()
    _speedups(evidence, str(original.path))
    passed = [e for e in evidence if e.status == "passed"]
    if not passed:
        why = "; ".join(f"{_label(e, original)} {e.candidate.key}: {e.reason}"
                        for e in evidence if e.reason)
        raise SelectionError(f"{original.path}: no candidate ran it correctly ({why})", evidence)
    best = _choose(passed)
    best.status = "selected"
    source = evaluation.source if evaluation else (
        f"{len(samples)} generated text-like inputs")
    selection = Selection(models[best.variant], best, evidence, shapes, key,
                          original=original, models=models,
                          against_original=against_original, evaluation=source)
    selection.why = explain(selection, hw)
    constant = constant_outputs(reference)
    if constant:
        selection.warnings.append(
            f"output(s) {', '.join(constant)} are constant for every evaluation input, so "
            f"the accuracy check could not tell the candidates apart for them")
    if not against_original:
        selection.warnings.append(
            f"{original.name} is INT8 and no FP32 original was given: its runtimes were "
            f"checked against its own arithmetic in float, not against an original (give "
            f"the original as the model and this file as a variant)")
    if state_dir is not None:
        store(state_dir, selection)
    return selection


def _reference(model: ModelInfo, policy: Policy, options: LoadOptions,
               evaluation: Evaluation | None):
    """Shapes, evaluation inputs, the original's float32 CPU outputs on them (first
    reference runtime that loads), and its input/output specs."""
    errors = []
    for candidate in reference_candidates(model):
        try:
            session = get_backend(candidate.backend).load(model, candidate, options)
        except ModelError:
            raise
        except (BackendError, ImportError) as exc:
            errors.append(f"{candidate.key}: {exc}")
            continue
        try:
            if evaluation is not None:
                samples = evaluation.feeds
                shapes = {k: tuple(v.shape) for k, v in samples[0].items()}
            else:
                shapes = resolve_shapes(session.inputs, policy.shapes, model.name)
                samples = [make_inputs(session.inputs, shapes, seed) for seed in
                           range(VERIFY_SAMPLES)]
            try:
                outputs = [session.run(feeds) for feeds in samples]
            except (BackendError, InputError) as exc:
                raise InputError(f"{model.path}: the reference run failed with input shapes "
                                 f"{_fmt_shapes(shapes)}: {exc}; give the shapes the model "
                                 f"expects with --shape NAME=DxDx...") from None
            return shapes, samples, outputs, (list(session.inputs), list(session.outputs))
        finally:
            session.close()
    raise SelectionError(f"{model.path}: no float32 reference runtime could load it "
                         f"({'; '.join(errors)})")


def _fmt_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    return ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())


def _verify(model: ModelInfo, candidate: Candidate, options: LoadOptions, samples, reference,
            specs, policy: Policy, hw: HardwareFacts, against_original: bool
            ) -> tuple[Evidence, Session | None]:
    variant = str(model.path)
    rss_before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    try:
        session = get_backend(candidate.backend).load(model, candidate, options)
    except (ModelError, BackendError, InputError, ImportError) as exc:
        return Evidence(candidate, "failed", str(exc), variant=variant), None
    problem = _session_mismatch(specs, session)
    if problem:
        session.close()
        return Evidence(candidate, "failed", f"does not match the original: {problem}",
                        variant=variant), None
    try:
        outputs = [session.run(feeds) for feeds in samples]
    except (BackendError, InputError) as exc:
        session.close()
        return Evidence(candidate, "failed", str(exc), variant=variant), None
    load_s = round(time.perf_counter() - start, 4)
    info = session.info()
    try:
        acc = accuracy(reference, outputs)
    except BackendError as exc:
        session.close()
        return Evidence(candidate, "failed", f"outputs differ in form: {exc}",
                        variant=variant), None
    ev = Evidence(candidate, "passed", "", info.get("precision"), round(acc.cosine, 6),
                  round(acc.max_abs, 6), None, load_s,
                  psutil.Process().memory_info().rss - rss_before, info, variant, acc)
    problems = []
    if not acc.passes(policy.max_drop):
        problems.append(f"{acc.rule} {acc.score:.4f} < {1 - policy.max_drop:g} "
                        f"(worst sample {acc.worst_sample}: cosine {acc.cosine_min:.4f})")
    if policy.max_abs is not None and not acc.max_abs <= policy.max_abs:
        problems.append(f"max-abs {acc.max_abs:.4g} > {policy.max_abs}")
    if problems:
        against = "the original" if against_original else "its own float arithmetic"
        ev.status = "rejected"
        ev.reason = f"outputs differ from {against}: " + ", ".join(problems) + \
            _int8_cause(model, candidate, hw)
        session.close()
        return ev, None
    return ev, session


def _session_mismatch(specs, session: Session) -> str | None:
    """Input/output names and dtypes of a loaded variant against the original's (for the
    formats `check_variant` cannot read from the file, and for what a runtime presents)."""
    want_in, want_out = specs
    if [s.name for s in session.inputs] != [s.name for s in want_in]:
        return (f"inputs are {[s.name for s in session.inputs]}, the original's are "
                f"{[s.name for s in want_in]}")
    for a, b in zip(want_in, session.inputs, strict=True):
        if a.dtype != b.dtype:
            return f"input {a.name!r} is {b.dtype}, the original's is {a.dtype}"
    if len(session.outputs) != len(want_out):
        return f"{len(session.outputs)} outputs, the original has {len(want_out)}"
    return None


def _int8_cause(model: ModelInfo, candidate: Candidate, hw: HardwareFacts) -> str:
    """The known cause of an INT8 model's failure on this CPU, and the fix, where known."""
    if not (model.is_int8 and model.int8_scheme == "u8s8" and not hw.int8_dot_product
            and candidate.device.upper().startswith("CPU") and hw.arch == "x86_64"):
        return ""
    return (f"; likely cause: a U8S8 model on a CPU without VNNI ({hw.isa_summary()}), where "
            f"the x86 int8 kernels saturate their int16 pair sums (vpmaddubsw); fix: "
            f"quantize with reduce_range (7-bit weights) or U8U8, as `edgectl quantize` "
            f"does on such a CPU")


def _speedups(evidence: list[Evidence], original: str) -> None:
    """Each timed variant's speed against the original on the same backend:device (the
    original's fp32 request where it has one, else its cheapest timed one)."""
    timed = [e for e in evidence if e.latency]
    base: dict[tuple[str, str], float] = {}
    for ev in sorted(timed, key=lambda e: e.candidate.precision not in ("fp32", "model")):
        if ev.variant == original:
            base.setdefault((ev.candidate.backend, ev.candidate.device), ev.latency.p50_ms)
    for ev in timed:
        ref = base.get((ev.candidate.backend, ev.candidate.device))
        if ev.variant != original and ref:
            ev.speedup_vs_original = round(ref / ev.latency.p50_ms, 3)


def precision_rank(precision: str | None) -> int:
    head = (precision or "fp32").split("+")[0]
    return PRECISION_RANK.get(head, 2)


def _choose(passed: list[Evidence]) -> Evidence:
    best_p99 = min(e.latency.p99_ms for e in passed if e.latency)
    tied = [e for e in passed if e.latency and e.latency.p99_ms <= best_p99 * (1 + TIE_FRACTION)]
    return min(tied, key=lambda e: (precision_rank(e.precision), e.rss_growth_bytes or 0,
                                    e.latency.p99_ms))


def _label(ev: Evidence, original: ModelInfo) -> str:
    return "original" if ev.variant in ("", str(original.path)) else Path(ev.variant).name


def explain(selection: Selection, hw: HardwareFacts) -> str:
    """One line on why the pick won, and what the best INT8 or FP32 alternative did."""
    sel = selection.selected
    assert sel is not None and sel.latency is not None
    original = selection.original or selection.model
    cpu = f"on this CPU ({hw.isa_summary()})" if sel.candidate.device.startswith("CPU") \
        else f"on {sel.candidate.device}"
    head = (f"{_label(sel, original)} on {sel.candidate.backend}:{sel.candidate.device} "
            f"({sel.precision}) has the lowest p99 within the accuracy budget, "
            f"{sel.latency.p99_ms:.3f} ms")
    int8 = [e for e in selection.evidence if selection.model_of(e).is_int8
            and e.variant != str(original.path)]
    if not selection.against_original or not int8:
        return head
    if selection.model.is_int8 and sel.speedup_vs_original:
        return (f"{head}; INT8 on {sel.candidate.backend}:{sel.candidate.device} is "
                f"{sel.speedup_vs_original:.2f}x its FP32 model {cpu}")
    timed = [e for e in int8 if e.status == "passed" and e.speedup_vs_original]
    if timed:
        best = max(timed, key=lambda e: e.speedup_vs_original)
        return (f"{head}; INT8 lost: on {best.candidate.backend}:{best.candidate.device} it "
                f"is {best.speedup_vs_original:.2f}x its FP32 model {cpu}, p99 "
                f"{best.latency.p99_ms:.3f} ms")
    rejected = [e for e in int8 if e.status == "rejected" and e.accuracy]
    if rejected:
        best = max(rejected, key=lambda e: e.accuracy.score)
        return (f"{head}; INT8 lost on accuracy: at best {best.accuracy.rule} "
                f"{best.accuracy.score:.4f} against the original "
                f"({best.candidate.backend}:{best.candidate.device})")
    return f"{head}; no INT8 variant ran here"
