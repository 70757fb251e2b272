"""The daemon's thermal admission ([thermal] admission = "on"): a thread reads the watched
zones' headroom every `interval_s` and moves each model along its ladder (edged.thermal.
ladder). Each step is what the step above it did, and more:

- cheaper: the model serves on the cheaper way to run it (edged.serving.cheaper), loaded
  beside the running session and swapped in between batches; the session it replaces is
  kept as the standby, so the way back is a swap too. No request is refused or lost.
- limit: the model admits `limit_share` of the request rate it had before (a token bucket);
  the rest get 503 with Retry-After.
- shed: every request gets 503 with Retry-After until the device cools.

Every step is an event (log EVENT=thermal_step, the MQTT event `thermal`) with the headroom,
the zone and what was done, and shows in the status (`thermal`, and each model's `cooling`
and `admission`) and on /metrics."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edged.selection.bench import pinned_thread
from edged.serving.admission import Gate
from edged.serving.cheaper import cheaper_plan
from edged.serving.models import load_session
from edged.thermal.ladder import STEPS, Ladder
from edged.thermal.settings import ThermalConfig
from sysconf.headroom import Headroom, HeadroomWatch
from sysconf.sysroot import SysRoot

if TYPE_CHECKING:
    from edged.serving.models import ServedModel
    from sysconf.hardware import HardwareFacts

log = logging.getLogger("edged.thermal")
RATE_WINDOW_S = 10.0  # the request rate a limit is a share of: over this long before it


class ModelCare:
    """One model's ladder, its gate and the admitted counts its rate is read from."""

    def __init__(self, name: str, config: ThermalConfig) -> None:
        self.ladder = Ladder(config.thresholds, config.hysteresis, config.hold_s)
        self.gate = Gate(name, config.retry_after_s)
        self.since = time.time()
        self.action = ""
        self._counts: collections.deque[tuple[float, int]] = collections.deque()

    def count(self, now: float) -> None:
        self._counts.append((now, self.gate.admitted))
        while self._counts and now - self._counts[0][0] > RATE_WINDOW_S:
            self._counts.popleft()

    def rate(self) -> float:
        if len(self._counts) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._counts[0], self._counts[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.ladder.name, "since": round(self.since, 3), "action": self.action}


class ThermalGovernor:
    def __init__(
        self,
        config: ThermalConfig,
        models: Callable[[], dict[str, ServedModel]],
        hw: Callable[[], HardwareFacts | None],
        event: Callable[..., None],
    ) -> None:
        self.config = config
        self.watch = HeadroomWatch(SysRoot.at(config.root), config.zones, config.band_c)
        self._models = models
        self._hw = hw
        self._event = event
        self.cares: dict[str, ModelCare] = {}
        self.last: Headroom | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="edged-thermal", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick(time.monotonic())
            except Exception:  # never take serving down; say it and keep watching
                log.exception("thermal admission: reading or acting failed")
            self._stop.wait(self.config.interval_s)

    def tick(self, now: float) -> None:
        headroom = self.last = self.watch.read()
        models = self._models()
        for name in set(self.cares) - set(models):
            del self.cares[name]  # unloaded: its gate went with its worker
        for name, served in models.items():
            care = self.cares.get(name)
            if care is None or served.worker.gate is not care.gate:
                care = self.cares[name] = ModelCare(name, self.config)  # new, or reloaded
                served.worker.gate = care.gate
            before = care.ladder.step
            if before < 2:
                care.count(now)
            step = care.ladder.update(headroom.device, now)
            if step is not None:
                self._act(served, care, before, step, headroom)

    def _act(self, served: ServedModel, care: ModelCare, before: int, step: int, h: Headroom):
        zone = h.hottest
        where = "headroom unknown"
        if zone is not None and h.device is not None:
            where = f"headroom {h.device:.2f} ({zone.type or zone.zone} at {zone.temp_c:g} °C)"
        done = []
        if step >= 1 and not served.cooling:
            done.append(self._cheaper(served))
        elif step == 0 and served.cooling:
            done.append(self._restore(served))
        if step == 3:
            care.gate.set("shut", where)
            done.append("refusing every request (503, Retry-After)")
        elif step == 2:
            rate = max(1.0, self.config.limit_share * care.rate())
            care.gate.set("limit", where, rate)
            done.append(f"admitting {rate:.3g} requests/s (503, Retry-After past it)")
        elif before >= 2:
            care.gate.set("open")
            done.append("admitting every request again")
        care.since, care.action = time.time(), "; ".join(done)
        message = f"model {served.name}: {STEPS[before]} -> {STEPS[step]} at {where}: {care.action}"
        self._event(
            "thermal_step",
            message,
            model=served.name,
            step=STEPS[step],
            previous=STEPS[before],
            headroom=h.device,
            zone=zone.type or zone.zone if zone else None,
            temp_c=zone.temp_c if zone else None,
            action=care.action,
        )

    def _cheaper(self, served: ServedModel) -> str:
        plan = cheaper_plan(served, self._hw())
        if plan is None:
            return "no cheaper verified way to run it: serving as before"
        try:
            with pinned_thread(served.policy.cpus):
                session = load_session(plan.model, plan.candidate, plan.options)
        except Exception as exc:  # serving goes on as before
            return f"the cheaper {plan.why} did not load: {exc}"
        served.worker.swap_session(session, primary=False, keep_as_standby=True)
        served.cooling = plan.why
        return f"serving on {plan.why}"

    def _restore(self, served: ServedModel) -> str:
        was, served.cooling = served.cooling, ""
        if not served.worker.promote_standby():
            return f"back from {was}: no pick kept to go back to (serving as it is)"
        hw = self._hw()
        standby = served.load_standby(hw) if hw is not None else "no standby"
        return f"back to the pick {served.worker.primary} (was {was}); {standby}"

    def status(self) -> dict[str, Any]:
        return {
            "admission": self.config.admission,
            "headroom": self.last.to_dict() if self.last is not None else None,
            "models": {name: care.to_dict() for name, care in sorted(self.cares.items())},
        }


def start_thermal(config: ThermalConfig, models, hw, event) -> ThermalGovernor | None:
    """The governor, started, when [thermal] admission is on; None otherwise."""
    if config.admission != "on":
        return None
    governor = ThermalGovernor(config, models, hw, event)
    governor.start()
    return governor
