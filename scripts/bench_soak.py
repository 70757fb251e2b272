#!/usr/bin/env python3
"""Soak: the real daemon under a mixed, hostile-ish load for a long time, sampled for growth.

edged runs unattended for months; what kills a device then is not one request but a slow
leak (a descriptor per stream, a thread per reload, a spool that never shrinks) or a latency
that creeps. This runs `python -m edged.daemon` (the cls model on onnxruntime, one thread;
shared memory, explicit model control and loopback control on; telemetry to a real Mosquitto
every 2 s) and drives it from threads at once, for --duration-s:

* HTTP inference over loopback TCP (binary tensors), a new connection every 50 requests;
* gRPC inference over the Unix socket (tritonclient.grpc), a new channel every 100;
* gRPC streams: open, five requests, close, about once a second;
* system shared memory over HTTP: create an object, register, infer into and out of it,
  unregister, destroy, every 2 s;
* bad requests (malformed JSON, a wrong shape, an unknown model, bytes that are no protobuf,
  a request abandoned halfway), each answered 4xx or dropped, about twice a second;
* SIGHUP (a reload) every 60 s; a second model unloaded and loaded again through the
  repository extension every 45 s;
* fleet commands (a rebirth, a garbage command) every 30 s, and the broker stopped for 30 s
  every 5 minutes (the spool fills, then drains).

The daemon runs with the Environment= of systemd/edged.service (the allocator settings there
change how RSS grows), as it would under the unit.

Every --sample-s the daemon's RSS, open descriptors and threads (psutil), its spool's pending
payload and file size, and the window's p50/p99 of HTTP inference (client side) are sampled.
After --warmup-s (runtimes' arenas and pools grow at first), each resource's growth is an
ordinary least squares slope per hour with its 95 % confidence interval (Student's t). A
resource is growing when the interval lies above zero and the slope over a day exceeds its
allowance (GOALS); the spool file is held to a bound instead. Latency: the last 10 minutes'
p99 against the first 10 minutes' after the warm-up, and the slope of every window's p99;
it is growing when the ratio is over the goal and the slope's interval lies above zero (on
a shared machine the two windows alone move with the neighbours).

Usage: bench_soak.py [--duration-s S] [--sample-s S] [--warmup-s S] [--no-broker]
                     [--actors LIST] [--out FILE] [--json]
       bench_soak.py --analyse FILE [--warmup-s S] [--json]   (the samples --out wrote)
Ctrl-C or SIGTERM stops it early (the daemon and broker it started stop too). Progress goes
to stderr once per sample; --out writes the samples as JSON lines as they come
(a long run leaves its record even if it is stopped). Exit 0: every goal met; 1: a goal
missed (growth, a good request failed, the daemon died); 2: it could not run (no model, no
daemon, bad arguments).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
from benchlib import log

UNIT = Path(__file__).resolve().parents[1] / "systemd" / "edged.service"


def unit_environment(unit: Path = UNIT) -> dict[str, str]:
    """The variables the unit's Environment= lines set (unquoted KEY=VALUE words only; the
    unit file uses no quoting)."""
    env: dict[str, str] = {}
    for line in unit.read_text().splitlines():
        if line.startswith("Environment="):
            for word in line.removeprefix("Environment=").split():
                key, _, value = word.partition("=")
                env[key] = value
    return env


# What a resource may grow per day (slope) before the run fails, when the growth is also
# significant (its 95 % interval above zero). Descriptors and threads should not grow at
# all: the allowance is noise from requests in flight at a sample. RSS: glibc's arenas and
# the runtimes' caches creep a little for hours before they settle.
# The spool's pending payload is bounded by spool_max_mb whatever happens; it is fitted so that
# one that never drains (acks lost) shows. Its file is checked against a bound instead: the
# payload bound, sqlite's pages and index (at most as much again), the WAL's own limit
# (journal_size_limit, 8 MiB) and 1 MiB to spare.
GOALS = {"fds": 24.0, "threads": 12.0, "rss_mb": 24.0, "spool_pending_kb": 1024.0}
SPOOL_MAX_MB = 1
SPOOL_FILE_BOUND_KB = (2 * SPOOL_MAX_MB + 8 + 1) * 1024
# The last P99_WINDOW_S's p99 against the first's after the warm-up (each the median of the
# sample windows' p99s; a quarter of the steady run each when it is shorter than four windows).
P99_WINDOW_S = 600.0
P99_RATIO_GOAL = 1.10
SHAPE = (1, 3, 48, 192)


class Counts:
    """Per actor: good answers, refusals that were expected, and failures that were not."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = self.refused = self.failed = 0
        self.errors: list[str] = []

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            if kind == "failed" and len(self.errors) < 20:
                self.errors.append(detail[:300])

    def to_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "ok": self.ok,
                "refused": self.refused,
                "failed": self.failed,
                "errors": list(self.errors),
            }


