"""The telemetry loop: every interval, one payload per device with each model's latency window
(with outliers attributed to their causes, and the threads that ran on the model's cores when
some were preempted) and its since-start figures, thermals, system load and the intrusion
rates on the inference cores, handed to the publisher (MQTT with store-and-forward, or the
log: `LogSink`). Runs on a housekeeping thread; the inference path only records into
histograms.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import orjson

from edged.telemetry.energy_share import per_inference_mj
from edged.telemetry.sampler import CoreSampler, name_thread
from edged.telemetry.summary import BatchingSummary
from sysconf import SysRoot
from sysconf.energy import EnergyMeter
from sysconf.intrusions import (
    CounterTable,
    TaskScan,
    interrupt_table,
    intruders,
    scan_tasks,
    softirq_table,
    thread_switches,
)
from sysconf.thermal import CpuUseSampler, read_system, read_thermal

log = logging.getLogger("edged.telemetry.loop")

INTRUDER_PROBE_S = 0.25  # first preempted window: two task scans this far apart
INTRUDER_SCAN_EVERY_S = 10.0  # at most one task scan (or probe) in this long
TOP_INTRUDERS = 5
PAYLOAD_FILE_MAX_BYTES = 10 * 2**20  # the JSON-lines file is renamed to <file>.1 past this
SINCE_START_KEYS = (
    "count",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "p999_ms",
    "max_ms",
    "mean_ms",
    "stdev_ms",
    "jitter_ms",
)


class ServedWorker(Protocol):
    """What the loop reads of a model's worker (edged.serving.engine.ModelWorker): telemetry
    sits below serving, so it names the shape it needs rather than the class."""

    recorder: Any  # edged.telemetry.latency.LatencyRecorder, or None before the first run
    batching: Any  # its BatchingConfig (max_queue_delay_us)
    batchable: bool
    session: Any  # the backend session (candidate, sensors)
    batches_run: int  # batches run since start

    @property
    def degraded(self) -> bool: ...

    @property
    def queue_depth(self) -> int: ...

    cpus: Any  # the CPUs it is pinned to, or None
    native_id: int | None  # its thread id, once it runs


class Served(Protocol):
    """A served model, as far as telemetry reads it (edged.serving.models.ServedModel)."""

    @property
    def worker(self) -> ServedWorker: ...


class TelemetrySink(Protocol):
    # What they return is theirs (a publisher answers a message id); the loop ignores it.
    def publish_telemetry(self, payload: dict[str, Any]) -> object: ...

    def publish_event(self, kind: str, detail: dict[str, Any]) -> object: ...


class IntruderWatch:
    """Names the threads that ran on a model's cores in a window with preempted outliers:
    two scans of every thread's /proc stat (last CPU, utime + stime), and the ones last seen
    on those cores that used CPU time between them.

    Cost is paid only for such windows, and bounded: one scan (≈25 µs a thread: 2-3 ms for
    the dev VM's ~100, ~10 ms for a board's 400) when the window before had preemption too,
    since that scan is the baseline and a persisting intruder is measured over the whole
    span; else two scans `INTRUDER_PROBE_S` apart (what is on the core right after the
    window). At most one scan or probe every `every_s` (so 1 Hz telemetry under constant
    preemption scans every 10 s, the span then covering several windows; the windows in
    between name no one). A window without preemption drops the baseline. At most
    `MAX_TASKS` threads a scan."""

    def __init__(
        self,
        root: SysRoot | None = None,
        probe_s: float = INTRUDER_PROBE_S,
        top: int = TOP_INTRUDERS,
        wait: Callable[[float], Any] = time.sleep,
        every_s: float = INTRUDER_SCAN_EVERY_S,
    ) -> None:
        self._root = root or SysRoot()
        self._probe_s = probe_s
        self._top = top
        self._wait = wait
        self._every_s = every_s
        self._baseline: TaskScan | None = None
        self._last_scan = -math.inf  # time.monotonic() of the last scan
        self.scans = 0
        self.scan_s = 0.0  # time spent scanning, in total

    def _scan(self) -> TaskScan:
        t0 = time.perf_counter()
        scan = scan_tasks(self._root)
        self.scans += 1
        self.scan_s += time.perf_counter() - t0
        self._last_scan = time.monotonic()
        return scan

    def collect(
        self, wanted: Mapping[str, tuple[frozenset[int], frozenset[int]]]
    ) -> dict[str, dict[str, Any]]:
        """model -> {"span_s", "threads", "truncated"} for `wanted`: model -> (its cores,
        thread ids not to name: its own worker)."""
        if not wanted:
            self._baseline = None
            return {}
        if time.monotonic() - self._last_scan < self._every_s:
            return {}  # scanned recently: the baseline stays, the next scan reports
        before, after = self._baseline, self._scan()
        if before is None:
            before = after
            self._wait(self._probe_s)
            after = self._scan()
        self._baseline = after
        span = round(after.t - before.t, 3)
        return {
            name: {
                "span_s": span,
                "threads": intruders(before, after, cores, exclude, self._top),
                "truncated": after.truncated,
            }
            for name, (cores, exclude) in wanted.items()
        }


def device_readings(session) -> dict[str, float]:
    """The session's device sensors (`Session.sensors`, e.g. a Hailo's temperature and
    power), finite numbers only; {} when its runtime gives none or the read fails."""
    sensors = getattr(session, "sensors", None)
    if sensors is None:
        return {}
    try:
        values = sensors()
    except Exception:  # a sensor read must never cost the payload
        log.debug("telemetry: %s sensors failed", session.candidate.key, exc_info=True)
        return {}
    return {
        str(k): float(v)
        for k, v in (values or {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class TelemetryLoop:
    def __init__(
        self,
        interval_s: float,
        models: Callable[[], Mapping[str, Served]],
        sink: TelemetrySink,
        root: SysRoot | None = None,
        sampler: CoreSampler | None = None,
        intruder_watch: IntruderWatch | None = None,
        observers: list[Callable[[dict[str, Any]], None]] | None = None,
    ) -> None:
        """`observers`: called with every payload once published, on this loop's thread (the
        daemon's tuning loop, edged.autotune); they must not raise nor take long."""
        self.interval_s = interval_s
        self.observers = list(observers or ())
        self._models = models
        self._sink = sink
        self._root = root or SysRoot()
        self._sampler = sampler
        self._watch = (
            intruder_watch
            if intruder_watch is not None
            else IntruderWatch(self._root, wait=self._wait)
        )
        self._cpu_use = CpuUseSampler()
        self._energy = EnergyMeter(self._root)  # the board's own meters (none on most VMs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._throttling = False
        # The last counter readings, for rates: (t, cpu -> irqs, cpu -> softirqs) and
        # model -> (t, involuntary switches of its worker thread).
        self._cpu_counts: tuple[float, dict[int, int], dict[int, int]] | None = None
        self._worker_counts: dict[str, tuple[float, int, int]] = {}
        self._tables: tuple[CounterTable, CounterTable] | None = None
        self.payloads = 0
        self._summary = BatchingSummary(interval_s)
        # For /metrics (edged.serving.device_metrics): the last window's thermal reading and
        # the latency outliers counted so far, by model and cause.
        self.last_thermal: dict[str, Any] | None = None
        self.energy_domains = self._energy.domains  # their totals, for /metrics
        self.energy_by_model: dict[str, float] = {}  # joules attributed so far, for /metrics
        self.outliers_total: dict[tuple[str, str], int] = {}

    def start(self) -> None:
        if self._sampler is not None:
            # Outliers are attributed when a window closes, so the sampler's ring must
            # still hold the window's first samples then (and one period either side).
            self._sampler.ensure_horizon(self.interval_s + 1.0)
            self._sampler.start()
        read_system(self._root, self._cpu_use)  # the first CPU-use sample is the baseline
        self._energy.read(time.monotonic())  # and the first energy reading
        self._intrusions(self._models())  # and the first counter readings, for the rates
        self._thread = threading.Thread(target=self._loop, name="edged-telemetry", daemon=True)
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
        for table in self._tables or ():
            table.close()

    def _wait(self, seconds: float) -> None:
        self._stop.wait(seconds)  # a stop does not wait for an intruder probe

    def _loop(self) -> None:
        name_thread("edged-telemetry")
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
        for observer in self.observers:
            observer(payload)
        self._summary.add(payload["models"], self._models())
        self.last_thermal = payload["thermal"]
        for name, stats in payload["models"].items():
            for cause, count in (stats.get("outliers") or {}).items():
                key = (name, cause)
                self.outliers_total[key] = self.outliers_total.get(key, 0) + count
        throttling = bool(payload["thermal"].get("throttling"))
        if throttling != self._throttling:
            self._throttling = throttling
            self._sink.publish_event(
                "throttling",
                {"throttling": throttling, "hottest": payload["thermal"].get("hottest")},
            )

    def collect(self) -> dict[str, Any]:
        models: dict[str, Any] = {}
        npu_watts: dict[str, float] = {}  # an NPU runtime's own power, once per device
        preempted: dict[str, tuple[frozenset[int], frozenset[int]]] = {}
        for name, served in self._models().items():
            worker = served.worker
            recorder = worker.recorder
            if recorder is None:
                continue
            delay = worker.batching.max_queue_delay_us / 1e6 if worker.batchable else 0.0
            window = recorder.rotate(self._sampler, batch_delay_s=delay)
            stats = window.to_payload()
            total = recorder.since_start(include_open=False, total_only=True).total.to_payload()
            stats["since_start"] = {key: total[key] for key in SINCE_START_KEYS}
            session = worker.session
            candidate = session.candidate
            stats["backend"] = f"{candidate.backend}:{candidate.device}"
            stats["degraded"] = worker.degraded
            readings = device_readings(session)
            if readings:
                stats["device"] = readings
                if "power_watts" in readings:
                    npu_watts[f"{candidate.backend}:{candidate.device}"] = readings["power_watts"]
            stats["queue_depth"] = worker.queue_depth
            models[name] = stats
            if window.outliers.get("preempted") and worker.cpus:
                preempted[name] = (
                    frozenset(worker.cpus),
                    frozenset({worker.native_id} if worker.native_id else ()),
                )
        try:
            for name, found in self._watch.collect(preempted).items():
                models[name]["intruders"] = found
        except Exception:  # naming threads is a bonus: never lose the payload over it
            log.exception("telemetry: finding the threads on the inference cores failed")
        system = read_system(self._root, self._cpu_use).to_dict()
        system["intrusions"] = self._intrusions(self._models())
        payload = {
            "interval_s": self.interval_s,
            "models": models,
            "thermal": read_thermal(self._root).to_dict(),  # incl. hottest, throttling
            "system": system,
        }
        if self._energy.domains or self._energy.notes or npu_watts:
            energy = self._energy.read(time.monotonic(), npu_watts)
            payload["energy"] = energy.to_dict()
            for name, mj in per_inference_mj(models, energy.joules).items():
                models[name]["energy_mj_per_inference"] = mj
                joules = mj / 1e3 * models[name]["compute"]["count"]
                self.energy_by_model[name] = self.energy_by_model.get(name, 0.0) + joules
        return payload

    def _intrusions(self, models: Mapping[str, Served]) -> dict[str, Any]:
        """What interrupted inference since the last payload, as rates: hard interrupts and
        softirqs per second on each inference core (the models' pinned CPUs; every CPU when
        none is pinned) and involuntary context switches per second of each model's worker
        thread. The same kernel counters /metrics exports as totals; here as rates so a
        fleet view needs no second reading. Rates are null until two readings exist.

        The CPU counters come from the attribution sampler's newest sample when it is
        sampling (no second parse of /proc/interrupts), else from /proc directly."""
        # Only a sample the sampler took just now: parked (no batch in flight), its newest
        # sample is from the last busy spell.
        latest = (
            self._sampler.latest(max_age_s=2 * self._sampler.period_s)
            if self._sampler is not None
            else None
        )
        if latest is not None:
            t, irqs, soft = latest.t, latest.irqs, latest.softirqs
        else:
            t = time.perf_counter()
            if self._tables is None:  # kept open, re-read by changed rows (as the sampler)
                self._tables = interrupt_table(self._root), softirq_table(self._root)
            irq_table, soft_table = self._tables
            irqs = irq_table.totals() if irq_table.read() else {}
            soft = soft_table.by_key() if soft_table.read() else {}
        softs = {cpu: sum(kinds.values()) for cpu, kinds in soft.items()}
        pinned = sorted({cpu for served in models.values() for cpu in (served.worker.cpus or ())})
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
            if counts is not None and tid is not None:
                self._worker_counts[name] = (now, tid, counts.involuntary)
                # A reload or take-over replaces the worker thread: its counter starts anew,
                # so no rate until two readings of the same thread.
                if before is not None and before[1] == tid and now > before[0]:
                    rate = round((counts.involuntary - before[2]) / (now - before[0]), 2)
            workers[name] = {"involuntary_switches_per_s": rate}
        sampler_hz = None if self._sampler is None else round(1 / self._sampler.period_s, 1)
        return {
            "span_s": None if span is None else round(span, 3),
            "scope": "inference" if pinned else "all",
            "cpus": cpus,
            "workers": workers,
            "sampler_hz": sampler_hz,
        }


