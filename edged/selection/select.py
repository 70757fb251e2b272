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

Here: the family read and checked, the measurement (reference run, verification of every
candidate, the interleaved benchmark) and `select` itself. The decision, its evidence and its
cache are edged.selection.decision's; the candidates edged.selection.candidates'; the choice
among the passing ones and its why-line edged.selection.explain's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import psutil

from backends import Candidate, LoadOptions, get_backend, reference_candidates
from backends.base import Session, backend_cache
from backends.errors import BackendError, InputError, ModelError
from backends.model_info import ModelInfo, inspect_model, signature, signature_mismatch
from edged.selection.accuracy import ScoreMap, accuracy, constant_outputs
from edged.selection.bench import benchmark, pinned_thread
from edged.selection.candidates import backend_candidates, matches
from edged.selection.decision import Evaluation, Evidence, Selection, cache_key, load_cached, store
from edged.selection.explain import choose, explain, record_speedups, variant_label
from edged.selection.inputs import make_inputs, resolve_shapes
from edged.selection.policy import VERIFY_SAMPLES, Policy
from sysconf.hardware import HardwareFacts


class SelectionError(RuntimeError):
    """No candidate could run the model correctly (nothing is cached).

    `evidence` holds what was measured before giving up, so `edgectl backends --json` can
    show why each candidate failed rather than an empty list."""

    def __init__(self, message: str, evidence: Sequence[Evidence] = ()) -> None:
        super().__init__(message)
        self.evidence = list(evidence)


def family_of(model_path: str | Path, variants: Sequence[str | Path] = ()) -> list[ModelInfo]:
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
        raise ModelError(f"variant {variant} does not match its original {original}: {problem}")


def select(
    model_path: str | Path,
    hw: HardwareFacts,
    policy: Policy = Policy(),  # noqa: B008 (frozen, so one shared default is safe)
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


def _caches(state_dir: Path) -> list[Path]:
    """Every backend's compiled-model folder under a state dir."""
    from backends import backend_names

    return [backend_cache(state_dir, name) for name in backend_names()]


def _cache_files(state_dir: Path | None) -> tuple[bool, set[Path]] | None:
    """What the state dir and the backends' compiled-model caches held before a selection."""
    if state_dir is None:
        return None
    old = {path for cache in _caches(state_dir) if cache.exists() for path in cache.rglob("*")}
    return state_dir.exists(), old


def _forget_new_files(state_dir: Path | None, before: tuple[bool, set[Path]] | None) -> None:
    """Undo what a failed selection wrote: the compiled-model blobs it added (OpenVINO writes
    them during compile, before verification can fail) and the folders it created. Only those
    caches are touched: the state dir may hold a running daemon's other files."""
    if state_dir is None or before is None:
        return
    existed, old = before
    for cache in _caches(state_dir):
        if not cache.exists():
            continue
        had = any(path.is_relative_to(cache) for path in old)
        for path in sorted(set(cache.rglob("*")) - old, reverse=True):
            if path.is_dir():
                with contextlib.suppress(OSError):
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)
        if not had:
            with contextlib.suppress(OSError):
                cache.rmdir()
    if not existed:
        with contextlib.suppress(OSError):
            state_dir.rmdir()


