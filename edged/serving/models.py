"""The served models: selection (cached), the loaded session, its worker and fail-over order."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends import LoadOptions, get_backend
from backends.base import Candidate, Session
from backends.errors import BackendError, InputError, ModelError
from backends.model_info import ModelInfo
from edged.quantize.calibration_spec import CalibrationSpec
from edged.selection.bench import pinned_thread
from edged.selection.candidates import all_candidates, backend_candidates
from edged.selection.decision import Evaluation, Selection
from edged.selection.policy import Policy
from edged.selection.select import select
from edged.serving.engine import ModelWorker
from edged.serving.requests import BatchingConfig
from edged.telemetry.latency import LatencyRecorder
from sysconf.hardware import HardwareFacts

log = logging.getLogger("edged.serving.models")

PLATFORMS = {"onnx": "onnxruntime_onnx", "tflite": "tensorflow_lite", "openvino-ir": "openvino"}


@dataclass
class ServedModel:
    name: str
    selection: Selection
    worker: ModelWorker
    config_key: tuple  # what the model was loaded from; a reload reloads when it changes
    policy: Policy = field(default_factory=Policy)
    state_dir: Path = Path("/var/lib/edged")
    loaded_at: float = field(default_factory=time.time)
    variants: tuple[Path, ...] = ()  # the family beside the original (selection.original)
    evaluation: Evaluation | None = None  # held-out calibration data, when given
    calibration: CalibrationSpec | None = None
    # Calibration given and its variants not made yet: the daemon starts `job` for them.
    variants_pending: bool = False
    job: Any = None  # edged.quantize.job.VariantJob while or after it runs
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def adapt(self, hw: HardwareFacts) -> str:
        """The hardware changed (an accelerator came or went): switch away at once from a
        backend that is no longer there, then select again for the new hardware (its new
        fingerprint means a fresh measurement) and switch when the pick differs.
        Returns what was done, for the log."""
        usable = {c.key for c in all_candidates(hw, self.selection.model) if c.available}
        done = []
        active = self.worker.session.candidate.key
        if active not in usable:
            moved = self.worker.fail_over(f"{active} is gone", lambda c: c.key in usable)
            done.append(f"{active} gone, " + ("failed over" if moved else "no fallback"))
        selection = select(
            self.original.path,
            hw,
            self.policy,
            self.state_dir,
            variants=self.variants,
            evaluation=self.evaluation,
        )
        done.append(self.apply(selection, hw))
        return "; ".join(done)

    def apply(
        self, selection: Selection, hw: HardwareFacts, variants: tuple[Path, ...] | None = None
    ) -> str:
        """Serve `selection`: its pick is loaded on the model's CPUs and swapped in
        atomically when it is not what runs now; its verified others become the fallbacks.
        Returns what was done, for the log."""
        with self._lock:  # hot-plug and the variants job may both arrive
            options = _load_options(self.policy, self.worker.batching, selection, self.state_dir)
            pick = selection.load_candidate(hw)
            running = getattr(self.worker.session, "model", None)
            done = f"kept {selection.model.name} on {pick.key}"
            if pick.key != self.worker.session.candidate.key or (
                running is not None and running.path != selection.model.path
            ):
                with pinned_thread(self.policy.cpus):
                    session = get_backend(pick.backend).load(selection.model, pick, options)
                self.worker.swap_session(session)
                done = f"switched to {selection.model.name} on {pick.key}"
            self.worker.set_fallbacks(_fallback_provider(self.name, selection, hw, options))
            self.selection = selection
            if variants is not None:
                self.variants = variants
            return done

    @property
    def original(self) -> ModelInfo:
        return self.selection.original or self.selection.model

    def check_shapes(self, inputs: dict) -> None:
        """Inputs at the shapes the backends were verified at, when the config fixes them
        (`shapes`): another size may fail on one backend and not another, and a request
        must not decide which backend a model runs on. The batch dim may vary up to
        max_batch_size. Raises InputError (400) naming the input."""
        if not self.policy.shapes:
            return
        batch = self.worker.batching.max_batch_size
        for name, array in inputs.items():
            want = self.selection.shapes.get(name)
            got = tuple(getattr(array, "shape", ()))
            if want is None:
                continue
            fits = len(got) == len(want) and all(
                g == w or (i == 0 and batch > 1 and 1 <= g <= batch)
                for i, (g, w) in enumerate(zip(got, want, strict=True))
            )
            if not fits:
                shown = "x".join(str(d) for d in want)
                if batch > 1 and want:
                    shown = f"Nx{'x'.join(str(d) for d in want[1:])} (N up to {batch})"
                raise InputError(
                    f"{self.name}: input {name!r} has shape "
                    f"{'x'.join(map(str, got))}; this model is served at "
                    f"{shown} (its configured shapes, which its backends were "
                    f"verified at)"
                )

    @property
    def platform(self) -> str:
        return PLATFORMS.get(self.selection.model.format, self.selection.model.format)

    @property
    def session(self) -> Session:
        return self.worker.session

    def status(self) -> dict:
        sel = self.selection.selected
        session = self.worker.session
        return {
            "name": self.name,
            "path": str(self.selection.model.path),
            "original": str(self.original.path),
            "variants": [str(v) for v in self.variants],
            "model_precision": self.selection.model.precision,
            "backend": session.candidate.backend,
            "device": session.candidate.device,
            "precision": session.info().get("precision"),
            "selected_p99_ms": sel.latency.p99_ms if sel and sel.latency else None,
            "why": self.selection.why,
            "from_cache": self.selection.from_cache,
            "ready": self.worker.alive(),
            "queue_depth": self.worker.queue_depth,
            "batching": self.worker.batchable,
            "failovers": self.worker.failovers,
            "cpus": list(self.worker.cpus) if self.worker.cpus else None,
            "scheduling": self.worker.scheduling,
            "last_error": self.worker.last_error,
            "variants_job": self.job.status() if self.job is not None else None,
        }


def _fallback_provider(name: str, selection: Selection, hw: HardwareFacts, options: LoadOptions):
    """The worker's source of replacement sessions: the selection's other verified
    (variant, candidate) pairs in p99 order, each tried once.

    Each is looked up (with its backend options) only when needed, so serving a cached
    decision imports no runtime but the selected one. The load runs pinned to the model's
    CPUs like the first load: it happens on the worker, supervisor or hot-plug thread, and
    OpenVINO's streams / onnxruntime's pool inherit the loading thread's CPU set."""
    queue = [
        (selection.model_of(e), e.candidate)
        for e in sorted(
            (e for e in selection.evidence if e.status == "passed" and e.latency),
            key=lambda e: e.latency.p99_ms,
        )
    ]

    def next_session(usable: Callable[[Candidate], bool] | None = None) -> Session | None:
        while queue:
            # Listing may be the runtime's first use in this process (creating OpenVINO's
            # Core starts threads), so it is pinned as well.
            model, wanted = queue.pop(0)
            with pinned_thread(options.cpus):
                candidate = next(
                    (
                        c
                        for c in backend_candidates(hw, model, wanted.backend)
                        if c.key == wanted.key
                    ),
                    None,
                )
            if (
                candidate is None
                or not candidate.available
                or (usable is not None and not usable(candidate))
            ):
                continue  # no longer offered here (a device went away)
            try:
                with pinned_thread(options.cpus):
                    return get_backend(candidate.backend).load(model, candidate, options)
            except (ModelError, BackendError) as exc:
                log.warning("%s: fallback %s failed to load: %s", name, candidate.key, exc)
        return None

    return next_session