# -- without a broker --------------------------------------------------------------------------


class LogSink:
    """Telemetry without a broker: one summary line per payload at INFO (`summary_line`), the
    full payload (the envelope `LogPublisher` writes: topic, ts, seq, bdSeq 0) at DEBUG, and,
    with `payload_file`, appended to that file as one JSON line (renamed to `<file>.1` once
    past `max_bytes`, so it stays bounded). A ~3 KB line every interval would bury the rest
    of the log. Events go to the publisher unchanged (they are short and rare)."""

    def __init__(
        self,
        publisher: TelemetrySink,
        payload_file: Path | None = None,
        max_bytes: int = PAYLOAD_FILE_MAX_BYTES,
        logger: logging.Logger | None = None,
    ) -> None:
        self._publisher = publisher
        self.payload_file = payload_file
        self._max_bytes = max_bytes
        self._log = logger or log
        self._seq = 0
        self._file_failed = False

    def publish_event(self, kind: str, detail: dict) -> None:
        self._publisher.publish_event(kind, detail)

    def publish_telemetry(self, payload: dict) -> None:
        self._seq += 1
        self._log.info("telemetry: %s", summary_line(payload))
        if self.payload_file is None and not self._log.isEnabledFor(logging.DEBUG):
            return
        record = {
            "topic": "telemetry",
            "ts": payload.get("ts", round(time.time(), 3)),
            "seq": self._seq,
            "bdSeq": 0,
            **payload,
        }
        line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)
        self._log.debug("%s", line.decode())
        if self.payload_file is not None:
            self._append(line + b"\n")

    def _append(self, line: bytes) -> None:
        path = self.payload_file
        assert path is not None
        try:
            if path.exists() and path.stat().st_size + len(line) > self._max_bytes:
                os.replace(path, path.with_name(path.name + ".1"))
            with open(path, "ab") as out:
                out.write(line)
            self._file_failed = False
        except OSError as exc:
            if not self._file_failed:  # once per outage, not every interval
                self._log.error("telemetry: cannot write %s: %s", path, exc)
            self._file_failed = True