class Soak:
    def __init__(self, folder: Path, model: Path, broker: Any) -> None:
        import numpy as np

        self.folder, self.model, self.broker = folder, model, broker
        self.stop = threading.Event()
        self.counts: dict[str, Counts] = {}
        self.latencies: list[float] = []  # HTTP inference, this sample window (seconds)
        self.lat_lock = threading.Lock()
        self.x = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
        self.daemon: Any = None
        self.broker_down = False
        self.broker_lock = threading.Lock()

    # -- the daemon -------------------------------------------------------------------------
    def config(self) -> Path:
        mqtt = (
            f'[telemetry.mqtt]\nurl = "{self.broker.url}"\ngroup = "soak"\n'
            f'device_id = "soak"\nspool_max_mb = {SPOOL_MAX_MB}\n'
            if self.broker
            else ""
        )
        table = """
[[models]]
name = "{name}"
path = "{path}"
backend = "onnxruntime"
threads = 1
shapes = {{ x = [1, 3, 48, 192] }}
"""
        config = self.folder / "edged.toml"
        config.write_text(f"""
[server]
listen = "127.0.0.1:0"
socket = "{self.folder / "edged.sock"}"
grpc_socket = "{self.folder / "grpc.sock"}"
state_dir = "{self.folder / "state"}"
allow_shared_memory = true
model_control = "explicit"
tcp_control = true
log_level = "info"  # the harness reads the TCP port from the log

[selection]
runs = 10
warmup = 1
time_budget_s = 1.0

[telemetry]
interval_s = 2
{mqtt}
{table.format(name="cls", path=self.model)}
{table.format(name="cls2", path=self.model)}
""")
        return config

    def start(self) -> None:
        from tests.support.daemon_harness import Daemon

        env = unit_environment()
        log(f"daemon environment from {UNIT.name}: {' '.join(f'{k}={v}' for k, v in env.items())}")
        self.daemon = Daemon(self.config(), env=env).wait_ready(timeout=300)
        if self.daemon.port is None:
            raise RuntimeError(f"no TCP port in the log:\n{self.daemon.log_text()[-3000:]}")

    @property
    def alive(self) -> bool:
        return self.daemon.proc.poll() is None

    # -- the actors -------------------------------------------------------------------------
    def actor(self, name: str, period_s: float, step: Callable[[Counts], None]) -> threading.Thread:
        counts = self.counts.setdefault(name, Counts())

        def run() -> None:
            next_at = time.monotonic()
            while not self.stop.is_set():
                try:
                    step(counts)
                except Exception as exc:  # an actor never dies: what failed is counted
                    counts.add("failed", f"{type(exc).__name__}: {exc}")
                next_at += period_s
                self.stop.wait(max(0.0, next_at - time.monotonic()))

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def http_infer(self) -> Callable[[Counts], None]:
        from tests.support.daemon_harness import binary_request, post

        body = binary_request(self.x)
        state: dict[str, Any] = {"conn": None, "n": 0}

        def step(counts: Counts) -> None:
            if state["conn"] is None or state["n"] % 50 == 0:
                if state["conn"] is not None:
                    state["conn"].close()
                state["conn"] = http.client.HTTPConnection(self.daemon.address, timeout=30)
            state["n"] += 1
            started = time.perf_counter()
            try:
                status, text = post(state["conn"], "cls", body)
            except (OSError, http.client.HTTPException) as exc:
                state["conn"].close()
                state["conn"] = None
                counts.add("failed", f"http: {exc!r}")
                return
            with self.lat_lock:
                self.latencies.append(time.perf_counter() - started)
            counts.add("ok" if status == 200 else "failed", f"http {status}: {text[:200]!r}")

        return step

    def grpc_infer(self) -> Callable[[Counts], None]:
        import tritonclient.grpc as tg

        url = f"unix://{self.folder / 'grpc.sock'}"
        state: dict[str, Any] = {"client": None, "n": 0}

        def step(counts: Counts) -> None:
            if state["client"] is None or state["n"] % 100 == 0:
                if state["client"] is not None:
                    state["client"].close()
                state["client"] = tg.InferenceServerClient(url)
            state["n"] += 1
            inp = tg.InferInput("x", list(SHAPE), "FP32")
            inp.set_data_from_numpy(self.x)
            state["client"].infer("cls", [inp], client_timeout=30)
            counts.add("ok")

        return step

    def grpc_stream(self) -> Callable[[Counts], None]:
        import queue

        import tritonclient.grpc as tg

        url = f"unix://{self.folder / 'grpc.sock'}"

        def step(counts: Counts) -> None:
            answers: queue.Queue = queue.Queue()
            with tg.InferenceServerClient(url) as client:
                client.start_stream(callback=lambda result, error: answers.put(error))
                try:
                    for _ in range(5):
                        inp = tg.InferInput("x", list(SHAPE), "FP32")
                        inp.set_data_from_numpy(self.x)
                        client.async_stream_infer("cls", [inp])
                    for _ in range(5):
                        error = answers.get(timeout=30)
                        counts.add("ok" if error is None else "failed", f"stream: {error}")
                finally:
                    client.stop_stream()

        return step

    def shm(self) -> Callable[[Counts], None]:
        import tritonclient.http as th
        import tritonclient.utils.shared_memory as shm

        nbytes = int(self.x.nbytes)

        def step(counts: Counts) -> None:
            key = f"/edged_soak_{os.getpid()}"
            region = shm.create_shared_memory_region("soak", key, nbytes + 4096)
            try:
                with th.InferenceServerClient(self.daemon.address) as client:
                    shm.set_shared_memory_region(region, [self.x])
                    client.register_system_shared_memory("soak", key, nbytes + 4096)
                    try:
                        inp = th.InferInput("x", list(SHAPE), "FP32")
                        inp.set_shared_memory("soak", nbytes)
                        client.infer("cls", [inp])
                        counts.add("ok")
                    finally:
                        client.unregister_system_shared_memory("soak")
            finally:
                shm.destroy_shared_memory_region(region)

        return step

    def bad(self) -> Callable[[Counts], None]:
        import numpy as np

        from tests.support.daemon_harness import binary_request, post

        wrong = binary_request(np.zeros((1, 3, 48, 100), np.float32))
        kinds = ["json", "shape", "model", "grpc", "half"]
        state = {"n": 0}

        def step(counts: Counts) -> None:
            kind = kinds[state["n"] % len(kinds)]
            state["n"] += 1
            if kind == "grpc":
                import grpc

                with grpc.insecure_channel(f"unix://{self.folder / 'grpc.sock'}") as channel:
                    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                    try:
                        call(b"\xff\xff\xff not a protobuf", timeout=10)
                        counts.add("failed", "gRPC garbage was answered OK")
                    except grpc.RpcError as exc:
                        ok = exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                        counts.add("refused" if ok else "failed", f"grpc garbage: {exc.code()}")
                return
            if kind == "half":  # headers promising a body that never comes, then gone
                with socket.create_connection(("127.0.0.1", self.daemon.port), timeout=10) as s:
                    s.sendall(
                        b"POST /v2/models/cls/infer HTTP/1.1\r\nHost: x\r\n"
                        b'Content-Length: 100000\r\n\r\n{"inputs"'
                    )
                counts.add("refused")
                return
            conn = http.client.HTTPConnection(self.daemon.address, timeout=30)
            try:
                if kind == "json":
                    conn.request("POST", "/v2/models/cls/infer", body=b'{"inputs": [{"name": ')
                    response = conn.getresponse()
                    status = response.status
                    response.read()
                elif kind == "shape":
                    status, _ = post(conn, "cls", wrong)
                else:
                    status, _ = post(conn, "no-such-model", wrong)
            finally:
                conn.close()
            ok = 400 <= status < 500
            counts.add("refused" if ok else "failed", f"bad {kind}: HTTP {status}")

        return step

    def reload(self) -> Callable[[Counts], None]:
        def step(counts: Counts) -> None:
            self.daemon.signal(signal.SIGHUP)
            counts.add("ok")

        return step

    def repository(self) -> Callable[[Counts], None]:
        def step(counts: Counts) -> None:
            for action in ("unload", "load"):
                conn = http.client.HTTPConnection(self.daemon.address, timeout=120)
                try:
                    conn.request("POST", f"/v2/repository/models/cls2/{action}", body=b"{}")
                    response = conn.getresponse()
                    text = response.read()
                finally:
                    conn.close()
                counts.add(
                    "ok" if response.status == 200 else "failed",
                    f"{action}: HTTP {response.status} {text[:200]!r}",
                )

        return step

    def commands(self) -> Callable[[Counts], None]:
        from tests.support.broker import pub

        def step(counts: Counts) -> None:
            with self.broker_lock:  # never while the outage actor stops or starts it
                if self.broker_down:
                    return
                pub(self.broker.port, "edged/v1/soak/soak/cmd/rebirth", '{"id": "soak"}')
                pub(self.broker.port, "edged/v1/soak/soak/cmd/x" + "y" * 100, "{not json")
            counts.add("ok")

        return step

    def outages(self) -> Callable[[Counts], None]:
        state = {"n": 0}

        def step(counts: Counts) -> None:
            state["n"] += 1
            if state["n"] == 1:
                return  # the first period runs with the broker up
            with self.broker_lock:
                self.broker_down = True
                self.broker.stop()
            self.stop.wait(30)
            with self.broker_lock:
                self.broker.start()
                self.broker_down = False
            counts.add("ok")

        return step

    # -- sampling ---------------------------------------------------------------------------
    def spool_pending(self) -> int:
        """Payload bytes the spool holds unsent or unacknowledged (read-only, beside the
        daemon's own connection: WAL readers do not block its writer)."""
        import sqlite3

        path = self.folder / "state" / "telemetry-spool.sqlite"
        if not path.exists():
            return 0
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute("SELECT coalesce(sum(length(payload)), 0) FROM items").fetchone()[0]
        except sqlite3.Error:
            return 0
        finally:
            db.close()

    def sample(self, started: float) -> dict[str, Any]:
        import psutil

        proc = psutil.Process(self.daemon.proc.pid)
        with proc.oneshot():
            rss, fds, threads = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
            cpu = sum(proc.cpu_times()[:2])
        files = list((self.folder / "state").glob("telemetry-spool.sqlite*"))
        spool_file = sum(p.stat().st_size for p in files if p.exists())
        with self.lat_lock:
            window, self.latencies = self.latencies, []
        p50 = p99 = None
        if window:
            stats = benchlib.latency_stats(window)
            p50, p99 = stats.p50_ms, stats.p99_ms
        return {
            "t_s": round(time.monotonic() - started, 1),
            "rss_mb": round(rss / 2**20, 2),
            "fds": fds,
            "threads": threads,
            "spool_file_kb": round(spool_file / 1024, 1),
            "spool_pending_kb": round(self.spool_pending() / 1024, 1),
            "cpu_s": round(cpu, 2),
            "requests": len(window),
            "p50_ms": p50,
            "p99_ms": p99,
            "broker_down": self.broker_down,
        }