def _measure(
    family: list[ModelInfo],
    key: str,
    hw: HardwareFacts,
    policy: Policy,
    state_dir: Path | None,
    progress: Callable[[str, int, int], None] | None,
    evaluation: Evaluation | None,
) -> Selection:
    original = family[0]
    against_original = not original.is_int8
    members = [m for m in family if policy.precision != "int8" or m.is_int8]
    if not members:
        raise SelectionError(
            f'{original.path}: precision = "int8" but the family has no '
            f"INT8 variant (give variants, or calibration data to make "
            f"them)"
        )
    per_member = [
        (m, [c for c in backend_candidates(hw, m, policy.backend) if matches(c, policy.backend)])
        for m in members
    ]
    if not any(cands for _, cands in per_member):
        raise SelectionError(f"{original.path}: no backend matches {policy.backend!r}")
    evidence = [
        Evidence(c, "unavailable", c.reason, variant=str(m.path))
        for m, cands in per_member
        for c in cands
        if not c.available
    ]
    if not any(c.available for _, cands in per_member for c in cands):
        reasons = "; ".join(f"{e.candidate.key}: {e.reason}" for e in evidence)
        raise SelectionError(
            f"{original.path}: no available backend for {policy.backend!r} ({reasons})", evidence
        )
    options = LoadOptions(
        threads=policy.threads,
        cpus=policy.cpus,
        cache_root=state_dir,
        backend_options=policy.backend_options,
    )
    models = {str(m.path): m for m in family}
    work = [(m, c) for m, cands in per_member for c in cands if c.available]
    with pinned_thread(policy.cpus):
        shapes, samples, reference, specs = _reference(
            original, policy, options, evaluation, [c for m, c in work if m is original]
        )
        feeds = samples[0]
        options = replace(options, shapes=shapes, shapes_bind=bool(policy.shapes))
        sessions: dict[str, Session] = {}
        for index, (member, candidate) in enumerate(work):
            if progress:
                progress(f"verify {member.name} {candidate.key}", index, len(work))
            ev, session = _verify(
                member, candidate, options, samples, reference, specs, policy, hw, against_original
            )
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

            stats = benchmark(
                {k: functools.partial(s.run, feeds) for k, s in sessions.items()},
                policy.runs,
                policy.warmup,
                policy.time_budget_s,
                progress=tick,
            )
            for ev in evidence:
                if ev.key in stats:
                    ev.latency = stats[ev.key]
        for session in sessions.values():
            session.close()
    record_speedups(evidence, str(original.path))
    passed = [e for e in evidence if e.status == "passed"]
    if not passed:
        why = "; ".join(
            f"{variant_label(e, original)} {e.candidate.key}: {e.reason}"
            for e in evidence
            if e.reason
        )
        raise SelectionError(f"{original.path}: no candidate ran it correctly ({why})", evidence)
    best = choose(passed)
    best.status = "selected"
    source = evaluation.source if evaluation else (f"{len(samples)} generated text-like inputs")
    selection = Selection(
        models[best.variant],
        best,
        evidence,
        shapes,
        key,
        original=original,
        models=models,
        against_original=against_original,
        evaluation=source,
    )
    selection.why = explain(selection, hw)
    constant = constant_outputs(reference) if reference is not None else []
    if constant:
        selection.warnings.append(
            f"output(s) {', '.join(constant)} are constant for every evaluation input, so "
            f"the accuracy check could not tell the candidates apart for them"
        )
    if reference is None:
        selection.warnings.append(
            f"{original.name} is a {original.format} model, which no runtime here computes "
            f"in float: it was run, not checked for accuracy (give its ONNX original as the "
            f"model and this file as a variant, so the original is the reference)"
        )
    elif not against_original:
        selection.warnings.append(
            f"{original.name} is INT8 and no FP32 original was given: its runtimes were "
            f"checked against its own arithmetic in float, not against an original (give "
            f"the original as the model and this file as a variant)"
        )
    if state_dir is not None:
        store(state_dir, selection)
    return selection


def reverify(
    selection: Selection,
    candidate: Candidate,
    hw: HardwareFacts,
    policy: Policy,
    options: LoadOptions,
    evaluation: Evaluation | None = None,
) -> tuple[Evidence, Session | None]:
    """The pick checked again before it serves again (its device came back after an unplug
    or a failure): the original's reference outputs on the evaluation inputs, then the
    pick's, held to the same budget as at selection. No benchmark: its speed is known.
    Returns the evidence and, when it passed, the loaded session (ready to swap in)."""
    assert selection.selected is not None
    original = selection.original or selection.model
    member = selection.model_of(selection.selected)
    with pinned_thread(policy.cpus):
        _, samples, reference, specs = _reference(original, policy, options, evaluation)
        return _verify(
            member,
            candidate,
            options,
            samples,
            reference,
            specs,
            policy,
            hw,
            selection.against_original,
        )


def _reference(
    model: ModelInfo,
    policy: Policy,
    options: LoadOptions,
    evaluation: Evaluation | None,
    unreferenced: Sequence[Candidate] = (),
):
    """Shapes, evaluation inputs, the original's float32 CPU outputs on them (first
    reference runtime that loads), and its input/output specs. A format no runtime
    computes in float (.rknn, .hef given alone) has no reference: the inputs are made for
    the first of `unreferenced` (its candidates) that loads, and the outputs are None."""
    errors = []
    references = reference_candidates(model)
    for candidate in references or unreferenced:
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
                samples = [
                    make_inputs(session.inputs, shapes, seed) for seed in range(VERIFY_SAMPLES)
                ]
            if not references:
                return shapes, samples, None, (list(session.inputs), list(session.outputs))
            try:
                outputs = [session.run(feeds) for feeds in samples]
            except (BackendError, InputError) as exc:
                raise InputError(
                    f"{model.path}: the reference run failed with input shapes "
                    f"{_fmt_shapes(shapes)}: {exc}; give the shapes the model "
                    f"expects with --shape NAME=DxDx..."
                ) from None
            return shapes, samples, outputs, (list(session.inputs), list(session.outputs))
        finally:
            session.close()
    if not references and not errors:
        errors.append(f"no runtime here reads {model.format} models")
    raise SelectionError(
        f"{model.path}: no float32 reference runtime could load it ({'; '.join(errors)})"
    )