def summary_line(payload: Mapping[str, Any]) -> str:
    """One line for a human: per model count, p50/p99, outliers by cause and the thread
    that took its core most; the hottest zone.
    `face n=500 p50 1.62 p99 5.9 ms, outliers 5: preempted 5 (by stress-ng[4242] 4.1 s);
    hottest cpu-thermal 51.0 °C`."""
    parts = []
    for name, m in sorted((payload.get("models") or {}).items()):
        text = f"{name} n={m.get('count', 0)}"
        if m.get("count"):
            text += f" p50 {_num(m.get('p50_ms'))} p99 {_num(m.get('p99_ms'))} ms"
        causes = m.get("outliers") or {}
        if causes:
            text += f", outliers {m.get('outlier_count', sum(causes.values()))}: " + ", ".join(
                f"{cause} {n}" for cause, n in causes.items()
            )
        threads = (m.get("intruders") or {}).get("threads") or []
        if threads:
            top = threads[0]
            text += (
                f" (by {top['comm']}[{top['pid']}] {top['cpu_ms'] / 1e3:.2f} s on CPU {top['cpu']})"
            )
        parts.append(text)
    hottest = (payload.get("thermal") or {}).get("hottest")
    if hottest:
        parts.append(f"hottest {hottest.get('name')} {_num(hottest.get('temp_c'))} °C")
    if (payload.get("thermal") or {}).get("throttling"):
        parts.append("THROTTLING")
    return "; ".join(parts) or "no models"


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}"