def _reference_loader(selection: Selection, options: LoadOptions) -> Callable[[], Session]:
    """Loads the served file on the selection's float32 reference runtime, one thread (the
    worker uses it to tell an input's fault from the backend's; see ModelWorker)."""
    from dataclasses import replace as _replace

    from edged.selection.candidates import reference_candidates

    def load() -> Session:
        one = _replace(options, threads=1, cache_dir=None)
        errors = []
        for candidate in reference_candidates(selection.model):
            try:
                with pinned_thread(options.cpus):
                    return get_backend(candidate.backend).load(
                        selection.model, candidate, _replace(one, shapes=None)
                    )
            except (ModelError, BackendError, ImportError) as exc:
                errors.append(f"{candidate.key}: {exc}")
        raise BackendError("; ".join(errors) or "no reference runtime")

    return load


def load_model(
    name: str,
    path: Path,
    policy: Policy,
    batching: BatchingConfig,
    hw: HardwareFacts,
    state_dir: Path,
    config_key: tuple = (),
    on_failover: Callable[[str], None] | None = None,
    period_s: float | None = None,
    variants: tuple[Path, ...] = (),
    calibration: CalibrationSpec | None = None,
) -> ServedModel:
    """Select over the family (or read the cached choice), load the pick and start its
    worker thread. `path` is the original, `variants` its other versions; `calibration`
    data joins the variants made from it earlier (else `variants_pending` says they are
    still to make) and is the evaluation set. `period_s`: a periodic client's period, for
    coordinated-omission correction of latency.

    Raises ModelError / InputError / SelectionError / BackendError with the reason."""
    family, evaluation, pending = tuple(variants), None, False
    if calibration is not None:
        made, evaluation = made_variants(path, calibration, policy, hw, state_dir)
        pending = made is None
        family += tuple(made or ())
    selection = select(path, hw, policy, state_dir, variants=family, evaluation=evaluation)
    options = _load_options(policy, batching, selection, state_dir)
    chosen = selection.load_candidate(hw)
    # Loaded on the model's CPUs: runtimes that create their pools at load time (OpenVINO's
    # streams, onnxruntime's threads without explicit affinities) inherit this thread's set.
    with pinned_thread(policy.cpus):
        session = get_backend(chosen.backend).load(selection.model, chosen, options)
    worker = ModelWorker(
        name,
        session,
        batching,
        policy.cpus,
        _fallback_provider(name, selection, hw, options),
        on_failover,
        LatencyRecorder(name, cores=policy.cpus, period_s=period_s),
        reference=_reference_loader(selection, options),
    )
    worker.start()
    return ServedModel(
        name,
        selection,
        worker,
        config_key,
        policy=policy,
        state_dir=state_dir,
        variants=family,
        evaluation=evaluation,
        calibration=calibration,
        variants_pending=pending,
    )