# -- analysis -----------------------------------------------------------------------------
def t_975(df: int) -> float:
    """Student's t quantile 0.975 for `df` degrees of freedom (Cornish-Fisher expansion about
    the normal's 1.96; within 0.3 % of the exact value from df = 5 up; no SciPy here)."""
    z = 1.959964
    if df <= 0:
        return math.inf
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def slope(ts: list[float], ys: list[float]) -> dict[str, float] | None:
    """OLS slope of ys over ts (per hour) with its 95 % confidence interval."""
    n = len(ts)
    if n < 4:
        return None
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx == 0:
        return None
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / sxx
    a = my - b * mt
    rss = sum((y - (a + b * t)) ** 2 for t, y in zip(ts, ys, strict=True))
    se = math.sqrt(rss / (n - 2) / sxx)
    half = t_975(n - 2) * se
    per_h = 3600.0
    return {"per_h": b * per_h, "low_per_h": (b - half) * per_h, "high_per_h": (b + half) * per_h}


def analyse(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    steady = [s for s in samples if s["t_s"] >= warmup_s]
    verdicts: dict[str, Any] = {}
    for key, per_day in GOALS.items():
        fit = slope([s["t_s"] for s in steady], [float(s[key]) for s in steady])
        growing = bool(fit and fit["low_per_h"] > 0 and fit["per_h"] * 24 > per_day)
        verdicts[key] = {
            "start": steady[0][key] if steady else None,
            "end": steady[-1][key] if steady else None,
            "max": max((s[key] for s in steady), default=None),
            "slope": fit,
            "allowance_per_day": per_day,
            "growing": growing,
        }
    biggest = max((s["spool_file_kb"] for s in samples), default=0.0)
    verdicts["spool_file_kb"] = {
        "max": biggest,
        "bound": SPOOL_FILE_BOUND_KB,
        "growing": biggest > SPOOL_FILE_BOUND_KB,
    }
    verdicts["p99"] = p99_drift(steady)
    return verdicts


def p99_drift(steady: list[dict[str, Any]]) -> dict[str, Any]:
    """The median window p99 of the last P99_WINDOW_S against the first's (module doc)."""
    timed = [s for s in steady if s["p99_ms"] is not None]
    if len(timed) < 4:
        return {"first_ms": None, "last_ms": None, "ratio": None, "growing": False}
    t0, t1 = timed[0]["t_s"], timed[-1]["t_s"]
    window = min(P99_WINDOW_S, (t1 - t0) / 4)
    first = statistics.median(s["p99_ms"] for s in timed if s["t_s"] <= t0 + window)
    last = statistics.median(s["p99_ms"] for s in timed if s["t_s"] >= t1 - window)
    ratio = round(last / first, 3) if first else None
    # The two windows alone are at the mercy of a shared machine's neighbours (the p50 moves
    # with them too); the slope of every window's p99 over the steady run says whether the
    # daemon itself creeps. Growing: over the goal AND an upward trend.
    fit = slope([s["t_s"] for s in timed], [s["p99_ms"] for s in timed])
    return {
        "window_s": window,
        "first_ms": first,
        "last_ms": last,
        "ratio": ratio,
        "goal": P99_RATIO_GOAL,
        "slope": fit,
        "growing": bool(ratio and ratio > P99_RATIO_GOAL and fit and fit["low_per_h"] > 0),
    }


def print_verdicts(verdicts: dict[str, Any]) -> None:
    for key in GOALS:
        v = verdicts[key]
        fit = v["slope"]
        shown = (
            f"{fit['per_h']:+.2f}/h (95 % CI {fit['low_per_h']:+.2f} .. {fit['high_per_h']:+.2f})"
            if fit
            else "n/a"
        )
        print(
            f"  {key:<16} {v['start']} -> {v['end']} (max {v['max']}): slope {shown}, "
            f"allowance {v['allowance_per_day']}/day: {'GROWING' if v['growing'] else 'ok'}"
        )
    f = verdicts["spool_file_kb"]
    print(
        f"  spool file at most {f['max']:.0f} KiB (bound {f['bound']} KiB): "
        f"{'OVER' if f['growing'] else 'ok'}"
    )
    p = verdicts["p99"]
    trend = p.get("slope")
    shown = (
        f"{trend['per_h']:+.2f} ms/h (95 % CI {trend['low_per_h']:+.2f} .. "
        f"{trend['high_per_h']:+.2f})"
        if trend
        else "n/a"
    )
    print(
        f"  p99 (median of {p.get('window_s', 0):.0f} s of windows) first {p['first_ms']} ms, "
        f"last {p['last_ms']} ms: ratio {p['ratio']} (goal <= {P99_RATIO_GOAL}); trend "
        f"{shown}: {'GROWING' if p['growing'] else 'ok'}"
    )


def analyse_file(path: str, warmup_s: float, as_json: bool) -> int:
    """Re-analyse the samples a run wrote with --out (a run cut short leaves them too)."""
    try:
        samples = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    except (OSError, ValueError) as exc:
        log(f"{path}: cannot read the samples: {exc}")
        return 2
    if len(samples) < 4:
        log(f"{path}: {len(samples)} samples, too few to fit")
        return 2
    verdicts = analyse(samples, warmup_s)
    report = {"samples_file": path, "samples": len(samples), "warmup_s": warmup_s}
    report["span_s"] = samples[-1]["t_s"]
    report["verdicts"] = verdicts
    if as_json:
        benchlib.write_json(report)
    else:
        print(
            f"{path}: {len(samples)} samples over {report['span_s']:.0f} s "
            f"(warm-up {warmup_s:.0f} s)"
        )
        print_verdicts(verdicts)
    return 1 if any(v["growing"] for v in verdicts.values()) else 0


# -- the run ------------------------------------------------------------------------------
PERIODS = {  # actor: seconds between its steps
    "http_infer": 1 / 15,
    "grpc_infer": 1 / 10,
    "grpc_stream": 1.0,
    "shm": 2.0,
    "bad": 0.5,
    "reload": 60.0,
    "repository": 45.0,
    "commands": 30.0,
    "outages": 300.0,
}


def run(args: argparse.Namespace) -> int:
    from fetch_test_data import models_dir

    model = models_dir() / "ppocr_cls.onnx"
    if not model.exists():
        log(f"no model at {model} (run scripts/fetch_test_data.py)")
        return 2
    started_wall = time.perf_counter()
    report: dict[str, Any] = benchlib.report_header("soak")
    report.update(
        duration_s=args.duration_s,
        sample_s=args.sample_s,
        warmup_s=args.warmup_s,
        loadavg_1min_start=benchlib.loadavg(),
        periods=PERIODS,
        goals=GOALS,
    )
    log(benchlib.machine_line(report["machine"]))
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 (closed in finally)
    with tempfile.TemporaryDirectory(prefix="edged-soak-") as tmp:
        folder = Path(tmp)
        broker = None
        if not args.no_broker:
            from tests.support.broker import MOSQUITTO, Broker

            if shutil.which(MOSQUITTO) is None and not Path(MOSQUITTO).exists():
                log("mosquitto is not installed: --no-broker, or apt-get install mosquitto")
                return 2
            broker = Broker(folder / "broker").start()
        soak = Soak(folder, model, broker)
        samples: list[dict[str, Any]] = []
        died = None
        try:
            try:
                soak.start()
            except (AssertionError, RuntimeError) as exc:
                log(f"the daemon did not start: {exc}")
                return 2
            actors = {
                "http_infer": soak.http_infer(),
                "grpc_infer": soak.grpc_infer(),
                "grpc_stream": soak.grpc_stream(),
                "shm": soak.shm(),
                "bad": soak.bad(),
                "reload": soak.reload(),
                "repository": soak.repository(),
            }
            if broker is not None:
                actors["commands"] = soak.commands()
                actors["outages"] = soak.outages()
            if args.actors:
                actors = {name: step for name, step in actors.items() if name in args.actors}
            started = time.monotonic()
            threads = [soak.actor(n, PERIODS[n], step) for n, step in actors.items()]
            try:
                while time.monotonic() - started < args.duration_s:
                    soak.stop.wait(args.sample_s)
                    if not soak.alive:
                        died = soak.daemon.proc.returncode
                        log(f"the daemon died (exit {died})")
                        break
                    s = soak.sample(started)
                    samples.append(s)
                    if out:
                        out.write(json.dumps(s) + "\n")
                        out.flush()
                    log(
                        f"{s['t_s']:>7.0f} s  rss {s['rss_mb']:.1f} MiB  fds {s['fds']}  threads "
                        f"{s['threads']}  spool {s['spool_pending_kb']:.0f} KiB pending, file "
                        f"{s['spool_file_kb']:.0f} KiB  p99 {s['p99_ms']} ms  "
                        f"({s['requests']} requests{', broker down' if s['broker_down'] else ''})"
                    )
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the samples so far are the run
                log(f"stopped early, after {len(samples)} samples")
                report["stopped_early"] = True
            soak.stop.set()
            for thread in threads:
                thread.join(60)
        finally:
            soak.stop.set()
            if soak.daemon is not None:
                code = soak.daemon.stop(60)
                report["daemon_exit"] = code
                report["daemon_log_tail"] = soak.daemon.log_text()[-4000:]
            if broker is not None and broker.proc is not None:
                broker.stop()
            if out:
                out.close()
    counts = {name: c.to_dict() for name, c in soak.counts.items()}
    verdicts = analyse(samples, args.warmup_s)
    failed_requests = sum(c["failed"] for c in counts.values())
    growing = [k for k, v in verdicts.items() if v["growing"]]
    report.update(samples=samples, counts=counts, verdicts=verdicts, died=died)
    ok = died is None and failed_requests == 0 and not growing and report.get("daemon_exit") == 0
    report["ok"] = ok
    if args.json:
        benchlib.finish(report, started_wall, True)
    else:
        print(benchlib.machine_line(report["machine"]))
        print(
            f"soak of {args.duration_s:.0f} s, {len(samples)} samples "
            f"(warm-up {args.warmup_s:.0f} s)"
        )
        for name, c in counts.items():
            print(
                f"  {name:<12} ok {c['ok']:>7}  refused as expected {c['refused']:>6}  "
                f"failed {c['failed']}"
            )
            for error in c["errors"][:3]:
                print(f"      {error}")
        print_verdicts(verdicts)
        print(
            f"  daemon: {'died, exit ' + str(died) if died is not None else 'up'}; "
            f"stopped with exit {report.get('daemon_exit')}"
        )
        benchlib.finish(report, started_wall, False)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="samples before this are not fitted (default: 10%% of the duration, at least 60 s)",
    )
    parser.add_argument("--no-broker", action="store_true", help="no Mosquitto, no telemetry")
    parser.add_argument("--out", help="write each sample as a JSON line to this file")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--analyse", metavar="FILE", help="analyse the samples of --out FILE")
    parser.add_argument(
        "--actors",
        type=lambda text: [a for a in text.split(",") if a],
        help=f"only these load actors (comma-separated; of {', '.join(PERIODS)}): to find "
        "which part of the load a growth comes from",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    unknown = sorted(set(args.actors or ()) - set(PERIODS))
    if unknown:
        log(f"--actors: no actor {unknown[0]!r}; the actors are {', '.join(PERIODS)}")
        return 2
    if args.analyse:
        warmup = args.warmup_s if args.warmup_s is not None else 60.0
        return analyse_file(args.analyse, warmup, args.json)
    if args.warmup_s is None:
        args.warmup_s = max(60.0, 0.1 * args.duration_s)
    # SIGTERM (a CI timeout, `kill`) ends the run like Ctrl-C: the daemon and the broker it
    # started are stopped in run()'s finally blocks, not left behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.duration_s <= args.warmup_s + 4 * args.sample_s:
        log("--duration-s must leave at least four samples after the warm-up")
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
