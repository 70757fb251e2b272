"""edged: the inference daemon.

Start: read and validate the config (exit 2 naming file and key on error), select and load
every model (a cached selection makes this fast), bind TCP and the Unix sockets, serve the
Open Inference Protocol over HTTP (uvicorn) and gRPC (grpcio, `edged.serving.grpc_server`),
then tell systemd READY=1. SIGHUP reloads the config (models that changed load beside the old
ones and swap in atomically; a model that fails keeps its old version). SIGTERM: STOPPING=1,
stop accepting, drain in-flight requests (bounded), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged import __version__, logs
from edged.config import DEFAULT_CONFIG_PATH, Config, ConfigError, ModelConfig, load_config
from edged.placement import lock_memory, pin_housekeeping, plan_cpus, thread_affinities
from edged.repository import RepositoryControl
from edged.sdnotify import Notifier, watchdog_interval_s
from edged.serving.listeners import (
    bind_sockets,
    describe,
    http_server,
    remove_socket_file,
    server_changes,
    socket_identity,
)
from edged.serving.metrics import ServingMetrics
from edged.serving.model_set import load_models, stop_workers
from edged.serving.models import ServedModel
from edged.supervision import Supervision
from edged.telemetry.from_config import open_telemetry
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot

if TYPE_CHECKING:
    from edged.telemetry.loop import TelemetryLoop
    from edged.telemetry.mqtt.log_publisher import LogPublisher
    from edged.telemetry.mqtt.publisher import Publisher

log = logging.getLogger("edged")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
DRAIN_S = 10.0  # bound on finishing in-flight requests at shutdown or after a swap


class Daemon(RepositoryControl, Supervision):
    def __init__(self, config: Config, root: SysRoot | None = None) -> None:
        """`root`: where CPU sets, cpufreq and throttle state are read (the live system; a
        fixture tree in tests). Nothing is ever written there."""
        from backends import probe_hardware

        self.root = root or SysRoot()
        self.cpu_plan: CpuPlan | None = None
        self.housekeeping: list[int] | None = None  # the CPUs run() pins this process to
        # Before pin_housekeeping narrows this thread (reloads run on a pinned thread).
        self._allowed = set(os.sched_getaffinity(0))
        self.config = self.with_cpu_plan(config)
        self.hw = probe_hardware()
        self.notifier = Notifier()
        self.metrics = ServingMetrics()
        self.models: dict[str, ServedModel] = {}
        self.failed: dict[str, str] = {}
        self.started = time.time()
        self.reloads = 0
        self.last_reload_error: str | None = None
        self.restart_needed: list[str] = []  # keys a reload changed that need a restart
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of our Unix socket
        # Where it serves, once bound: "http" and "grpc", each its addresses.
        self.listening: dict[str, list[str]] = {"http": [], "grpc": [], "frigate": []}
        self.frigate: Any = None  # edged.serving.frigate_zmq.FrigateZmq when [frigate] is on
        self.memory_locked: bool | None = None
        self.publisher: Publisher | LogPublisher | None = None
        self.telemetry: TelemetryLoop | None = None
        self.tuning: Any = None  # edged.autotune.loop.TuningLoop ([tuning] auto on)
        self._server: Any = None  # edged.serving.listeners._Server (uvicorn's, ticking 1 Hz)
        self._reload_lock: asyncio.Lock | None = None
        self._reload_queued = False  # a reload waits for the model set (_on_hup)
        # Held by a variants job's swap and by stopping retired models (both in threads):
        # a job never puts a session into a worker that is being stopped.
        self._swap_lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        # The repository extension (model_control = "explicit"): models unloaded and not
        # loaded since, and [[models]] tables a load gave instead of the file's. Reloads
        # keep both (the file is the repository; a load or unload is an explicit override).
        self.unloaded: set[str] = set()
        self.overrides: dict[str, ModelConfig] = {}

    # -- models ------------------------------------------------------------------------------
    def load_models(
        self, config: Config, current: dict[str, ServedModel]
    ) -> tuple[dict[str, ServedModel], dict[str, str]]:
        """Models for `config` (edged.serving.model_set.load_models) under its [security]
        models, with this daemon's hardware, systemd notifier and fail-over hooks."""
        return load_models(config, current, self.hw, self.notifier.notify, self._failover_hook)

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "pid": os.getpid(),
            "config": str(self.config.source),
            "uptime_s": round(time.time() - self.started, 1),
            "listening": self.listening,
            # The models Frigate's peers may ask for, by each name they may use.
            "frigate": self.frigate.names() if self.frigate is not None else None,
            "reloads": self.reloads,
            "last_reload_error": self.last_reload_error,
            "restart_needed": self.restart_needed,
            "models": [m.status() for m in self.models.values()],
            "failed": dict(self.failed),
            "housekeeping_cpus": self.housekeeping,
            "cpu_plan": self.cpu_plan.to_dict() if self.cpu_plan is not None else None,
            "memory_locked": self.memory_locked,
            "threads": thread_affinities(),
            **self.care_status(),  # tuning, thermal
        }

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> int:
        from edged.serving.api import Api
        from edged.serving.grpc_listen import bind_grpc

        self.housekeeping = pin_housekeeping(self.config)
        if self.cpu_plan is not None and self.cpu_plan.source == "models":
            self.cpu_plan = replace(self.cpu_plan, housekeeping=tuple(self.housekeeping or ()))
        self.notifier.notify("STATUS=loading models")
        self.models, self.failed = await asyncio.to_thread(self.load_models, self.config, {})
        if self.config.server.mlockall:
            self.memory_locked = lock_memory()
        from edged.serving.inference import Inference, ModelControl
        from edged.serving.shared_memory import SharedMemory
        from edged.tracing.tracer import Tracer, device_of

        srv = self.config.server
        control = None
        if srv.model_control == "explicit":
            control = ModelControl(self.load_one, self.unload_one, lambda: self.unloaded)
        inference = Inference(
            lambda: self.models,
            self.metrics,
            lambda: self.failed,
            SharedMemory(
                srv.allow_shared_memory,
                max_regions=srv.max_shm_regions,
                max_per_client=srv.max_shm_regions_per_client,
            ),
            control,
            srv.tcp_control,
            Tracer(self.config.trace, srv.state_dir, *device_of(self.config.telemetry.mqtt)),
        )
        api = Api(
            inference,
            srv.max_body_bytes,
            self.status,
            reload=self._on_hup,
            max_decode_bytes=srv.max_decode_bytes,
            metrics_names=srv.metrics_names,
        )
        try:
            sockets = bind_sockets(self.config)
            self._socket_id = socket_identity(self.config)
            grpc_server = bind_grpc(inference, srv)  # None: gRPC is off
            frigate = None
            if self.config.frigate.enabled:
                from edged.serving.frigate_zmq import FrigateZmq

                frigate = FrigateZmq(inference, self.config.frigate, srv.socket_mode)
                frigate.bind()
            self.frigate = frigate
            self.listening = {
                "http": [describe(s) for s in sockets],
                "grpc": grpc_server.where if grpc_server is not None else [],
                "frigate": frigate.where if frigate is not None else [],
            }
        except OSError as exc:
            log.error("cannot listen: %s", exc)
            self.notifier.notify(f"STATUS=cannot listen: {exc}")
            stop_workers(self.models.values(), DRAIN_S)
            return EXIT_FAILED
        from edged.serving.device_metrics import register_collectors

        register_collectors(self.metrics.registry, lambda: self.models, lambda: self)
        self.start_telemetry()
        self.start_thermal()
        self._server = server = http_server(api, self.config.server, DRAIN_S)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop, sig)
        self._reload_lock = asyncio.Lock()
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        tasks = [asyncio.ensure_future(self._announce_ready(server, sockets))]
        tasks.append(asyncio.ensure_future(self._supervise()))
        from edged.hotplug import AcceleratorMonitor

        def on_hotplug(action: str, path: str) -> None:  # from the monitor's thread
            loop.call_soon_threadsafe(self._on_hotplug, action, path)

        monitor = AcceleratorMonitor(on_hotplug)
        monitor.start()
        interval = watchdog_interval_s()
        if interval:
            tasks.append(asyncio.ensure_future(self._watchdog(interval)))
        if grpc_server is not None:  # serving before HTTP, so READY=1 means both; drains with it
            await grpc_server.start()
            stop = grpc_server.stop_when(server.exit_requested, DRAIN_S)
            tasks.append(asyncio.ensure_future(stop))
        if frigate is not None:
            frigate.start()
        try:
            await server.serve(sockets=sockets)
            if not server.started:
                log.error("the HTTP server did not start")
                return EXIT_FAILED
        finally:
            monitor.stop()
            for task in tasks:
                task.cancel()
            if grpc_server is not None:
                await grpc_server.stop(DRAIN_S)
            if frigate is not None:
                await frigate.stop()
            await asyncio.to_thread(self.stop_thermal)  # no step acts on a stopping worker
            await asyncio.to_thread(stop_workers, list(self.models.values()), DRAIN_S)
            await asyncio.to_thread(inference.tracer.close)  # the trace file, the last spans
            left = inference.shared_memory.close()  # no worker holds a view now
            if left:
                log.warning("shared memory still mapped at exit: %s", ", ".join(left))
            # The last partial window, then the retained offline state before a clean
            # DISCONNECT (which suppresses the Will).
            if self.telemetry is not None:
                await asyncio.to_thread(self.telemetry.stop)
            if self.publisher is not None:
                await asyncio.to_thread(self.publisher.stop, 10.0)
            remove_socket_file(self.config, self._socket_id)
        log.info("stopped")
        return EXIT_OK

    def start_telemetry(self) -> None:
        if not self.config.telemetry.enabled:
            log.info("telemetry disabled ([telemetry] enabled = false)")
            return
        from edged.telemetry.loop import LogSink, TelemetryLoop
        from edged.telemetry.mqtt.log_publisher import LogPublisher

        publisher = open_telemetry(self.config.telemetry.mqtt, self.config.server.state_dir)
        self.publisher = publisher
        publisher.set_birth(self._birth())
        publisher.set_audit_handler(self._audit)
        publisher.start()
        # Without a broker: a summary line per payload at INFO, the payload itself at DEBUG
        # or in [telemetry] payload_file (birth, events and audit stay as the publisher logs
        # them).
        sink = (
            LogSink(publisher, self.config.telemetry.payload_file)
            if isinstance(publisher, LogPublisher)
            else publisher
        )
        telemetry = TelemetryLoop(
            self.config.telemetry.interval_s, lambda: self.models, sink, sampler=self.core_sampler()
        )
        self.telemetry = telemetry
        if self.config.tuning.auto != "off":
            from edged.autotune.loop import tuning_for

            self.tuning = tuning_for(self.config, self.cpu_plan, sink)
            if self.tuning is not None:
                telemetry.observers.append(self.tuning.observe)
        telemetry.start()

    def core_sampler(self):
        """The attribution sampler on the models' pinned CPUs (every CPU when none is
        pinned), reading this daemon's root; see edged.telemetry.sampler.inference_sampler."""
        from edged.telemetry.sampler import inference_sampler

        pinned = sorted({cpu for m in self.models.values() for cpu in (m.worker.cpus or ())})
        return inference_sampler(pinned or None, self.root, self.housekeeping)

    # -- CPU plan ----------------------------------------------------------------------------
    def with_cpu_plan(self, config: Config) -> Config:
        """`config` with its models on the CPUs edged.placement.plan_cpus decides (the tune
        unit's plan when no model names its CPUs). Sets `cpu_plan`."""
        config, self.cpu_plan = plan_cpus(
            config, self.root, self._allowed, self.housekeeping, self.cpu_plan
        )
        return config

    def _birth(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "hardware": self.hw.to_dict(),
            "models": {name: m.status() for name, m in self.models.items()},
            "failed": dict(self.failed),
        }

    def _audit(self, request: dict | None = None) -> dict[str, Any]:
        """The audit of the live system with the running config: at start, and for cmd/audit
        (`request`; called in the publisher's worker thread, never on the event loop), whose
        summary the publisher publishes retained on `audit`."""
        # Cores the daemon decided itself (no model sets cpus) are what the audit decides
        # on its own too; passing them would make them look configured to its checks.
        decided = self.cpu_plan is not None and self.cpu_plan.source != "models"
        from edged.config.audit import audit_summary

        return audit_summary(self.config, self.root, with_model_cpus=not decided)

    async def _audit_at_start(self) -> None:
        """One audit after READY, so `audit` holds this boot's state; in a thread, after
        readiness, so it never delays serving."""
        try:
            summary = await asyncio.to_thread(self._audit)
        except Exception:  # an audit that crashes must not take the daemon down
            log.exception("start-up audit failed")
            return
        log.info(
            "audit: %s; failing: %s", summary["statuses"], ", ".join(summary["failing"]) or "none"
        )
        if self.publisher is not None:
            self.publisher.publish_audit(summary)

    def _event(self, kind: str, message: str | None, **detail: Any) -> None:
        """A decision: logged as an event with its fields (None: logged where it was
        made) and published to the fleet."""
        if message is not None:
            logs.event(log, kind, "%s", message, **detail)
        if self.publisher is not None:
            self.publisher.publish_event(kind, detail)

    def _on_hup(self) -> None:
        """Reloads never overlap, and a HUP is never lost: one that comes while the model set
        is busy (a reload, a repository load or unload, a hot-plug) queues one reload, which
        runs when the set is free; HUPs while one is queued are that one."""
        if self._reload_queued:
            return
        self._reload_queued = True
        self._spawn(self._reload_serialized())

    async def _reload_serialized(self) -> None:
        assert self._reload_lock is not None
        async with self._reload_lock:
            self._reload_queued = False  # a HUP from now on is after this reload's read
            await self.reload()

    def _on_stop(self, sig: int) -> None:
        log.info("signal %s: draining and stopping", signal.Signals(sig).name)
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        if self._server is not None:
            self._server.request_exit()

    async def _announce_ready(self, server, sockets: list[socket.socket]) -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        where = ", ".join(self.listening["http"])
        log.info("serving %d model(s) on %s", len(self.models), where)
        self.notifier.notify("READY=1", f"STATUS={self._status_line()}")
        self.start_variant_jobs()
        if self.publisher is not None:
            self._spawn(self._audit_at_start())
        if _hup_during_start.is_set():  # a HUP that came while models were loading
            self._on_hup()

    def _spawn(self, coro) -> None:
        """Run `coro` as a task, referenced until done (the loop holds only a weak one)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self) -> None:
        """Re-read the config and swap changed models in. Whatever fails, the running config
        stays and systemd hears READY=1 (a unit left "reloading" is one nobody can reload)."""
        log.info("reloading %s", self.config.source)
        self.notifier.notify(
            "RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}", "STATUS=reloading"
        )
        try:
            await self._reload()
        except Exception as exc:
            reason = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ConfigError):
                log.exception("reload failed")
            self.last_reload_error = reason
            log.error("reload: keeping the running config: %s", reason)
            self.notifier.notify("READY=1", f"STATUS={self._status_line()}; reload failed")

    async def _reload(self) -> None:
        config = await asyncio.to_thread(load_config, self.config.source)
        config = self.with_cpu_plan(self._with_control(config))
        # [server] is bound at start (sockets, limits, CPUs): a change there waits for a
        # restart, says so, and the running values stay in force (stop must remove the
        # socket this process bound, not whatever sits at a new path).
        # So is [frigate] (its socket is bound at start).
        pending = [f"server.{k}" for k in server_changes(self.config.server, config.server)]
        pending += ["frigate"] if config.frigate != self.config.frigate else []
        if pending:
            log.warning(
                "reload: %s changed; that takes a restart (still serving with the running values)",
                ", ".join(pending),
            )
        # hang_s follows the models' watchdog_ms and is read live by the watchdog.
        config = replace(
            config,
            server=replace(self.config.server, hang_s=config.server.hang_s),
            frigate=self.config.frigate,
        )
        self.restart_needed = pending
        old = self.models
        models, failed = await asyncio.to_thread(self.load_models, config, old)
        self.models, self.failed, self.config = models, failed, config  # the atomic swap
        self.reloads += 1
        self.last_reload_error = "; ".join(f"{k}: {v}" for k, v in failed.items()) or None
        retired = [m for name, m in old.items() if models.get(name) is not m]
        await asyncio.to_thread(self._stop_models, retired)
        self.notifier.notify("READY=1", f"STATUS={self._status_line()}")
        self.start_variant_jobs()
        self._event(
            "reload",
            f"reloaded: {len(models)} model(s) served"
            + (f", failed: {', '.join(sorted(failed))}" if failed else "")
            + (f"; restart needed for {', '.join(pending)}" if pending else ""),
            models=sorted(models),
            failed=failed,
            replaced=sorted(m.name for m in retired),
            restart_needed=pending,
        )
        if self.publisher is not None:
            self.publisher.set_birth(self._birth())

    # -- INT8 variants made in the background ---------------------------------------------
    def _stop_models(self, models: list[ServedModel]) -> None:
        """Stop models that left the set (in a thread): after any variants swap under way
        in them, so none puts a session into a stopped worker."""
        with self._swap_lock:
            stop_workers(models, DRAIN_S)


_hup_during_start = threading.Event()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edged", description="edged inference daemon")
    parser.add_argument("--version", action="version", version=f"edged {__version__}")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG_PATH,
        help=f"TOML config (default {DEFAULT_CONFIG_PATH})",
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the config and exit (0 valid, 2 invalid)",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="auto",
        help="text, json (one object per line), journal (journald fields: MODEL, EVENT, ...);"
        " auto: journal when stderr is the journal, else text",
    )
    args = parser.parse_args(argv)
    # Until the event loop takes over, a SIGHUP (systemctl reload during a long first start)
    # must not kill the daemon: remember it and reload once serving.
    signal.signal(signal.SIGHUP, lambda *_: _hup_during_start.set())
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"edged: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as exc:  # a reader's bug on some file: restarting cannot fix it either
        print(f"edged: {args.config}: cannot be read: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print(f"edged: {config.source}: OK ({len(config.models)} model(s))")
        return EXIT_OK
    try:
        logs.setup(config.server.log_level, args.log_format)
    except OSError as exc:
        print(f"edged: --log-format {args.log_format}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not config.models:
        log.warning("%s: no [[models]]; serving nothing", config.source)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(Daemon(config).run())
    return uvloop.run(Daemon(config).run())


if __name__ == "__main__":
    sys.exit(main())