def made_variants(
    path: Path, calibration: CalibrationSpec, policy: Policy, hw: HardwareFacts, state_dir: Path
) -> tuple[list[Path] | None, Evaluation]:
    """The variants made from `calibration` earlier (None: not made yet) and the
    evaluation set. Reading the data is cheap (decoding a few images); making is not, and
    is the background job's. CalibrationError (an InputError to the caller) names the
    data."""
    from edged.quantize.calibration_spec import CalibrationError
    from edged.quantize.variants import (
        cached_variants,
        evaluation_of,
        load_data,
        settings_for,
        variants_key,
    )

    try:
        calib, evaluation, _ = load_data(path, calibration, dict(policy.shapes or {}))
    except CalibrationError as exc:
        raise InputError(str(exc)) from None
    settings = settings_for(policy, hw)
    made = cached_variants(state_dir, variants_key(path, calib, evaluation, hw, settings))
    return (made.variants if made else None), evaluation_of(evaluation, calibration)


def _load_options(
    policy: Policy, batching: BatchingConfig, selection: Selection, state_dir: Path
) -> LoadOptions:
    return LoadOptions(
        threads=policy.threads,
        cpus=policy.cpus,
        shapes=selection.shapes,
        dynamic_batch=batching.max_batch_size > 1,
        cache_dir=state_dir / "openvino-cache",
    )
