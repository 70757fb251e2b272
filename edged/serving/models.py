"""The served models: selection (cached), the loaded session, its worker and fail-over order."""

from __future__ import annotations

import logging
import math
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
from edged.config import BatchingConfig
from edged.quantize.calibration_spec import CalibrationSpec
from edged.selection.bench import pinned_thread
from edged.selection.candidates import backend_candidates, find_candidate
from edged.selection.decision import Evaluation, Evidence, Selection
from edged.selection.policy import Policy
from edged.selection.select import reverify, select
from edged.serving.engine import ModelWorker
from edged.serving.pictures import Pictures
from edged.telemetry.latency import LatencyRecorder
from edged.trust.verify import active
from sysconf.hardware import HardwareFacts

log = logging.getLogger("edged.serving.models")


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
    job: Any = None  # edged.serving.variant_job.VariantJob while or after it runs
    # Config `standby`: keep the next verified candidate loaded. None: on when the pick is an
    # accelerator and the standby's measured memory fits (`standby_wanted`).
    standby_mode: bool | None = None
    standby_note: str = ""  # why there is no standby, for status
    # Pictures in (Frigate's frames, image inputs) and, for a detector, boxes out; None: the
    # model takes no picture. `serves_as`: the names Frigate's peers may ask for it by.
    pictures: Pictures | None = None
    serves_as: tuple[str, ...] = ()
    trust: list[dict] = field(default_factory=list)  # edged.trust verdicts of its files
    cooling: str = ""  # on a cheaper session while the device cools (edged.thermal): why
    recovering: bool = False  # a re-verification of the pick is running
    last_recovery: float = 0.0  # time.monotonic() of the last attempt
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _recover_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- warm standby and switching back -----------------------------------------------------
    def standby_wanted(self) -> tuple[tuple[ModelInfo, Candidate] | None, str]:
        """The (model, candidate) to keep loaded beside the pick, and why none when none:
        the next verified candidate in p99 order on another device (one on the same NPU
        fails with it); with none (a pinned backend), the original on its float reference
        runtime, the very thing accuracy is judged against."""
        pick = self.selection.selected
        if self.standby_mode is False:
            return None, "off (standby = false)"
        if pick is None:
            return None, "no selection"
        if self.standby_mode is None and not is_accelerator(pick.candidate):
            return None, "off: the pick runs on the CPU (standby = true keeps one anyway)"
        others = [
            e
            for e in _verified(self.selection)
            if e.candidate.device != pick.candidate.device
            or e.candidate.backend != pick.candidate.backend
        ]
        if others:
            best = others[0]
            wanted = (self.selection.model_of(best), best.candidate)
            need = best.rss_growth_bytes or 0  # measured at selection
        else:
            from backends import reference_candidates

            references = reference_candidates(self.original)
            if not references:
                return None, "no other verified candidate, and the original has no reference"
            wanted = (self.original, references[0])
            need = self.original.size  # its weights: an estimate, it was not measured
        if self.standby_mode is None:
            import psutil

            available = psutil.virtual_memory().available
            if need > available * STANDBY_MEMORY_SHARE:
                return None, (
                    f"off: {wanted[1].key} needs about {need / 2**20:.0f} MiB, more than "
                    f"{STANDBY_MEMORY_SHARE:.0%} of the {available / 2**20:.0f} MiB "
                    f"available (standby = true keeps it anyway)"
                )
        return wanted, ""

    def load_standby(self, hw: HardwareFacts) -> str:
        """Load and warm the standby (one run of its model, so its first request is not a
        compile), or say why there is none. Returns what was done, for the log."""
        wanted, why = self.standby_wanted()
        if wanted is None:
            self.standby_note = why
            self.worker.set_standby(None)
            return f"no standby: {why}"
        model, wanted_candidate = wanted
        current = self.worker.standby
        if current is not None and current.candidate.key == wanted_candidate.key:
            return f"standby {wanted_candidate.key} kept"
        options = _load_options(self.policy, self.worker.batching, self.selection, self.state_dir)
        try:
            with pinned_thread(self.policy.cpus):
                candidate = find_candidate(hw, model, wanted_candidate)
                session = load_session(model, candidate, options)
                try:
                    _warm_up(session, self.selection)
                except BaseException:
                    session.close()
                    raise
        except Exception as exc:  # serving goes on without a standby; status says why
            self.standby_note = f"{wanted_candidate.key} did not load: {exc}"
            return f"no standby: {self.standby_note}"
        self.worker.set_standby(session)
        self.standby_note = ""
        return f"standby {candidate.key} loaded"

    def recover(self, hw: HardwareFacts) -> str | None:
        """Back to the pick after a fall-back, once its device is offered again and it
        passes verification against the original once more; the session serving meanwhile
        becomes the standby again. Runs on a thread of its own (a recompile can take
        minutes): serving goes on meanwhile. None when not degraded."""
        if not self.worker.degraded or self.cooling:  # a cooling model goes back by itself
            return None
        if not self._recover_lock.acquire(blocking=False):
            return "a re-verification of the pick is already running"
        try:
            return self._recover(hw)
        finally:
            self._recover_lock.release()

    def _recover(self, hw: HardwareFacts) -> str | None:
        self.last_recovery = time.monotonic()
        selection = self.selection
        pick = selection.selected
        assert pick is not None
        model = selection.model_of(pick)
        offered = next(  # as its backend lists it now: a device that is gone is not listed
            (
                c
                for c in backend_candidates(hw, model, pick.candidate.backend)
                if c.key == pick.candidate.key and c.available
            ),
            None,
        )
        if offered is None or offered.key != self.worker.primary:
            return f"{self.worker.primary} is not offered here yet"
        options = _load_options(self.policy, self.worker.batching, selection, self.state_dir)
        self.recovering = True
        try:
            ev, session = reverify(selection, offered, hw, self.policy, options, self.evaluation)
        finally:
            self.recovering = False
        if session is None:
            return f"{offered.key} did not verify again: {ev.reason}"
        with self._lock:
            if self.selection is not selection or self.worker.stopping:
                session.close()  # selected anew, or reloaded, meanwhile: that decides
                return "the model was selected anew or stopped meanwhile; not switched back"
            self.worker.swap_session(session, primary=True, keep_as_standby=True)
            self.worker.set_fallbacks(_fallback_provider(self.name, selection, hw, options))
            wanted, _ = self.standby_wanted()
            standby = self.worker.standby
            if wanted is None or (standby is not None and standby.candidate.key != wanted[1].key):
                self.worker.set_standby(None)  # not the one the policy keeps
        score = f"{ev.accuracy.rule} {ev.accuracy.score:.4f}" if ev.accuracy else "passed"
        return f"switched back to {offered.key} (verified again against the original: {score})"

    def adapt(self, hw: HardwareFacts) -> str:
        """The hardware changed (an accelerator came or went). A backend that is no longer
        there is switched away from at once (to the warm standby when there is one). When
        the pick's own device came back, it is verified again and serves again
        (`recover`); while it stays away, the model serves on its fall-back, degraded. Any
        other change selects again for the new hardware (its new fingerprint means a fresh
        measurement) and switches when the pick differs. Returns what was done, for the log."""
        usable = self._usable(hw)
        done = []
        active = self.worker.session.candidate.key
        if active not in usable:
            moved = self.worker.fail_over(f"{active} is gone", lambda c: c.key in usable)
            done.append(f"{active} gone, " + ("failed over" if moved else "no fallback"))
        if self.worker.degraded:
            if self.worker.primary in usable:
                done.append(self.recover(hw) or "not degraded")
            else:
                done.append(
                    f"serving on {self.worker.session.candidate.key} until "
                    f"{self.worker.primary} returns"
                )
            return "; ".join(done)
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

    def _usable(self, hw: HardwareFacts) -> set[str]:
        """The candidate keys available on `hw` for some model of the family (a standby may
        run the original while the pick runs a variant only an NPU reads). Only the backends
        the model has used are asked: listing another's candidates may import its runtime
        (creating OpenVINO's Core holds the GIL for most of a second)."""
        worker = self.worker
        names = {
            e.candidate.backend
            for e in self.selection.evidence
            if e.status in ("passed", "selected")
        }
        names |= {s.candidate.backend for s in (worker.session, worker.standby) if s is not None}
        members = (self.selection.model, self.original, *self.selection.models.values())
        models = {m.path: m for m in members}
        return {
            c.key
            for m in models.values()
            for name in sorted(names)
            for c in backend_candidates(hw, m, name)
            if c.available
        }

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
                    session = load_session(selection.model, pick, options)
                self.worker.swap_session(session, keep_as_standby=True)
                done = f"switched to {selection.model.name} on {pick.key}"
            self.worker.set_fallbacks(_fallback_provider(self.name, selection, hw, options))
            self.selection = selection
            self.worker.primary = pick.key
            done += "; " + self.load_standby(hw)
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
        from backends.formats import platform_of

        return platform_of(self.selection.model.format)

    @property
    def session(self) -> Session:
        return self.worker.session

    def status(self) -> dict:
        sel = self.selection.selected
        session = self.worker.session
        standby = self.worker.standby
        info = session.info()
        return {
            "name": self.name,
            "path": str(self.selection.model.path),
            "original": str(self.original.path),
            "variants": [str(v) for v in self.variants],
            "model_precision": self.selection.model.precision,
            "backend": session.candidate.backend,
            "device": session.candidate.device,
            # What the runtime says really ran it (OpenVINO's execution devices, a
            # delegate's share of the graph, the NPU core mask), beside the label.
            "device_used": device_used(session.candidate, info),
            "precision": info.get("precision"),
            "pick": self.worker.primary,
            "degraded": self.worker.degraded,
            "standby": standby.candidate.key if standby is not None else None,
            "standby_note": self.standby_note if standby is None else "",
            "recovering": self.recovering,
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
            "trust": self.trust,
            "cooling": self.cooling or None,
            "admission": self.worker.gate.to_dict() if self.worker.gate is not None else None,
        }

    def load_options(self) -> LoadOptions:
        """How this model's sessions are loaded (threads, CPUs, shapes, caches)."""
        return _load_options(self.policy, self.worker.batching, self.selection, self.state_dir)


