"""The daemon's care of what it serves, while it serves: systemd's watchdog pings only while
every worker is alive and unhung, fail-over when a backend stalls, switch-back when a failed
pick works again, re-adapting every model when the hardware changes (hot-plug), and the
background variant jobs whose decisions are swapped in. A mixin of `edged.daemon.Daemon`,
which holds the state named below."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.config import Config
    from edged.sdnotify import Notifier
    from edged.serving.metrics import ServingMetrics
    from edged.serving.models import ServedModel
    from sysconf.hardware import HardwareFacts

log = logging.getLogger("edged")

SUPERVISE_S = 0.1  # how often stalled backends are looked for, at the most
SUPERVISE_MAX_S = 1.0  # and at the least
RECOVER_S = 30.0  # how often a model on a fall-back tries its pick again


class Supervision:
    # Daemon's, set in its __init__ (declared here for the reader and the type checker).
    config: Config
    models: dict[str, ServedModel]
    failed: dict[str, str]
    hw: HardwareFacts
    notifier: Notifier
    _reload_lock: asyncio.Lock | None
    _swap_lock: threading.Lock
    _allowed: set[int]
    housekeeping: list[int] | None
    _spawn: Callable[[Coroutine[Any, Any, None]], None]
    _event: Callable[..., None]
    metrics: ServingMetrics
    tuning: Any
    thermal: Any = (
        None  # edged.serving.thermal_admission.ThermalGovernor while [thermal] admission is on
    )

    def start_thermal(self) -> None:
        from edged.serving.thermal_admission import start_thermal

        config = self.config.thermal
        self.thermal = start_thermal(config, lambda: self.models, lambda: self.hw, self._event)

    def stop_thermal(self) -> None:
        if self.thermal is not None:
            self.thermal.stop()

    def care_status(self) -> dict[str, Any]:
        """The loops that act on what telemetry sees: the tuning loop and thermal admission."""
        return {
            "tuning": self.tuning.status() if self.tuning is not None else None,
            "thermal": self.thermal.status() if self.thermal is not None else None,
        }

    def _failover_hook(self, name: str) -> Callable[[str], None]:
        """What a model's worker calls when it fails over: counted, and told to the fleet."""
        counter = self.metrics.failovers.labels(name)

        def on_failover(reason: str) -> None:  # called from the worker or supervisor thread
            counter.inc()
            served = self.models.get(name)
            detail: dict[str, Any] = {"reason": reason}
            if served is not None:
                worker = served.worker
                detail |= {
                    "to": worker.session.candidate.key,
                    "pick": worker.primary,
                    "degraded": worker.degraded,
                }
            # Logged where it happened (edged.serving.failover, event "failover"); here
            # the fleet hears of it.
            self._event("backend_switch", None, model=name, **detail)

        return on_failover

    def _on_hotplug(self, action: str, path: str) -> None:
        self._spawn(self._hardware_changed(action, path))

    async def _hardware_changed(self, action: str, path: str) -> None:
        """Re-probe; when what decides backend speed changed, let every model adapt (in a
        thread: it may load a backend and measure). Serialized with reloads."""
        from backends import probe_hardware

        assert self._reload_lock is not None
        async with self._reload_lock:
            hw = await asyncio.to_thread(probe_hardware)
            if hw.fingerprint() == self.hw.fingerprint():
                return
            log.info(
                "hardware changed (%s %s): %s",
                action,
                path,
                ", ".join(a.name for a in hw.accelerators) or "no accelerators",
            )
            self.hw = hw
            for served in list(self.models.values()):
                try:
                    outcome = await asyncio.to_thread(served.adapt, hw)
                except Exception as exc:  # keep serving what runs; say why it did not adapt
                    outcome = f"could not adapt: {exc}"
                self._event(
                    "hardware_change",
                    f"model {served.name}: {outcome}",
                    model=served.name,
                    outcome=outcome,
                    action=action,
                    device=path,
                )
                self.notifier.notify(f"STATUS={self._status_line()}")

    def _status_line(self) -> str:
        text = f"serving {len(self.models)} model(s)"
        degraded = sorted(name for name, m in self.models.items() if m.worker.degraded)
        if degraded:
            text += f"; degraded (on a fall-back): {', '.join(degraded)}"
        if self.failed:
            text += f"; not loaded: {', '.join(sorted(self.failed))}"
        return text

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 only while every worker thread is alive and none is hung, so systemd
        restarts a daemon whose inference path died even though its HTTP side answers. Hung:
        one batch running longer than `[server] hang_s` (past every model's watchdog_ms, so
        fail-over had its chance)."""
        while True:
            workers = [m.worker for m in self.models.values()]
            hang_s = self.config.server.hang_s
            if all(w.alive() and not w.stalled(hang_s) for w in workers):
                self.notifier.notify("WATCHDOG=1")
            else:
                log.error("a worker is dead or hung; withholding watchdog pings")
            await asyncio.sleep(interval)

    async def _supervise(self) -> None:
        """Fail a model over when its backend stalls (a batch over the model's watchdog_ms).
        The take-over loads the next backend, so it runs in a thread, one at a time. A
        model serving on a fall-back while its pick's device is still listed (it failed or
        hung, it was not unplugged) tries its pick again every RECOVER_S, in the background."""
        while True:
            for served in list(self.models.values()):
                worker = served.worker
                if worker.stalled(worker.batching.watchdog_ms / 1000.0):
                    await asyncio.to_thread(worker.take_over_if_stalled)
                elif (
                    worker.degraded
                    and not served.recovering
                    and time.monotonic() - served.last_recovery > RECOVER_S
                ):
                    served.last_recovery = time.monotonic()
                    self._spawn(self._recover(served))
            await asyncio.sleep(self._supervise_interval())

    def _supervise_interval(self) -> float:
        """While a batch runs: a tenth of the shortest watchdog_ms (a stall is seen at most
        10 % late), within SUPERVISE_S and SUPERVISE_MAX_S. While none runs, nothing can be
        stalled before a whole watchdog_ms has passed (a batch starting now is the earliest),
        so the next look is that far off, at most RECOVER_S: an idle daemon's supervisor
        wakes once per watchdog_ms (5 s by default), not twice a second."""
        workers = [m.worker for m in self.models.values()]
        shortest = min((w.batching.watchdog_ms / 1000.0 for w in workers), default=10.0)
        if not any(w.busy for w in workers):
            return min(RECOVER_S, max(SUPERVISE_S, shortest))
        return min(SUPERVISE_MAX_S, max(SUPERVISE_S, shortest / 10))

    async def _recover(self, served: ServedModel) -> None:
        """Re-verify a degraded model's pick on a thread (a recompile may take minutes;
        serving goes on), and say what came of it."""
        try:
            outcome = await asyncio.to_thread(served.recover, self.hw)
        except Exception as exc:  # keep serving on the fall-back; say why
            outcome = f"could not switch back: {exc}"
        if outcome is None:
            return
        if served.worker.degraded:
            log.info("model %s: %s", served.name, outcome)
        else:
            self._event(
                "backend_restored",
                f"model {served.name}: {outcome}",
                model=served.name,
                to=served.worker.primary,
                outcome=outcome,
            )
            self.notifier.notify(f"STATUS={self._status_line()}")

    def start_variant_jobs(self) -> None:
        """The background jobs for the models whose variants are still to make (see
        edged.serving.variant_job). Called after READY: readiness never waits for them."""
        from edged.serving.variant_job import start_variant_jobs

        start_variant_jobs(
            self.models,
            self.config,
            self.housekeeping or sorted(self._allowed),
            self._variants_made,
        )

    def _variants_made(self, served: ServedModel, report: dict[str, Any]) -> str:
        """The job's decision (stored under the served policy's key) swapped in, in the
        job's thread, if the model is still the one served (checked under the swap lock:
        a model unloaded or replaced meanwhile is stopped only after this swap, or this
        swap sees it gone)."""
        from edged.serving.variant_job import stored_decision

        with self._swap_lock:
            if self.models.get(served.name) is not served:
                return "the model was reloaded or unloaded meanwhile; it decides anew"
            selection, variants = stored_decision(served, report, self.config.server.state_dir)
            done = served.apply(selection, self.hw, variants)
        served.variants_pending = False
        self._event(
            "selection",
            f"model {served.name}: {done}; {selection.why}",
            model=served.name,
            result=done,
            why=selection.why,
        )
        return done
