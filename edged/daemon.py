"""edged: the inference daemon.

Start: read and validate the config (exit 2 naming file and key on error), select and load
every model (a cached selection makes this fast), bind TCP and the Unix socket, serve the Open
Inference Protocol with uvicorn, then tell systemd READY=1. SIGHUP reloads the config (models
that changed load beside the old ones and swap in atomically; a model that fails keeps its old
version). SIGTERM: STOPPING=1, stop accepting, drain in-flight requests (bounded), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from edged import __version__
from edged.config import DEFAULT_CONFIG_PATH, Config, ConfigError, ModelConfig, load_config
from edged.sdnotify import Notifier, watchdog_interval_s
from edged.serving.engine import BatchingConfig
from edged.serving.metrics import ServingMetrics
from edged.serving.models import ServedModel, load_model
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot

log = logging.getLogger("edged")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
DRAIN_S = 10.0  # bound on finishing in-flight requests at shutdown or after a swap
LOAD_TIMEOUT_S = 180.0  # systemd start-timeout extension granted per model load
SUPERVISE_S = 0.1  # how often stalled backends are looked for


def model_key(mc: ModelConfig) -> tuple:
    """What a served model depends on; a reload reloads a model when this changes."""
    def file_id(path: Path) -> tuple | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    return (str(mc.path), file_id(mc.path),
            tuple((str(v), file_id(v)) for v in mc.variants), mc.precision, mc.backend,
            repr(mc.calibration),
            mc.threads, mc.cpus,
            tuple(sorted((mc.shapes or {}).items())), mc.max_batch_size,
            mc.preferred_batch_sizes, mc.max_queue_delay_us, mc.max_queue_size, mc.timeout_ms,
            mc.watchdog_ms, mc.rt_priority, mc.period_ms)


def batching_of(mc: ModelConfig) -> BatchingConfig:
    return BatchingConfig(mc.max_batch_size, tuple(mc.preferred_batch_sizes),
                          mc.max_queue_delay_us, mc.max_queue_size, mc.timeout_ms,
                          mc.watchdog_ms, mc.rt_priority)


class Daemon:
    def __init__(self, config: Config, root: SysRoot | None = None) -> None:
        """`root`: where CPU sets, cpufreq and throttle state are read (the live system; a
        fixture tree in tests). Nothing is ever written there."""
        from sysconf.hardware import probe

        self.root = root or SysRoot()
        self.cpu_plan: CpuPlan | None = None
        # Before pin_housekeeping narrows this thread (reloads run on a pinned thread).
        self._allowed = set(os.sched_getaffinity(0))
        self.config = self.with_cpu_plan(config)
        self.hw = probe()
        self.notifier = Notifier()
        self.metrics = ServingMetrics()
        self.models: dict[str, ServedModel] = {}
        self.failed: dict[str, str] = {}
        self.started = time.time()
        self.reloads = 0
        self.last_reload_error: str | None = None
        self.restart_needed: list[str] = []  # [server] keys a reload changed (need a restart)
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of our Unix socket
        self.housekeeping: list[int] | None = None
        self.memory_locked: bool | None = None
        self.publisher = None
        self.telemetry = None
        self._server = None
        self._reload_lock: asyncio.Lock | None = None
        self._reload_pending = False
        self._tasks: set[asyncio.Task] = set()

    # -- models ------------------------------------------------------------------------------
    def load_models(self, config: Config, current: dict[str, ServedModel]
                    ) -> tuple[dict[str, ServedModel], dict[str, str]]:
        """Models for `config`: unchanged ones are kept, the rest loaded. A model that fails
        keeps its current version when it has one."""
        models: dict[str, ServedModel] = {}
        failed: dict[str, str] = {}
        state_dir = config.server.state_dir
        for mc in config.models:
            key = model_key(mc)
            old = current.get(mc.name)
            if old is not None and old.config_key == key:
                models[mc.name] = old
                continue
            # Selecting may benchmark every backend: ask systemd for time, model by model.
            self.notifier.notify(f"STATUS=loading model {mc.name}",
                                 f"EXTEND_TIMEOUT_USEC={int(LOAD_TIMEOUT_S * 1e6)}")
            start = time.perf_counter()
            try:
                served = load_model(mc.name, mc.path, mc.policy(config.selection),
                                    batching_of(mc), self.hw, state_dir, key,
                                    on_failover=self._failover_hook(mc.name),
                                    period_s=mc.period_s, variants=mc.variants,
                                    calibration=mc.calibration)
            except Exception as exc:  # any failure: this model is not served, others are
                reason = str(exc) or exc.__class__.__name__
                log.error("model %s: not loaded: %s", mc.name, reason)
                failed[mc.name] = reason
                if old is not None:
                    models[mc.name] = old
                continue
            sel = served.selection.selected
            log.info("model %s: %s on %s:%s (%s) p99 %.3f ms, %s in %.2f s", mc.name,
                     served.selection.model.name, sel.candidate.backend, sel.candidate.device,
                     sel.precision, sel.latency.p99_ms if sel.latency else float("nan"),
                     "cached selection" if served.selection.from_cache else "measured",
                     time.perf_counter() - start)
            if served.selection.why:
                log.info("model %s: %s", mc.name, served.selection.why)
            for warning in served.selection.warnings:
                log.warning("model %s: %s", mc.name, warning)
            models[mc.name] = served
        return models, failed

    def _failover_hook(self, name: str):
        counter = self.metrics.failovers.labels(name)

        def on_failover(reason: str) -> None:  # called from the worker or supervisor thread
            counter.inc()
            self._event("backend_switch", model=name, reason=reason)

        return on_failover

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "pid": os.getpid(),
            "config": str(self.config.source),
            "uptime_s": round(time.time() - self.started, 1),
            "reloads": self.reloads,
            "last_reload_error": self.last_reload_error,
            "restart_needed": [f"server.{k}" for k in self.restart_needed],
            "models": [m.status() for m in self.models.values()],
            "failed": dict(self.failed),
            "housekeeping_cpus": self.housekeeping,
            "cpu_plan": self.cpu_plan.to_dict() if self.cpu_plan is not None else None,
            "memory_locked": self.memory_locked,
            "threads": thread_affinities(),
        }

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> int:
        import uvicorn

        from edged.serving.api import Api

        self.housekeeping = pin_housekeeping(self.config)
        if self.cpu_plan is not None and self.cpu_plan.source == "models":
            self.cpu_plan = replace(self.cpu_plan, housekeeping=tuple(self.housekeeping or ()))
        self.notifier.notify("STATUS=loading models")
        self.models, self.failed = await asyncio.to_thread(self.load_models, self.config, {})
        if self.config.server.mlockall:
            self.memory_locked = lock_memory()
        try:
            sockets = bind_sockets(self.config)
            self._socket_id = socket_identity(self.config)
        except OSError as exc:
            log.error("cannot listen: %s", exc)
            self.notifier.notify(f"STATUS=cannot listen: {exc}")
            self._stop_workers(self.models.values())
            return EXIT_FAILED
        from edged.serving.metrics import IntrusionCollector

        self.metrics.registry.register(IntrusionCollector(
            lambda: {cpu for m in self.models.values() for cpu in (m.worker.cpus or ())},
            lambda: {name: m.worker.native_id for name, m in self.models.items()}))
        self.start_telemetry()
        api = Api(lambda: self.models, self.metrics, self.config.server.max_body_bytes,
                  self.status, lambda: self.failed, reload=self._on_hup)
        # Connection budgets (per listener), header size and time, and body time are
        # edged.serving.http_limits' (uvicorn has no such options); uvicorn's own limit_concurrency
        # stays off, since it counts every listener together. WebSocket: no route uses it.
        from edged.serving.http_limits import HttpLimits, protocol_class

        srv = self.config.server
        api.max_decode_bytes = srv.max_decode_bytes
        limits = HttpLimits(header_timeout_s=srv.header_timeout_s,
                            body_timeout_s=srv.body_timeout_s,
                            max_header_bytes=srv.max_header_bytes,
                            connections={"tcp": srv.max_connections,
                                         "unix": srv.socket_max_connections},
                            drain_s=DRAIN_S)
        uv_config = uvicorn.Config(api, lifespan="off", access_log=False, log_config=None,
                                   timeout_graceful_shutdown=int(DRAIN_S),
                                   http=protocol_class(limits), ws="none",
                                   timeout_keep_alive=srv.idle_timeout_s,  # type: ignore
                                   limit_concurrency=None)
        self._server = server = _Server(uv_config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop, sig)
        self._reload_lock = asyncio.Lock()
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        tasks = [asyncio.ensure_future(self._announce_ready(server, sockets))]
        tasks.append(asyncio.ensure_future(self._supervise()))
        from edged.hotplug import AcceleratorMonitor

        monitor = AcceleratorMonitor(
            lambda action, path: loop.call_soon_threadsafe(self._on_hotplug, action, path))
        monitor.start()
        interval = watchdog_interval_s()
        if interval:
            tasks.append(asyncio.ensure_future(self._watchdog(interval)))
        try:
            await server.serve(sockets=sockets)
            if not server.started:
                log.error("the HTTP server did not start")
                return EXIT_FAILED
        finally:
            monitor.stop()
            for task in tasks:
                task.cancel()
            await asyncio.to_thread(self._stop_workers, list(self.models.values()))
            # The last partial window, then the retained offline state before a clean
            # DISCONNECT (which suppresses the Will).
            if self.telemetry is not None:
                await asyncio.to_thread(self.telemetry.stop)
            if self.publisher is not None:
                await asyncio.to_thread(self.publisher.stop, 10.0)
            _remove_socket_file(self.config, self._socket_id)
        log.info("stopped")
        return EXIT_OK

    def start_telemetry(self) -> None:
        if not self.config.telemetry.enabled:
            log.info("telemetry disabled ([telemetry] enabled = false)")
            return
        from edged.telemetry.loop import LogSink, TelemetryLoop
        from edged.telemetry.mqtt import LogPublisher

        self.publisher = open_telemetry(self.config)
        self.publisher.set_birth(self._birth())
        self.publisher.set_audit_handler(self._audit_command)
        self.publisher.start()
        # Without a broker: a summary line per payload at INFO, the payload itself at DEBUG
        # or in [telemetry] payload_file (birth, events and audit stay as the publisher logs
        # them).
        sink = LogSink(self.publisher, self.config.telemetry.payload_file) \
            if isinstance(self.publisher, LogPublisher) else self.publisher
        self.telemetry = TelemetryLoop(
            self.config.telemetry.interval_s, lambda: self.models, sink,
            sampler=self.core_sampler())
        self.telemetry.start()

    def core_sampler(self):
        """Interrupt/softirq counters of the inference cores, plus their cpufreq and the
        throttle state (read from the daemon's root), so outliers can be blamed on
        "freq_drop" and "throttle" as well as on interrupts. It samples only while a model
        has a batch in flight (and a tail of two periods after): parked, an idle daemon
        pays nothing for it; busy, it stays within SAMPLER_CPU_BUDGET of a core (20 Hz where
        a sample is cheap, down to 5 Hz)."""
        from edged.telemetry.latency import ACTIVITY, CoreSampler, cpufreq_reader
        from edged.telemetry.loop import SAMPLER_CPU_BUDGET, SAMPLER_HZ

        pinned = sorted({cpu for m in self.models.values() for cpu in (m.worker.cpus or ())})
        has_cpufreq = any(self.root.exists(f"/sys/devices/system/cpu/{name}/cpufreq")
                          for name in self.root.listdir("/sys/devices/system/cpu")
                          if name.startswith("cpu") and name[3:].isdecimal())
        return CoreSampler(pinned or None, rate_hz=SAMPLER_HZ, root=self.root,
                           freq=cpufreq_reader(self.root) if has_cpufreq else None,
                           throttled=throttle_reader(self.root),
                           cpu_affinity=self.housekeeping, activity=ACTIVITY,
                           cpu_budget=SAMPLER_CPU_BUDGET)

    # -- CPU plan ----------------------------------------------------------------------------
    def with_cpu_plan(self, config: Config) -> Config:
        """When no model names its CPUs, decide them as `edgectl apply` (the tune unit) does:
        sysconf.cpusets.decide() (an isolated set, else the last core) for inference, the rest
        for housekeeping; models without `cpus` then run on the inference cores, so the daemon
        and the tuned system agree. A model that sets `cpus` keeps them (and then the config,
        not decide(), says what is where). Sets `cpu_plan`."""
        from sysconf.cpusets import decide, read_cpusets

        pinned = sorted({cpu for mc in config.models for cpu in (mc.cpus or ())})
        if pinned or not config.models:
            pinned_now = getattr(self, "housekeeping", None)  # None before run() pins
            self.cpu_plan = None if not pinned else CpuPlan(
                tuple(pinned), tuple(config.server.housekeeping_cpus or pinned_now or ()),
                "models")
            if pinned:
                try:  # what the tune unit will do differently, said where operators look
                    for note in decide(read_cpusets(self.root), pinned).notes:
                        log.warning("CPU plan: %s", note)
                except ValueError as exc:
                    log.warning("CPU plan: the models' cpus: %s", exc)
            return config
        try:
            plan = decide(read_cpusets(self.root))
        except ValueError as exc:
            log.warning("models stay unpinned: %s", exc)
            self.cpu_plan = None
            return config
        allowed = self._allowed if self.root.is_live else set(plan.inference)
        if not set(plan.inference) <= allowed:
            log.warning("models stay unpinned: inference CPUs %s (%s) are outside this "
                        "process's CPU set %s", list(plan.inference), plan.source,
                        sorted(allowed))
            self.cpu_plan = None
            return config
        if self.cpu_plan != plan:
            log.info("CPU plan (%s): models on CPUs %s, housekeeping on %s", plan.source,
                     plan.to_dict()["inference_list"], plan.to_dict()["housekeeping_list"])
        self.cpu_plan = plan
        return replace(config, models=tuple(replace(mc, cpus=plan.inference)
                                            for mc in config.models))

    def _birth(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "hardware": self.hw.to_dict(),
            "models": {name: m.status() for name, m in self.models.items()},
            "failed": dict(self.failed),
        }

    def _audit_command(self, request: dict) -> dict:
        """cmd/audit (called in the publisher's worker thread, never on the event loop): run
        the audit on the live system with the running config; the publisher publishes the
        summary retained on `audit`."""
        return self._audit()

    def _audit(self) -> dict[str, Any]:
        # Cores the daemon decided itself (no model sets cpus) are what the audit decides
        # on its own too; passing them would make them look configured to its checks.
        decided = self.cpu_plan is not None and self.cpu_plan.source != "models"
        from edged.cli.audit import audit_summary

        return audit_summary(self.config, self.root, with_model_cpus=not decided)

    async def _audit_at_start(self) -> None:
        """One audit after READY, so `audit` holds this boot's state; in a thread, after
        readiness, so it never delays serving."""
        try:
            summary = await asyncio.to_thread(self._audit)
        except Exception:  # an audit that crashes must not take the daemon down
            log.exception("start-up audit failed")
            return
        log.info("audit: %s; failing: %s", summary["statuses"],
                 ", ".join(summary["failing"]) or "none")
        if self.publisher is not None:
            self.publisher.publish_audit(summary)

    def _event(self, kind: str, **detail: Any) -> None:
        if self.publisher is not None:
            self.publisher.publish_event(kind, detail)

    def _on_hup(self) -> None:
        """Reloads never overlap: a HUP during a reload runs one more reload after it."""
        assert self._reload_lock is not None
        if self._reload_lock.locked():
            self._reload_pending = True
            return
        task = asyncio.ensure_future(self._reload_serialized())
        self._tasks.add(task)  # keep a reference until done (the loop holds only a weak one)
        task.add_done_callback(self._tasks.discard)

    async def _reload_serialized(self) -> None:
        assert self._reload_lock is not None
        async with self._reload_lock:
            await self.reload()
            while self._reload_pending:
                self._reload_pending = False
                await self.reload()

    def _on_hotplug(self, action: str, path: str) -> None:
        task = asyncio.ensure_future(self._hardware_changed(action, path))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hardware_changed(self, action: str, path: str) -> None:
        """Re-probe; when what decides backend speed changed, let every model adapt (in a
        thread: it may load a backend and measure). Serialized with reloads."""
        from sysconf.hardware import probe

        assert self._reload_lock is not None
        async with self._reload_lock:
            hw = await asyncio.to_thread(probe)
            if hw.fingerprint() == self.hw.fingerprint():
                return
            log.info("hardware changed (%s %s): %s", action, path,
                     ", ".join(a.name for a in hw.accelerators) or "no accelerators")
            self.hw = hw
            for served in list(self.models.values()):
                try:
                    outcome = await asyncio.to_thread(served.adapt, hw)
                except Exception as exc:  # keep serving what runs; say why it did not adapt
                    outcome = f"could not adapt: {exc}"
                log.info("model %s: %s", served.name, outcome)
                self._event("hardware_change", model=served.name, outcome=outcome,
                            action=action, device=path)
                self.notifier.notify(f"STATUS={self._status_line()}")

    def _on_stop(self, sig: int) -> None:
        log.info("signal %s: draining and stopping", signal.Signals(sig).name)
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        if self._server is not None:
            self._server.should_exit = True

    async def _announce_ready(self, server, sockets: list[socket.socket]) -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        where = ", ".join(_describe(s) for s in sockets)
        log.info("serving %d model(s) on %s", len(self.models), where)
        self.notifier.notify("READY=1", f"STATUS={self._status_line()}")
        self.start_variant_jobs()
        if self.publisher is not None:
            task = asyncio.ensure_future(self._audit_at_start())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if _hup_during_start.is_set():  # a HUP that came while models were loading
            self._on_hup()

    def _status_line(self) -> str:
        text = f"serving {len(self.models)} model(s)"
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
        The take-over loads the next backend, so it runs in a thread, one at a time."""
        while True:
            for served in list(self.models.values()):
                worker = served.worker
                if worker.stalled(worker.batching.watchdog_ms / 1000.0):
                    await asyncio.to_thread(worker.take_over_if_stalled)
            await asyncio.sleep(SUPERVISE_S)

    async def reload(self) -> None:
        log.info("reloading %s", self.config.source)
        self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}",
                             "STATUS=reloading")
        try:
            config = await asyncio.to_thread(load_config, self.config.source)
            config = self.with_cpu_plan(config)
        except ConfigError as exc:
            self.last_reload_error = str(exc)
            log.error("reload: keeping the running config: %s", exc)
            self.notifier.notify("READY=1", f"STATUS={self._status_line()}; reload failed")
            return
        # [server] is bound at start (sockets, limits, CPUs): a change there waits for a
        # restart, says so, and the running values stay in force (stop must remove the
        # socket this process bound, not whatever sits at a new path).
        pending = server_changes(self.config.server, config.server)
        if pending:
            log.warning("reload: [server] %s changed; that takes a restart (still serving "
                        "with the running values)", ", ".join(pending))
        # hang_s follows the models' watchdog_ms and is read live by the watchdog.
        config = replace(config, server=replace(self.config.server,
                                                hang_s=config.server.hang_s))
        self.restart_needed = pending
        old = self.models
        models, failed = await asyncio.to_thread(self.load_models, config, old)
        self.models, self.failed, self.config = models, failed, config  # the atomic swap
        self.reloads += 1
        self.last_reload_error = "; ".join(f"{k}: {v}" for k, v in failed.items()) or None
        retired = [m for name, m in old.items() if models.get(name) is not m]
        await asyncio.to_thread(self._stop_workers, retired)
        self.notifier.notify("READY=1", f"STATUS={self._status_line()}")
        self.start_variant_jobs()
        self._event("reload", models=sorted(models), failed=failed,
                    replaced=sorted(m.name for m in retired),
                    restart_needed=[f"server.{k}" for k in pending])
        if self.publisher is not None:
            self.publisher.set_birth(self._birth())

    # -- INT8 variants made in the background ---------------------------------------------
    def start_variant_jobs(self) -> None:
        """One background job per served model whose calibration data has no variants made
        yet (see edged.quantize.job). Called after READY: readiness never waits for them."""
        from edged.quantize.job import VariantJob
        from edged.quantize.variants import background_command

        for name, served in self.models.items():
            if not served.variants_pending or served.job is not None:
                continue
            given = self.config.model(name).variants if self.config.model(name) else ()
            command = background_command(served.original.path, given, served.calibration,
                                         self.config.server.state_dir, served.policy,
                                         self.housekeeping or sorted(self._allowed))
            served.job = VariantJob(name, command,
                                    lambda report, s=served: self._variants_made(s, report))
            served.job.start()  # this thread is on the housekeeping CPUs; the child too

    def _variants_made(self, served: ServedModel, report: dict[str, Any]) -> str:
        """The job's decision (stored under the served policy's key) swapped in, in the
        job's thread, if the model is still the one served."""
        from edged.selection.select import family_of, load_cached

        if self.models.get(served.name) is not served:
            return "the model was reloaded meanwhile; its new version decides anew"
        variants = tuple(Path(v) for v in report["variants"])
        family = family_of(served.original.path, variants)
        selection = load_cached(self.config.server.state_dir, family,
                                report["selection_key"])
        if selection is None:
            raise RuntimeError(f"no stored decision under {report['selection_key']}")
        done = served.apply(selection, self.hw, variants)
        served.variants_pending = False
        log.info("model %s: %s; %s", served.name, done, selection.why)
        self._event("selection", model=served.name, result=done, why=selection.why)
        return done

    @staticmethod
    def _stop_workers(models) -> None:
        """Stop all workers at once, each bounded by DRAIN_S, so N models take DRAIN_S."""
        for served in models:
            if served.job is not None:
                served.job.stop()
        workers = [served.worker for served in models]
        threads = [threading.Thread(target=w.stop, args=(DRAIN_S,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


class _Server:
    """uvicorn's Server without its own signal handling.

    uvicorn installs SIGTERM/SIGINT handlers for the duration of serve() and re-raises the
    signal afterwards, which would kill the process before our drain and exit 0; the daemon
    handles signals itself (see Daemon.run)."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        return Server(config)


def bind_sockets(config: Config) -> list[socket.socket]:
    server = config.server
    sockets = []
    if server.listen_host is not None:
        family = socket.AF_INET6 if ":" in server.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((server.listen_host, server.listen_port or 0))
        sockets.append(sock)
    if server.socket is not None:
        path = server.socket
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a stale socket from a previous run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, server.socket_mode)
        sockets.append(sock)
    for sock in sockets:
        sock.listen(1024)
        sock.set_inheritable(False)
    return sockets


def socket_identity(config: Config) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the Unix socket just bound, so stop removes only that file."""
    if config.server.socket is None:
        return None
    st = config.server.socket.lstat()
    return st.st_dev, st.st_ino


def _remove_socket_file(config: Config, identity: tuple[int, int] | None) -> None:
    """Remove the socket this process created, and only while it is still that socket: a
    file that replaced it (or anything else at the path) is left alone."""
    path = config.server.socket
    if path is None or identity is None:
        return
    with contextlib.suppress(OSError):
        st = path.lstat()
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == identity:
            path.unlink()


def server_changes(running, new) -> list[str]:
    """The [server] fields that differ between two configs (they take a restart)."""
    import dataclasses

    return [f.name for f in dataclasses.fields(running)
            if f.name != "hang_s" and getattr(running, f.name) != getattr(new, f.name)]


def _describe(sock: socket.socket) -> str:
    name = sock.getsockname()
    return f"unix:{name}" if sock.family == socket.AF_UNIX else f"http://{name[0]}:{name[1]}"


def mqtt_settings(config: Config):
    """The publisher's settings from [telemetry.mqtt]; its own checks become config errors
    naming the key."""
    from edged.telemetry.mqtt import MqttSettings, SettingsError, device_id_from

    mqtt = config.telemetry.mqtt
    if mqtt is None:
        return None
    try:
        return MqttSettings(
            url=mqtt.url, group=mqtt.group, device_id=mqtt.device_id or device_id_from(),
            ca_file=mqtt.ca_file, cert_file=mqtt.cert_file, key_file=mqtt.key_file,
            username=mqtt.username, password_file=mqtt.password_file,
            keepalive_s=mqtt.keepalive_s, protocol=mqtt.protocol)
    except SettingsError as exc:
        raise ConfigError(config.source, f"telemetry.mqtt.{exc.setting}", exc.problem) from None


def open_telemetry(config: Config):
    """The MQTT publisher (with its spool) when a broker is configured, else JSON lines to
    the log. An unusable spool file is reported and telemetry falls back to the log, so
    inference keeps serving."""
    from edged.telemetry.mqtt import LogPublisher, open_publisher
    from edged.telemetry.spool import SpoolError

    mqtt = config.telemetry.mqtt
    try:
        return open_publisher(
            mqtt_settings(config), config.server.state_dir,
            spool_max_bytes=int((mqtt.spool_max_mb if mqtt else 50) * 2**20),
            spool_max_age_s=(mqtt.spool_max_age_days if mqtt else 7) * 86400)
    except SpoolError as exc:
        log.error("telemetry spool unusable, telemetry goes to the log instead: %s", exc)
        return LogPublisher()


def throttle_reader(root: SysRoot) -> Callable[[], bool] | None:
    """Is performance being cut right now: the Raspberry Pi firmware's throttle word says the
    ARM is slowed, or a cpufreq cooling device is engaged (a thermal cap; scaling_cur_freq
    may still equal the capped scaling_max_freq, so "freq_drop" alone would miss it).
    Where the files are is found once; each call reads a few small files (the sampler runs it
    at 20 Hz). None: this root has neither."""
    from sysconf.thermal import THERMAL_DIR, THROTTLED_GLOBS, THROTTLED_PATH, Throttled

    firmware = THROTTLED_PATH if root.exists(THROTTLED_PATH) else next(
        (path for pattern in THROTTLED_GLOBS for path in root.glob(pattern)), None)
    cooling = [f"{THERMAL_DIR}/{name}/cur_state" for name in root.listdir(THERMAL_DIR)
               if name.startswith("cooling_device")
               and (root.read_line(f"{THERMAL_DIR}/{name}/type") or "").startswith(
                   ("cpufreq-", "thermal-cpufreq-", "Processor"))]
    if firmware is None and not cooling:
        return None

    def throttled() -> bool:
        if firmware is not None:
            word = root.read_line(firmware) or ""
            try:
                if Throttled(int(word, 16)).slowing_now:
                    return True
            except ValueError:
                pass  # unreadable this time: not known, not throttled
        for path in cooling:
            state = root.read_line(path) or ""
            if state.lstrip("-").isdecimal() and int(state) > 0:
                return True
        return False

    return throttled


def pin_housekeeping(config: Config) -> list[int] | None:
    """Put this (main) thread, and so every thread it starts later (HTTP, reload, telemetry),
    on the housekeeping CPUs: the configured set, else the CPUs no model is pinned to. Model
    workers and their runtimes' threads set their own CPU sets. None: nothing pinned."""
    allowed = sorted(os.sched_getaffinity(0))
    wanted = config.server.housekeeping_cpus
    if wanted is None:
        pinned = {cpu for mc in config.models for cpu in (mc.cpus or ())}
        if not pinned:
            return None
        wanted = tuple(cpu for cpu in allowed if cpu not in pinned)
    usable = [cpu for cpu in wanted if cpu in allowed]
    if not usable:
        log.warning("no housekeeping CPU left (models pinned to %s of %s); the API threads "
                    "stay unpinned", sorted(set(allowed) - set(wanted)), allowed)
        return None
    # Threads that already exist (a BLAS pool started at import, say) keep the CPU set they
    # were born with, so every task of the process is moved, not only this one. No model
    # worker exists yet: they are started after this and pin themselves.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), usable)
        except (ProcessLookupError, PermissionError):
            continue  # the thread ended meanwhile, or is not ours to move
    log.info("housekeeping threads on CPUs %s", usable)
    return usable


def lock_memory() -> bool:
    """mlockall(MCL_CURRENT | MCL_FUTURE): no page faults on the inference path. ctypes: the
    standard library has no binding, and it is one call."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    mcl_current, mcl_future = 1, 2
    if libc.mlockall(mcl_current | mcl_future) != 0:
        err = ctypes.get_errno()
        log.warning("mlockall failed (%s): needs CAP_IPC_LOCK and LimitMEMLOCK=infinity; "
                    "running with unlocked memory", os.strerror(err))
        return False
    log.info("memory locked (mlockall)")
    return True


SCHED_POLICIES = {0: "other", 1: "fifo", 2: "rr", 3: "batch", 5: "idle", 6: "deadline"}


def thread_affinities() -> list[dict[str, Any]]:
    """Per-thread CPU sets and scheduling of this process, as the kernel reports them."""
    rows = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended while we looked
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        # stat: fields after the ")" closing comm; policy is field 41, rt_priority 40.
        after = stat.rsplit(")", 1)[-1].split()
        policy = SCHED_POLICIES.get(int(after[38]), after[38]) if len(after) > 38 else "?"
        priority = int(after[37]) if len(after) > 37 else 0
        rows.append({"tid": int(tid), "name": comm,
                     "cpus": fields.get("Cpus_allowed_list", "?").strip(),
                     "policy": policy if not priority else f"{policy}:{priority}",
                     "involuntary_switches": int(fields.get("nonvoluntary_ctxt_switches",
                                                            "0").strip())})
    return rows


_hup_during_start = threading.Event()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edged", description="edged inference daemon")
    parser.add_argument("--version", action="version", version=f"edged {__version__}")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH,
                        help=f"TOML config (default {DEFAULT_CONFIG_PATH})")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the config and exit (0 valid, 2 invalid)")
    args = parser.parse_args(argv)
    # Until the event loop takes over, a SIGHUP (systemctl reload during a long first start)
    # must not kill the daemon: remember it and reload once serving.
    signal.signal(signal.SIGHUP, lambda *_: _hup_during_start.set())
    try:
        config = load_config(args.config)
        mqtt_settings(config)  # the publisher's own checks, so they fail the start too
    except ConfigError as exc:
        print(f"edged: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print(f"edged: {config.source}: OK ({len(config.models)} model(s))")
        return EXIT_OK
    logging.basicConfig(level=config.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not config.models:
        log.warning("%s: no [[models]]; serving nothing", config.source)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(Daemon(config).run())


if __name__ == "__main__":
    sys.exit(main())