# The most of the available memory a standby may take when `standby` is left to edged.
STANDBY_MEMORY_SHARE = 0.25


def is_accelerator(candidate: Candidate) -> bool:
    """Not the CPU itself, as the candidate's backend declares (`CPU_DEVICES`)."""
    from backends import runs_on_cpu

    return not runs_on_cpu(candidate)


def device_used(candidate: Candidate, info: dict[str, Any]) -> str:
    """One line on the device a session really runs on, from what its runtime reports."""
    if info.get("execution_devices"):
        return ", ".join(map(str, info["execution_devices"]))
    if "delegate_coverage" in info and is_accelerator(candidate):
        share = info["delegate_coverage"]
        return f"{candidate.device} ({share:.0%} of the graph; the rest on the CPU)"
    if info.get("device"):
        return str(info["device"])
    return candidate.device


def _verified(selection: Selection) -> list[Evidence]:
    """The selection's verified candidates other than the pick, in p99 order."""
    return sorted(
        (e for e in selection.evidence if e.status == "passed" and e.latency),
        key=lambda e: e.latency.p99_ms if e.latency else math.inf,
    )


def _warm_up(session: Session, selection: Selection) -> None:
    """One run at the served shapes: a runtime that compiles lazily does it now, not on the
    first request after a fail-over."""
    from edged.selection.inputs import make_inputs, resolve_shapes

    shapes = resolve_shapes(session.inputs, selection.shapes or None, selection.model.name)
    session.run(make_inputs(session.inputs, shapes, 0))