def _fmt_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    return ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())


def _verify(
    model: ModelInfo,
    candidate: Candidate,
    options: LoadOptions,
    samples,
    reference,
    specs,
    policy: Policy,
    hw: HardwareFacts,
    against_original: bool,
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
        return Evidence(
            candidate, "failed", f"does not match the original: {problem}", variant=variant
        ), None
    try:
        outputs = [session.run(feeds) for feeds in samples]
    except (BackendError, InputError) as exc:
        session.close()
        return Evidence(candidate, "failed", str(exc), variant=variant), None
    load_s = round(time.perf_counter() - start, 4)
    info = session.info()
    if reference is None:  # ran, and nothing to hold it to (see _reference)
        growth = psutil.Process().memory_info().rss - rss_before
        return Evidence(
            candidate,
            "passed",
            "",
            info.get("precision"),
            None,
            None,
            None,
            load_s,
            growth,
            info,
            variant,
        ), session
    try:
        acc = accuracy(reference, outputs, ScoreMap(policy.scores) if policy.scores else None)
    except BackendError as exc:
        session.close()
        return Evidence(
            candidate, "failed", f"outputs differ in form: {exc}", variant=variant
        ), None
    ev = Evidence(
        candidate,
        "passed",
        "",
        info.get("precision"),
        round(acc.cosine, 6),
        round(acc.max_abs, 6),
        None,
        load_s,
        psutil.Process().memory_info().rss - rss_before,
        info,
        variant,
        acc,
    )
    problems = []
    if not acc.passes(policy.max_drop):
        problems.append(
            f"{acc.rule} {acc.score:.4f} < {1 - policy.max_drop:g} "
            f"(worst sample {acc.worst_sample}: cosine {acc.cosine_min:.4f})"
        )
    if policy.max_abs is not None and not acc.max_abs <= policy.max_abs:
        problems.append(f"max-abs {acc.max_abs:.4g} > {policy.max_abs}")
    if problems:
        against = "the original" if against_original else "its own float arithmetic"
        ev.status = "rejected"
        ev.reason = (
            f"outputs differ from {against}: "
            + ", ".join(problems)
            + _int8_cause(model, candidate, hw)
        )
        session.close()
        return ev, None
    return ev, session


def _session_mismatch(specs, session: Session) -> str | None:
    """Input/output names and dtypes of a loaded variant against the original's (for the
    formats `check_variant` cannot read from the file, and for what a runtime presents)."""
    want_in, want_out = specs
    if [s.name for s in session.inputs] != [s.name for s in want_in]:
        return (
            f"inputs are {[s.name for s in session.inputs]}, the original's are "
            f"{[s.name for s in want_in]}"
        )
    for a, b in zip(want_in, session.inputs, strict=True):
        if a.dtype != b.dtype:
            return f"input {a.name!r} is {b.dtype}, the original's is {a.dtype}"
    if len(session.outputs) != len(want_out):
        return f"{len(session.outputs)} outputs, the original has {len(want_out)}"
    return None


def _int8_cause(model: ModelInfo, candidate: Candidate, hw: HardwareFacts) -> str:
    """The known cause of an INT8 model's failure on this CPU, and the fix, where known."""
    if not (
        model.is_int8
        and model.int8_scheme == "u8s8"
        and not hw.int8_dot_product
        and candidate.device.upper().startswith("CPU")
        and hw.arch == "x86_64"
    ):
        return ""
    return (
        f"; likely cause: a U8S8 model on a CPU without VNNI ({hw.isa_summary()}), where "
        f"the x86 int8 kernels saturate their int16 pair sums (vpmaddubsw); fix: "
        f"quantize with reduce_range (7-bit weights) or U8U8, as `edgectl quantize` "
        f"does on such a CPU"
    )
