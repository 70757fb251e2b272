"""The telemetry loop: every interval, one payload per device with each model's latency window
(with outliers attributed to their causes), thermals and system load, handed to the publisher
(MQTT with store-and-forward, or the log). Runs on a housekeeping thread; the inference path
only records into histograms.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from edged.latency import CoreSampler
from edged.serving import ServedModel
from sysconf import SysRoot
from sysconf.thermal import CpuUseSampler, read_system, read_thermal

log = logging.getLogger("edged.telemetry")

SAMPLER_HZ = 20  # per-CPU counter samples for outlier attribution (≈0.3 % of a core here)


class TelemetrySink(Protocol):
    def publish_telemetry(self, payload: dict) -> None: ...

    def publish_event(self, kind: str, detail: dict) -> None: ...


class TelemetryLoop:
    def __init__(self, interval_s: float, models: Callable[[], Mapping[str, ServedModel]],
                 sink: TelemetrySink, root: SysRoot | None = None,
                 sampler: CoreSampler | None = None) -> None:
        self.interval_s = interval_s
        self._models = models
        self._sink = sink
        self._root = root or SysRoot()
        self._sampler = sampler
        self._cpu_use = CpuUseSampler()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._throttling = False
        self.payloads = 0

    def start(self) -> None:
        if self._sampler is not None:
            self._sampler.start()
        read_system(self._root, self._cpu_use)  # the first CPU-use sample is the baseline
        self._thread = threading.Thread(target=self._loop, name="edged-telemetry",
                                        daemon=True)
        self._thread.start()

    def stop(self, flush: bool = True) -> None:
        """Stop; with `flush`, publish the partial last window so a clean stop loses none."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if flush:
            self._publish_once()
        if self._sampler is not None:
            self._sampler.stop()

    def _loop(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            self._publish_once()
            next_at += self.interval_s
            if next_at < time.monotonic():  # fell behind (suspend, overload): skip, do not burst
                next_at = time.monotonic() + self.interval_s

    def _publish_once(self) -> None:
        try:
            payload = self.collect()
        except Exception:  # a broken reading must not end telemetry: log it, try next time
            log.exception("telemetry: collecting failed")
            return
        self._sink.publish_telemetry(payload)
        self.payloads += 1
        throttling = bool(payload["thermal"].get("throttling"))
        if throttling != self._throttling:
            self._throttling = throttling
            self._sink.publish_event("throttling", {
                "throttling": throttling, "hottest": payload["thermal"].get("hottest")})

    def collect(self) -> dict[str, Any]:
        models: dict[str, Any] = {}
        for name, served in self._models().items():
            recorder = served.worker.recorder
            if recorder is None:
                continue
            stats = recorder.rotate(self._sampler).to_payload()
            candidate = served.worker.session.candidate
            stats["backend"] = f"{candidate.backend}:{candidate.device}"
            stats["queue_depth"] = served.worker.queue_depth
            models[name] = stats
        return {
            "interval_s": self.interval_s,
            "models": models,
            "thermal": read_thermal(self._root).to_dict(),  # incl. hottest, throttling
            "system": read_system(self._root, self._cpu_use).to_dict(),
        }
