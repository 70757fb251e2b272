"""Measured backend selection: which (backend, device, precision) runs this model best here.

For every available candidate: load, run reference inputs, compare with a float32 CPU
reference (cosine and max-abs), micro-benchmark the ones that match, and pick the lowest p99
(near-ties within TIE_FRACTION go to the lower p50, then the smaller memory growth). The
decision and its evidence are cached under the state dir, keyed by the model's sha256, the
hardware fingerprint, the runtime versions and the settings, so a restart does not
re-benchmark. Nothing is cached when no candidate passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
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
from backends.model_info import ModelInfo, inspect_model
from edged.bench import LatencyStats, benchmark, pinned_thread
from edged.inputs import make_inputs, resolve_shapes
from sysconf.hardware import HardwareFacts

TIE_FRACTION = 0.02  # p99s this close are a tie: measurement noise on a busy device
# Reference input sets compared per candidate: one small output (a 2-class softmax) makes a
# cosine that swings with a single sample; several make the comparison about the runtime.
VERIFY_SAMPLES = 4
# 2: per-sample verification (the lowest cosine of any sample decides), adaptive run count.
CACHE_VERSION = 2


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
    min_cosine: float = 0.99
    max_abs: float | None = None  # None: reported, not gated
    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    shapes: Mapping[str, tuple[int, ...]] | None = None
    backend: str = "auto"  # or "openvino", "openvino:CPU", "openvino:CPU:bf16"

    def key_parts(self) -> dict[str, Any]:
        return {
            "min_cosine": self.min_cosine,
            "max_abs": self.max_abs,
            "threads": self.threads,
            "cpus": list(self.cpus) if self.cpus else None,
            "shapes": {k: list(v) for k, v in sorted((self.shapes or {}).items())},
            "backend": self.backend,
            "verify_samples": VERIFY_SAMPLES,
        }


@dataclass
class Evidence:
    candidate: Candidate
    status: str  # "selected", "passed", "rejected" (accuracy), "failed", "unavailable"
    reason: str = ""
    precision: str | None = None  # what really ran
    cosine: float | None = None
    max_abs: float | None = None
    latency: LatencyStats | None = None
    load_s: float | None = None
    rss_growth_bytes: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.candidate.backend,
            "device": self.candidate.device,
            "requested_precision": self.candidate.precision,
            "precision": self.precision,
            "status": self.status,
            "reason": self.reason,
            "cosine": self.cosine,
            "max_abs": self.max_abs,
            "latency": self.latency.to_dict() if self.latency else None,
            "load_s": self.load_s,
            "rss_growth_bytes": self.rss_growth_bytes,
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        latency = data.get("latency")
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
        )


@dataclass
class Selection:
    model: ModelInfo
    selected: Evidence | None
    evidence: list[Evidence]
    shapes: dict[str, tuple[int, ...]]
    cache_key: str
    from_cache: bool = False
    created: float = field(default_factory=time.time)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any] | None:
        """The `selected` object of `edgectl backends --json` (a stable shape)."""
        ev = self.selected
        if ev is None:
            return None
        return {
            "backend": ev.candidate.backend,
            "device": ev.candidate.device,
            "precision": ev.precision,
            "p50_ms": ev.latency.p50_ms if ev.latency else None,
            "p99_ms": ev.latency.p99_ms if ev.latency else None,
            "cosine": ev.cosine,
            "max_abs": ev.max_abs,
            "from_cache": self.from_cache,
            "warnings": self.warnings,
        }

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
        # Optimisations off: QDQ pairs stay unfused, i.e. the quantized arithmetic in float.
        return [Candidate("onnxruntime", "CPU", "model",
                          options={"provider": "CPUExecutionProvider",
                                   "optimization": "disable_all"}), ov_cpu]
    if model.format == "tflite":
        return [Candidate("litert", "CPU", "model"), ov_cpu]
    return [ov_cpu]


def compare(reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]
            ) -> tuple[float, float]:
    """(lowest cosine over outputs, highest max-abs difference); outputs matched by name,
    else by position (runtimes may rename outputs of converted graphs)."""
    ref_items = list(reference.items())
    got_items = [(name, got[name]) for name, _ in ref_items] if set(reference) <= set(got) \
        else list(got.items())
    if len(got_items) != len(ref_items):
        raise BackendError(f"{len(got_items)} outputs, the reference has {len(ref_items)}")
    cosines, diffs = [], []
    for (name, ref), (_, out) in zip(ref_items, got_items, strict=True):
        a = np.asarray(ref, dtype=np.float64).ravel()
        b = np.asarray(out, dtype=np.float64).ravel()
        if a.shape != b.shape:
            raise BackendError(f"output {name!r} has {b.size} values, reference {a.size}")
        if not np.all(np.isfinite(b)):
            return float("nan"), float("inf")
        # Sums of products rather than `@`/norm: those go through OpenBLAS, whose threads
        # then spin in the daemon for a while after each call.
        denom = math.sqrt(float(np.sum(a * a)) * float(np.sum(b * b)))
        cosines.append(1.0 if denom == 0 and np.array_equal(a, b) else
                       float(np.sum(a * b)) / denom if denom else 0.0)
        diffs.append(float(np.max(np.abs(a - b))) if a.size else 0.0)
    return min(cosines), max(diffs)


def compare_samples(references: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> tuple[float, float]:
    """Per input sample, then the worst: one bad sample cannot hide behind three good ones
    (a concatenated vector would let a large-norm sample dominate)."""
    pairs = [compare(ref, got) for ref, got in zip(references, outputs, strict=True)]
    return min(c for c, _ in pairs), max(d for _, d in pairs)


def constant_outputs(references: Sequence[Mapping[str, np.ndarray]]) -> list[str]:
    """Outputs that are constant for every reference input: comparing them proves nothing
    (a detector that sees no text answers all zeros, on any runtime)."""
    names = list(references[0])
    return [name for name in names
            if all(np.ptp(np.asarray(ref[name], dtype=np.float64)) == 0 for ref in references)]


def cache_key(model: ModelInfo, hw: HardwareFacts, policy: Policy) -> str:
    parts = {
        "v": CACHE_VERSION,
        "model": model.sha256,
        "hardware": hw.fingerprint(),
        "runtimes": runtime_versions(),
        "policy": policy.key_parts(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _cache_path(state_dir: Path, key: str) -> Path:
    return state_dir / "selection" / f"{key}.json"


def load_cached(state_dir: Path | None, model: ModelInfo, key: str) -> Selection | None:
    if state_dir is None:
        return None
    path = _cache_path(state_dir, key)
    try:
        data = json.loads(path.read_text())
        evidence = [Evidence.from_dict(e) for e in data["evidence"]]
        selected = next(e for e in evidence if e.status == "selected")
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return None  # missing or unreadable cache: measure again
    shapes = {k: tuple(v) for k, v in data.get("shapes", {}).items()}
    return Selection(model, selected, evidence, shapes, key, True, data.get("created", 0.0),
                     list(data.get("warnings", [])))


def store(state_dir: Path, selection: Selection) -> None:
    path = _cache_path(state_dir, selection.cache_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "warnings": selection.warnings,
        "model": str(selection.model.path),
        "model_sha256": selection.model.sha256,
        "created": selection.created,
        "shapes": {k: list(v) for k, v in selection.shapes.items()},
        "evidence": [e.to_dict() for e in selection.evidence],
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # atomic: a crash never leaves half a decision behind


def select(
    model_path: str | Path,
    hw: HardwareFacts,
    policy: Policy = Policy(),
    state_dir: Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Selection:
    """Pick the backend for a model (cached). Raises ModelError, InputError, SelectionError."""
    model = inspect_model(model_path)
    key = cache_key(model, hw, policy)
    cached = load_cached(state_dir, model, key)
    if cached is not None:
        return cached
    before = _cache_files(state_dir)
    try:
        return _measure(model, key, hw, policy, state_dir, progress)
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


def _measure(model: ModelInfo, key: str, hw: HardwareFacts, policy: Policy,
             state_dir: Path | None, progress: Callable[[str, int, int], None] | None
             ) -> Selection:
    candidates = [c for c in backend_candidates(hw, model, policy.backend)
                  if matches(c, policy.backend)]
    if not candidates:
        raise SelectionError(f"{model.path}: no backend matches {policy.backend!r}")
    usable = [c for c in candidates if c.available]
    if not usable:
        reasons = "; ".join(f"{c.key}: {c.reason}" for c in candidates)
        raise SelectionError(f"{model.path}: no available backend for {policy.backend!r} "
                             f"({reasons})",
                             [Evidence(c, "unavailable", c.reason) for c in candidates])
    evidence = [Evidence(c, "unavailable", c.reason) for c in candidates if not c.available]
    options = LoadOptions(threads=policy.threads, cpus=policy.cpus,
                          cache_dir=state_dir / "openvino-cache" if state_dir else None)
    with pinned_thread(policy.cpus):
        shapes, samples, reference = _reference(model, policy, options)
        feeds = samples[0]
        options = replace(options, shapes=shapes)
        sessions: dict[str, Session] = {}
        for index, candidate in enumerate(usable):
            if progress:
                progress(f"verify {candidate.key}", index, len(usable))
            ev, session = _verify(model, candidate, options, samples, reference, policy)
            evidence.append(ev)
            if session is not None:
                sessions[candidate.key] = session
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
                if ev.candidate.key in stats:
                    ev.latency = stats[ev.candidate.key]
        for session in sessions.values():
            session.close()
    passed = [e for e in evidence if e.status == "passed"]
    if not passed:
        why = "; ".join(f"{e.candidate.key}: {e.reason}" for e in evidence if e.reason)
        raise SelectionError(f"{model.path}: no candidate ran it correctly ({why})", evidence)
    best = _choose(passed)
    best.status = "selected"
    selection = Selection(model, best, evidence, shapes, key)
    constant = constant_outputs(reference)
    if constant:
        selection.warnings.append(
            f"output(s) {', '.join(constant)} are constant for the generated reference inputs, "
            f"so the accuracy check could not tell runtimes apart for them")
    if state_dir is not None:
        store(state_dir, selection)
    return selection


def _reference(model: ModelInfo, policy: Policy, options: LoadOptions):
    """Inputs and float32 CPU reference outputs (first reference runtime that loads)."""
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
            shapes = resolve_shapes(session.inputs, policy.shapes, model.name)
            samples = [make_inputs(session.inputs, shapes, seed) for seed in
                       range(VERIFY_SAMPLES)]
            try:
                return shapes, samples, _run_all(session, samples)
            except BackendError as exc:
                raise InputError(f"{model.path}: the reference run failed with input shapes "
                                 f"{_fmt_shapes(shapes)}: {exc}; give the shapes the model "
                                 f"expects with --shape NAME=DxDx...") from None
        finally:
            session.close()
    raise SelectionError(f"{model.path}: no float32 reference runtime could load it "
                         f"({'; '.join(errors)})")


def _run_all(session: Session, samples: Sequence[Mapping[str, np.ndarray]]
             ) -> list[dict[str, np.ndarray]]:
    return [session.run(feeds) for feeds in samples]


def _fmt_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    return ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())


def _verify(model, candidate, options, samples, reference, policy
            ) -> tuple[Evidence, Session | None]:
    rss_before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    try:
        session = get_backend(candidate.backend).load(model, candidate, options)
        outputs = _run_all(session, samples)
    except (ModelError, BackendError, InputError, ImportError) as exc:
        return Evidence(candidate, "failed", str(exc)), None
    load_s = round(time.perf_counter() - start, 4)
    info = session.info()
    try:
        cosine, max_abs = compare_samples(reference, outputs)
    except BackendError as exc:
        session.close()
        return Evidence(candidate, "failed", f"outputs differ in form: {exc}"), None
    ev = Evidence(candidate, "passed", "", info.get("precision"), round(cosine, 6),
                  round(max_abs, 6), None, load_s,
                  psutil.Process().memory_info().rss - rss_before, info)
    problems = []
    if not cosine >= policy.min_cosine:
        problems.append(f"cosine {cosine:.4f} < {policy.min_cosine}")
    if policy.max_abs is not None and not max_abs <= policy.max_abs:
        problems.append(f"max-abs {max_abs:.4g} > {policy.max_abs}")
    if problems:
        ev.status, ev.reason = "rejected", "outputs differ from the reference: " + \
            ", ".join(problems)
        session.close()
        return ev, None
    return ev, session


def _choose(passed: list[Evidence]) -> Evidence:
    best_p99 = min(e.latency.p99_ms for e in passed if e.latency)
    tied = [e for e in passed if e.latency and e.latency.p99_ms <= best_p99 * (1 + TIE_FRACTION)]
    return min(tied, key=lambda e: (e.latency.p50_ms, e.rss_growth_bytes or 0))
