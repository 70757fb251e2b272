"""The telemetry loop: every interval, one payload per device with each model's latency window
(with outliers attributed to their causes) and its since-start figures, thermals, system load
and the intrusion rates on the inference cores, handed to the publisher (MQTT with
store-and-forward, or the log). Runs on a housekeeping thread; the inference path only
records into histograms.
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
from sysconf.intrusions import interrupts_per_cpu, softirqs_per_cpu, thread_switches
from sysconf.thermal import CpuUseSampler, read_system, read_thermal

log = logging.getLogger("edged.telemetry")

SAMPLER_HZ = 20  # per-CPU counter samples for outlier attribution (≈0.3 % of a core here)
SINCE_START_KEYS = ("count", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms",
                    "stdev_ms", "jitter_ms")


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
        # The last counter readings, for rates: (t, cpu -> irqs, cpu -> softirqs) and
        # model -> (t, involuntary switches of its worker thread).
        self._cpu_counts: tuple[float, dict[int, int], dict[int, int]] | None = None
        self._worker_counts: dict[str, tuple[float, int, int]] = {}
        self.payloads = 0

    def start(self) -> None:
        if self._sampler is not None:
            # Outliers are attributed when a window closes, so the sampler's ring must
            # still hold the window's first samples then (and one period either side).
            self._sampler.ensure_horizon(self.interval_s + 1.0)
            self._sampler.start()
        read_system(self._root, self._cpu_use)  # the first CPU-use sample is the baseline
        self._intrusions(self._models())  # and the first counter readings, for the rates
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
            total = recorder.since_start(include_open=False).total.to_payload()
            stats["since_start"] = {key: total[key] for key in SINCE_START_KEYS}
            candidate = served.worker.session.candidate
            stats["backend"] = f"{candidate.backend}:{candidate.device}"
            stats["queue_depth"] = served.worker.queue_depth
            models[name] = stats
        system = read_system(self._root, self._cpu_use).to_dict()
        system["intrusions"] = self._intrusions(self._models())
        return {
            "interval_s": self.interval_s,
            "models": models,
            "thermal": read_thermal(self._root).to_dict(),  # incl. hottest, throttling
            "system": system,
        }

    def _intrusions(self, models: Mapping[str, ServedModel]) -> dict[str, Any]:
        """What interrupted inference since the last payload, as rates: hard interrupts and
        softirqs per second on each inference core (the models' pinned CPUs; every CPU when
        none is pinned) and involuntary context switches per second of each model's worker
        thread. The same kernel counters /metrics exports as totals; here as rates so a
        fleet view needs no second reading. Rates are null until two readings exist.

        The CPU counters come from the attribution sampler's newest sample when it runs
        (no second parse of /proc/interrupts), else from /proc directly."""
        latest = self._sampler.latest() if self._sampler is not None else None
        if latest is not None:
            t, irqs, soft = latest.t, latest.irqs, latest.softirqs
        else:
            t = time.perf_counter()
            irqs, soft = interrupts_per_cpu(self._root), softirqs_per_cpu(self._root)
        softs = {cpu: sum(kinds.values()) for cpu, kinds in soft.items()}
        pinned = sorted({cpu for served in models.values()
                         for cpu in (served.worker.cpus or ())})
        previous, self._cpu_counts = self._cpu_counts, (t, irqs, softs)
        span = None if previous is None else t - previous[0]
        cpus: dict[str, Any] = {}
        for cpu in pinned or sorted(irqs):
            rate_irq = rate_soft = None
            if span and span > 0 and previous is not None:
                if cpu in irqs and cpu in previous[1]:
                    rate_irq = round((irqs[cpu] - previous[1][cpu]) / span, 1)
                if cpu in softs and cpu in previous[2]:
                    rate_soft = round((softs[cpu] - previous[2][cpu]) / span, 1)
            cpus[str(cpu)] = {"interrupts_per_s": rate_irq, "softirqs_per_s": rate_soft}
        workers: dict[str, Any] = {}
        now = time.perf_counter()
        for name, served in models.items():
            tid = served.worker.native_id
            counts = thread_switches(tid, root=self._root) if tid else None
            before = self._worker_counts.pop(name, None)
            rate = None
            if counts is not None:
                self._worker_counts[name] = (now, tid, counts.involuntary)
                # A reload or take-over replaces the worker thread: its counter starts anew,
                # so no rate until two readings of the same thread.
                if before is not None and before[1] == tid and now > before[0]:
                    rate = round((counts.involuntary - before[2]) / (now - before[0]), 2)
            workers[name] = {"involuntary_switches_per_s": rate}
        return {"span_s": None if span is None else round(span, 3),
                "scope": "inference" if pinned else "all", "cpus": cpus, "workers": workers}