def _fallback_provider(name: str, selection: Selection, hw: HardwareFacts, options: LoadOptions):
    """The worker's source of replacement sessions: the selection's other verified
    (variant, candidate) pairs in p99 order, each tried once.

    Each is looked up (with its backend options) only when needed, so serving a cached
    decision imports no runtime but the selected one. The load runs pinned to the model's
    CPUs like the first load: it happens on the worker, supervisor or hot-plug thread, and
    OpenVINO's streams / onnxruntime's pool inherit the loading thread's CPU set."""
    queue = [(selection.model_of(e), e.candidate) for e in _verified(selection)]

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
                    return load_session(model, candidate, options)
            except (ModelError, BackendError) as exc:
                log.warning("%s: fallback %s failed to load: %s", name, candidate.key, exc)
        return None

    return next_session


def load_session(model, candidate: Candidate, options: LoadOptions) -> Session:
    """A session of `model` on `candidate`, once the file is checked again against
    [security] models (edged.trust: a stat when unchanged; refused under enforce when it
    changed to something untrusted, as at its first load)."""
    active().recheck(model.path)
    return get_backend(candidate.backend).load(model, candidate, options)


def _reference_loader(selection: Selection, options: LoadOptions) -> Callable[[], Session]:
    """Loads the served file on the selection's float32 reference runtime, one thread (the
    worker uses it to tell an input's fault from the backend's; see ModelWorker)."""
    from dataclasses import replace as _replace

    from backends import reference_candidates

    # A model only an NPU reads has no reference of its own: its original's is used.
    model = selection.model
    if not reference_candidates(model) and selection.original is not None:
        model = selection.original

    def load() -> Session:
        one = _replace(options, threads=1, cache_root=None)
        errors = []
        for candidate in reference_candidates(model):
            try:
                with pinned_thread(options.cpus):
                    return load_session(model, candidate, _replace(one, shapes=None))
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
    standby: bool | None = None,
) -> ServedModel:
    """Select over the family (or read the cached choice), load the pick and start its
    worker thread. `path` is the original, `variants` its other versions; `calibration`
    data joins the variants made from it earlier (else `variants_pending` says they are
    still to make) and is the evaluation set. `standby`: keep the next verified candidate
    loaded (None: when the pick is an accelerator and memory allows). `period_s`: a
    periodic client's period, for coordinated-omission correction of latency.

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
        session = load_session(selection.model, chosen, options)
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
    served = ServedModel(
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
        standby_mode=standby,
    )
    outcome = served.load_standby(hw)
    log.info("model %s: %s", name, outcome)
    return served


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
    for variant in made.variants if made else ():  # served only while their origin is trusted
        active().require_made(variant, path, f"variant made from {path.name}")
    return (made.variants if made else None), evaluation_of(evaluation, calibration)


def _load_options(
    policy: Policy, batching: BatchingConfig, selection: Selection, state_dir: Path
) -> LoadOptions:
    return LoadOptions(
        threads=policy.threads,
        cpus=policy.cpus,
        shapes=selection.shapes,
        shapes_bind=bool(policy.shapes),
        dynamic_batch=batching.max_batch_size > 1,
        cache_root=state_dir,
        backend_options=policy.backend_options,
    )
