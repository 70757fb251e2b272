#!/usr/bin/env python3
"""What does serving a model through edged add over running it in-process?

One model, one backend, pinned everywhere (onnxruntime CPU, 1 intra-op thread), timed as
sequential single-client latency along five paths:

  (a) in-process `session.run` (the backend loaded with `LoadOptions(threads=1)`);
  (b) a bare ASGI endpoint on the daemon's HTTP stack (uvicorn + httptools + uvloop, started
      by this script in a subprocess) that decodes the binary tensor request minimally and
      calls the same kind of session on the event loop: the floor of any Python HTTP server.
      Hit with a keep-alive http.client (the very code of `edged.client.Client`, so the
      client side is identical to path e) and with tritonclient (binary tensors);
  (c) edged, the real daemon process (temp config, max_batch_size 1), from tritonclient/TCP;
  (d) edged from `edged.client.Client` over the Unix socket;
  (e) edged from `edged.client.Client` over TCP.

Paths are interleaved in blocks within a round (the order rotates per round) and the figures
are medians over rounds of per-round figures; "added" is path minus in-process of the same
round, and ratios are taken per round. Then closed-loop concurrency (1/4/16 client threads,
each its own keep-alive Client over TCP) against two daemons run alternately, dynamic
batching on (max_batch_size 8, max_queue_delay_us 500) and off (max_batch_size 1); then the
daemon's RSS and idle CPU, and start-to-READY (fresh state dir, then the same one: cached).

Run from a checkout: `.venv/bin/python scripts/bench_serving.py [--json]` (about 2 minutes;
exit status 1 when a latency target is missed).
Internal: `--serve-bare MODEL` runs the bare endpoint (used by the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import benchlib  # also: the tests' NotifySocket (tests/support/daemon_harness.py)
import numpy as np
from benchlib import log
from fetch_test_data import models_dir

from backends import LoadOptions, get_backend
from backends.model_info import inspect_model
from edged.client import Client
from edged.selection.bench import LatencyStats
from edged.selection.inputs import make_inputs, parse_shape_args, resolve_shapes
from edged.serving.protocol import DATATYPES, datatype_of

ROOT = Path(__file__).resolve().parent.parent

BACKEND = "onnxruntime"
THREADS = 1
MODEL_NAME = "bench"
DEFAULT_MODEL = "ppocr_cls.onnx"
DEFAULT_SHAPES = {"ppocr_cls": "x=1x3x48x192"}  # file stem prefix -> --shape default
BLOCK = 20  # requests per path per turn within a round
WARMUP = 50  # untimed requests per path before the first round
CONCURRENCY = (1, 4, 16)
CELL_TIME_LIMIT_S = 20.0  # bound on one concurrency cell, whatever the request count
READY_TIMEOUT_S = 180.0
TARGET_RATIO = 1.3  # edged added latency <= 1.3x the bare floor's, at p50
TARGET_P99_ADDED_MS = 2.0

PATHS = {
    "inproc": "(a) in-process session.run",
    "bare_http": "(b) bare ASGI, http.client",
    "bare_triton": "(b) bare ASGI, tritonclient",
    "edged_triton": "(c) edged TCP, tritonclient",
    "edged_unix": "(d) edged Unix, edged Client",
    "edged_tcp": "(e) edged TCP, edged Client",
}


# -- the model ------------------------------------------------------------------------------


def load_session(path: Path):
    """The backend loaded as the daemon is pinned to run it: onnxruntime CPU, one thread."""
    from backends import probe_hardware

    info = inspect_model(path)
    backend = get_backend(BACKEND)
    candidate = next(
        c for c in backend.candidates(probe_hardware(), info) if c.available and c.device == "CPU"
    )
    return backend.load(info, candidate, LoadOptions(threads=THREADS))


def default_shape_arg(path: Path) -> list[str]:
    return [v for k, v in DEFAULT_SHAPES.items() if path.stem.startswith(k)][:1]


# -- (b) the bare endpoint, run in a subprocess ---------------------------------------------


def bare_app(session) -> Callable:
    """Minimal OIP binary-tensor infer: no routing, no validation beyond the session's own,
    no metrics, inference on the event loop. Any GET answers 200 (used as a readiness probe)."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await respond(send, b'{"ready":true}', [(b"content-type", b"application/json")])
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        head_len = int(dict(scope["headers"])[b"inference-header-content-length"])
        offset = head_len
        feeds = {}
        for item in json.loads(body[:head_len])["inputs"]:
            dtype = DATATYPES[item["datatype"]]
            size = item["parameters"]["binary_data_size"]
            feeds[item["name"]] = np.frombuffer(
                body, dtype, size // dtype.itemsize, offset
            ).reshape(item["shape"])
            offset += size
        outputs = session.run(feeds)
        meta, blobs = [], []
        for name, array in outputs.items():
            data = np.ascontiguousarray(array).tobytes()
            meta.append(
                {
                    "name": name,
                    "datatype": datatype_of(array.dtype.name),
                    "shape": list(array.shape),
                    "parameters": {"binary_data_size": len(data)},
                }
            )
            blobs.append(data)
        head = json.dumps(
            {"model_name": MODEL_NAME, "outputs": meta}, separators=(",", ":")
        ).encode()
        await respond(
            send,
            head + b"".join(blobs),
            [
                (b"content-type", b"application/octet-stream"),
                (b"inference-header-content-length", str(len(head)).encode()),
            ],
        )

    async def respond(send, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*headers, (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def serve_bare(model: Path) -> int:
    import uvicorn
    import uvloop

    session = load_session(model)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    config = uvicorn.Config(
        bare_app(session), http="httptools", lifespan="off", access_log=False, log_config=None
    )
    print(sock.getsockname()[1], flush=True)  # the parent reads the port from this line
    uvloop.run(uvicorn.Server(config).serve(sockets=[sock]))
    return 0


class BareServer:
    def __init__(self, model: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-bare", str(model)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # bounded: the child prints or exits
        if not line.isdigit():
            self.stop()
            raise RuntimeError(f"bare server did not start (got {line!r})")
        self.port = int(line)
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("bare server did not answer")
            time.sleep(0.05)

    def stop(self) -> None:
        benchlib.stop_child(self.proc)


# -- the real daemon --------------------------------------------------------------------------


def _notify_socket_class():
    from tests.support.daemon_harness import NotifySocket

    class TimedNotifySocket(NotifySocket):
        """The harness's sd_notify reader, with the arrival time of each datagram."""

        def __init__(self, path: Path) -> None:
            self.stamps: list[tuple[float, str]] = []
            super().__init__(path)

        def _read(self) -> None:
            while not self._closed.is_set():
                try:
                    message = self.sock.recv(4096).decode()
                except TimeoutError:
                    continue
                except OSError:
                    return
                self.stamps.append((time.perf_counter(), message))
                self.messages.append(message)

    return TimedNotifySocket


def write_config(
    folder: Path,
    model: Path,
    shapes: Mapping[str, tuple[int, ...]],
    state_dir: Path,
    max_batch: int,
    delay_us: int,
) -> Path:
    """The daemon pinned as in-process: backend onnxruntime, 1 thread, default selection."""
    shape_items = ", ".join(f"{json.dumps(k)} = {list(v)}" for k, v in shapes.items())
    config = folder / "edged.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:0"
socket = "{folder / "edged.sock"}"
state_dir = "{state_dir}"
log_level = "info"

[[models]]
name = "{MODEL_NAME}"
path = "{model}"
backend = "{BACKEND}"
threads = {THREADS}
shapes = {{ {shape_items} }}
max_batch_size = {max_batch}
max_queue_delay_us = {delay_us}
""")
    return config


class Edged:
    """`python -m edged.daemon` with a sd_notify socket, as tests/support/daemon_harness.py runs it;
    start-to-READY is timed from just before the spawn to the READY=1 datagram."""

    def __init__(self, folder: Path, config: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.notify = _notify_socket_class()(folder / "notify.sock")
        self.log_path = folder / "edged.log"
        self._log = self.log_path.open("w")
        env = {**os.environ, "NOTIFY_SOCKET": str(self.notify.path)}
        env.pop("WATCHDOG_USEC", None)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edged.daemon", "--config", str(config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        self.ready_s: float | None = None
        self.port: int | None = None

    def wait_ready(self) -> Edged:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.ready_s is None:
            for stamp, message in list(self.notify.stamps):
                if "READY=1" in message.split("\n"):
                    self.ready_s = stamp - self.started
                    break
            else:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"edged not ready; log:\n{self.log_text()}")
                time.sleep(0.005)
        match = re.search(r"on http://127\.0\.0\.1:(\d+)", self.log_text())
        if not match:
            raise RuntimeError(f"no TCP port in the log:\n{self.log_text()}")
        self.port = int(match.group(1))
        return self

    @property
    def tcp(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def unix(self) -> str:
        return f"unix:{self.folder / 'edged.sock'}"

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(15)
        finally:
            self._log.close()
            self.notify.close()


def _metric(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def batch_totals(address: str) -> tuple[float, float]:
    """(sum, count) of edged_batch_size: each request observes the size of its batch."""
    with Client(address, timeout=10) as client:
        text = client.get_text("/metrics")
    labels = f'model="{MODEL_NAME}"'
    return (
        _metric(text, "edged_batch_size_sum", labels),
        _metric(text, "edged_batch_size_count", labels),
    )


def phase_totals(address: str) -> dict[str, tuple[float, float]]:
    """phase -> (sum s, count) of edged_request_duration_seconds (queue, compute, total:
    the daemon's own view, from the handler's start to the response handed to uvicorn)."""
    with Client(address, timeout=10) as client:
        text = client.get_text("/metrics")
    name = "edged_request_duration_seconds"
    return {
        phase: (
            _metric(text, f"{name}_sum", f'model="{MODEL_NAME}",phase="{phase}"'),
            _metric(text, f"{name}_count", f'model="{MODEL_NAME}",phase="{phase}"'),
        )
        for phase in ("queue", "compute", "total")
    }


def phase_means(
    before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]
) -> dict[str, float]:
    means = {}
    for phase, (total, count) in after.items():
        n = count - before[phase][1]
        means[f"{phase}_mean_ms"] = round((total - before[phase][0]) / n * 1e3, 4) if n else 0.0
    return means


# -- clients ------------------------------------------------------------------------------------


def triton_runner(address: str, feeds: Mapping[str, np.ndarray], outputs: list[str]):
    import tritonclient.http as th

    client = th.InferenceServerClient(url=address, connection_timeout=30.0, network_timeout=30.0)

    def run() -> dict[str, np.ndarray]:
        inputs = []
        for name, array in feeds.items():
            item = th.InferInput(name, list(array.shape), datatype_of(array.dtype.name))
            item.set_data_from_numpy(array, binary_data=True)
            inputs.append(item)
        wanted = [th.InferRequestedOutput(name, binary_data=True) for name in outputs]
        result = client.infer(MODEL_NAME, inputs, outputs=wanted)
        return {name: result.as_numpy(name) for name in outputs}

    return run, client.close


def client_runner(address: str, feeds: Mapping[str, np.ndarray]):
    client = Client(address, timeout=30.0)
    return (lambda: client.infer(MODEL_NAME, feeds)), client.close


# -- phase 1: sequential latency ----------------------------------------------------------------


def sequential(
    runners: Mapping[str, Callable[[], Any]],
    requests: int,
    rounds: int,
    block: int = BLOCK,
    warmup: int = WARMUP,
) -> list[dict[str, LatencyStats]]:
    """Each round: every path in turn, `block` requests at a time, the order rotated per
    round; returns per-round stats per path."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    keys = list(runners)
    per_round = []
    for r in range(rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate who goes first
        samples: dict[str, list[int]] = {k: [] for k in keys}
        while any(len(samples[k]) < requests for k in keys):
            for key in order:
                run = runners[key]
                for _ in range(min(block, requests - len(samples[key]))):
                    start = time.perf_counter_ns()
                    run()
                    samples[key].append(time.perf_counter_ns() - start)
        stats = {k: LatencyStats.from_ns(v) for k, v in samples.items()}
        per_round.append(stats)
        log(
            f"round {r + 1}/{rounds}: "
            + ", ".join(f"{k} {s.p50_ms:.3f}/{s.p99_ms:.3f}" for k, s in stats.items())
            + " (p50/p99 ms)"
        )
    return per_round


def summarize_sequential(per_round: list[dict[str, LatencyStats]]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for key in PATHS:
        p50 = [r[key].p50_ms for r in per_round]
        p99 = [r[key].p99_ms for r in per_round]
        add50 = [r[key].p50_ms - r["inproc"].p50_ms for r in per_round]
        add99 = [r[key].p99_ms - r["inproc"].p99_ms for r in per_round]
        paths[key] = {
            "label": PATHS[key],
            "p50_ms": round(benchlib.median(p50), 4),
            "p99_ms": round(benchlib.median(p99), 4),
            "added_p50_ms": round(benchlib.median(add50), 4),
            "added_p99_ms": round(benchlib.median(add99), 4),
            "p50_ms_rounds": p50,
            "p99_ms_rounds": p99,
            "max_ms_rounds": [r[key].max_ms for r in per_round],
        }

    def ratios(edged: str, bare: str) -> list[float]:
        return [
            (r[edged].p50_ms - r["inproc"].p50_ms) / (r[bare].p50_ms - r["inproc"].p50_ms)
            for r in per_round
        ]

    targets = []
    for edged, bare, what in (
        ("edged_triton", "bare_triton", "tritonclient"),
        ("edged_tcp", "bare_http", "http.client (edged Client code)"),
    ):
        values = ratios(edged, bare)
        ratio = benchlib.median(values)
        targets.append(
            {
                "target": f"{what}: edged added p50 <= {TARGET_RATIO}x bare added p50",
                "value": round(ratio, 3),
                "rounds": [round(v, 3) for v in values],
                "figures": f"edged +{paths[edged]['added_p50_ms']:.3f} ms vs bare "
                f"+{paths[bare]['added_p50_ms']:.3f} ms: {ratio:.2f}x "
                f"(rounds {min(values):.2f}-{max(values):.2f}x)",
                "pass": ratio <= TARGET_RATIO,
            }
        )
    for key in ("edged_triton", "edged_unix", "edged_tcp"):
        added = paths[key]["added_p99_ms"]
        targets.append(
            {
                "target": f"{PATHS[key]}: p99 added <= {TARGET_P99_ADDED_MS} ms",
                "value": added,
                "figures": f"p99 {paths[key]['p99_ms']:.3f} ms - in-process "
                f"{paths['inproc']['p99_ms']:.3f} ms: +{added:.3f} ms (rounds "
                f"{min(paths[key]['p99_ms_rounds']):.3f}-"
                f"{max(paths[key]['p99_ms_rounds']):.3f} ms p99)",
                "pass": added <= TARGET_P99_ADDED_MS,
            }
        )
    diffs = [r["edged_unix"].p50_ms - r["edged_tcp"].p50_ms for r in per_round]
    diffs99 = [r["edged_unix"].p99_ms - r["edged_tcp"].p99_ms for r in per_round]
    wins = sum(d < 0 for d in diffs)
    targets.append(
        {
            "target": "edged Client: Unix socket below TCP (p50)",
            "value": round(benchlib.median(diffs), 4),
            "figures": f"Unix {paths['edged_unix']['p50_ms']:.3f} ms vs TCP "
            f"{paths['edged_tcp']['p50_ms']:.3f} ms p50 (Unix - TCP per round, median "
            f"{benchlib.median(diffs):+.3f} ms, below in {wins}/{len(diffs)} rounds; p99 "
            f"{benchlib.median(diffs99):+.3f} ms)",
            "pass": benchlib.median(diffs) < 0,
        }
    )
    return {"paths": paths, "targets": targets}


# -- phase 2: concurrency -----------------------------------------------------------------------


def run_cell(
    address: str, feeds: Mapping[str, np.ndarray], threads: int, total: int
) -> dict[str, Any]:
    """`threads` closed-loop clients, each its own keep-alive Client, `total` requests split
    between them (each thread also stops at CELL_TIME_LIMIT_S)."""
    per_thread = max(1, -(-total // threads))
    barrier = threading.Barrier(threads + 1)
    latencies: list[list[int]] = [[] for _ in range(threads)]
    errors = [0] * threads
    messages: list[str] = []

    def worker(index: int) -> None:
        with Client(address, timeout=30.0) as client:
            try:
                for _ in range(3):  # connect and warm this connection
                    client.infer(MODEL_NAME, feeds)
            finally:
                barrier.wait(timeout=60)
            deadline = time.perf_counter() + CELL_TIME_LIMIT_S
            for _ in range(per_thread):
                start = time.perf_counter_ns()
                try:
                    client.infer(MODEL_NAME, feeds)
                except Exception as exc:  # counted and shown; the loop stays bounded
                    errors[index] += 1
                    if len(messages) < 5:
                        messages.append(str(exc))
                    continue
                latencies[index].append(time.perf_counter_ns() - start)
                if time.perf_counter() > deadline:
                    break

    before, phases_before = batch_totals(address), phase_totals(address)
    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait(timeout=60)
    start = time.perf_counter()
    for thread in pool:
        thread.join(CELL_TIME_LIMIT_S + 60)
    wall = time.perf_counter() - start
    after, phases_after = batch_totals(address), phase_totals(address)
    samples = [x for lat in latencies for x in lat]
    stats = LatencyStats.from_ns(samples) if samples else None
    count = after[1] - before[1]
    return {
        "requests": len(samples),
        "errors": sum(errors),
        "error_messages": messages,
        "wall_s": round(wall, 3),
        "throughput_rps": round(len(samples) / wall, 1) if wall else 0.0,
        "p50_ms": stats.p50_ms if stats else None,
        "p99_ms": stats.p99_ms if stats else None,
        "mean_batch": round((after[0] - before[0]) / count, 2) if count else None,
        **phase_means(phases_before, phases_after),
    }


def concurrency(daemons: Mapping[str, Edged], feeds, total: int, rounds: int) -> dict[str, Any]:
    names = list(daemons)
    cells: dict[str, dict[int, list[dict[str, Any]]]] = {
        n: {c: [] for c in CONCURRENCY} for n in names
    }
    for r in range(rounds):
        for threads in CONCURRENCY:
            order = names if (r + threads) % 2 == 0 else names[::-1]  # alternate who leads
            for name in order:
                cell = run_cell(daemons[name].tcp, feeds, threads, total)
                cells[name][threads].append(cell)
                log(
                    f"concurrency round {r + 1}/{rounds}: {name} x{threads}: "
                    f"{cell['throughput_rps']} req/s, p99 {cell['p99_ms']} ms, mean batch "
                    f"{cell['mean_batch']}, errors {cell['errors']}"
                )
    summary: dict[str, Any] = {}
    for name in names:
        summary[name] = {}
        for threads in CONCURRENCY:
            runs = cells[name][threads]
            ok = [c for c in runs if c["p99_ms"] is not None]
            summary[name][threads] = {
                "throughput_rps": round(benchlib.median([c["throughput_rps"] for c in runs]), 1),
                "p50_ms": round(benchlib.median([c["p50_ms"] for c in ok]), 3) if ok else None,
                "p99_ms": round(benchlib.median([c["p99_ms"] for c in ok]), 3) if ok else None,
                "mean_batch": round(benchlib.median([c["mean_batch"] or 0 for c in runs]), 2),
                **{
                    k: round(benchlib.median([c[k] for c in runs]), 3)
                    for k in ("queue_mean_ms", "compute_mean_ms", "total_mean_ms")
                },
                "errors": sum(c["errors"] for c in runs),
                "rounds": runs,
            }
    return summary


# -- phase 3: footprint and start-up ------------------------------------------------------------


def footprint(pid: int, idle_s: float) -> dict[str, Any]:
    import psutil

    proc = psutil.Process(pid)
    rss = proc.memory_info().rss
    before = proc.cpu_times()
    time.sleep(idle_s)
    after = proc.cpu_times()
    cpu_s = (after.user + after.system) - (before.user + before.system)
    return {
        "rss_mib": round(rss / 2**20, 1),
        "threads": proc.num_threads(),
        "idle_s": idle_s,
        "idle_cpu_ms": round(cpu_s * 1e3, 1),
        "idle_cpu_percent_of_core": round(100 * cpu_s / idle_s, 3),
    }


def startup(tmp: Path, model: Path, shapes, reps: int, idle_s: float) -> dict[str, Any]:
    runs = []
    idle = None
    for rep in range(reps):
        state = tmp / f"start-state-{rep}"
        config = write_config(_mkdir(tmp / f"start-{rep}"), model, shapes, state, 1, 0)
        row: dict[str, Any] = {}
        for phase in ("fresh", "cached"):
            daemon = Edged(tmp / f"start-{rep}" / phase, config)
            try:
                daemon.wait_ready()
                with Client(daemon.tcp, timeout=10) as client:
                    status = client.status()["models"][0]
                row[f"{phase}_ready_s"] = round(daemon.ready_s or 0.0, 3)
                row[f"{phase}_from_cache"] = status["from_cache"]
                if phase == "cached" and rep == reps - 1:
                    idle = footprint(daemon.proc.pid, idle_s)
            finally:
                daemon.stop()
        runs.append(row)
        log(
            f"start-up {rep + 1}/{reps}: fresh {row['fresh_ready_s']} s, cached "
            f"{row['cached_ready_s']} s (from_cache={row['cached_from_cache']})"
        )
    return {
        "fresh_ready_s": round(benchlib.median([r["fresh_ready_s"] for r in runs]), 3),
        "cached_ready_s": round(benchlib.median([r["cached_ready_s"] for r in runs]), 3),
        "cached_all_from_cache": all(r["cached_from_cache"] for r in runs),
        "runs": runs,
        "idle": idle,
    }


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- report -------------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    seq = report["sequential"]
    print(
        f"model {report['model']} {report['shapes']}, backend {BACKEND} CPU, "
        f"{THREADS} thread; {report['args']['requests']} requests/path/round x "
        f"{report['args']['rounds']} rounds (medians of per-round figures)"
    )
    print(f"{'path':34} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}")
    for row in seq["paths"].values():
        print(
            f"{row['label']:34} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} "
            f"{row['added_p50_ms']:8.3f} {row['added_p99_ms']:8.3f}"
        )
    print()
    for target in seq["targets"]:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {target['figures']}")
    side = seq["edged_server_side"]
    print(
        f"edged's own view (mean per request, warm-up included): queue "
        f"{side['queue_mean_ms']:.3f} ms, compute {side['compute_mean_ms']:.3f} ms, "
        f"handler total {side['total_mean_ms']:.3f} ms"
    )
    print()
    print("concurrency (edged Client over TCP, one keep-alive connection per thread)")
    print(
        f"{'daemon':14} {'threads':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'batch':>6} {'errors':>6} {'queue':>7} {'compute':>7} {'handler':>7}"
    )
    for name, by_threads in report["concurrency"].items():
        for threads, row in by_threads.items():
            print(
                f"{name:14} {threads:7} {row['throughput_rps']:9.1f} "
                f"{row['p50_ms'] or float('nan'):8.3f} {row['p99_ms'] or float('nan'):8.3f} "
                f"{row['mean_batch']:6.2f} {row['errors']:6} {row['queue_mean_ms']:7.3f} "
                f"{row['compute_mean_ms']:7.3f} {row['total_mean_ms']:7.3f}"
            )
    print(
        "(queue, compute, handler: edged's own mean ms per request, from its /metrics; "
        "compute is per batch)"
    )
    print()
    up = report["startup"]
    idle = up["idle"] or {}
    print(
        f"start-to-READY: fresh state dir {up['fresh_ready_s']:.2f} s, cached selection "
        f"{up['cached_ready_s']:.2f} s (from cache: {up['cached_all_from_cache']}; "
        f"fresh from cache: {any(r['fresh_from_cache'] for r in up['runs'])})"
    )
    print(
        f"daemon after READY: RSS {idle.get('rss_mib')} MiB, {idle.get('threads')} "
        f"threads; idle CPU {idle.get('idle_cpu_ms')} ms over {idle.get('idle_s')} s "
        f"({idle.get('idle_cpu_percent_of_core')} % of a core); RSS after the latency "
        f"runs {report['rss_after_load_mib']} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=1000, help="timed sequential requests per path per round"
    )
    parser.add_argument("--rounds", type=int, default=10, help="sequential rounds")
    parser.add_argument(
        "--model", type=Path, help=f"model file (default {DEFAULT_MODEL} from the test data)"
    )
    parser.add_argument(
        "--shape",
        action="append",
        help="input shape NAME=1x3x48x192 (default for ppocr_cls: x=1x3x48x192)",
    )
    parser.add_argument(
        "--concurrency-requests",
        type=int,
        default=2000,
        help="requests per concurrency cell (split across threads)",
    )
    parser.add_argument("--concurrency-rounds", type=int, default=4)
    parser.add_argument(
        "--start-reps", type=int, default=3, help="start-up repetitions (fresh, then cached)"
    )
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--serve-bare", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bare:
        return serve_bare(args.serve_bare)
    if (
        min(
            args.requests,
            args.rounds,
            args.concurrency_requests,
            args.concurrency_rounds,
            args.start_reps,
        )
        < 1
        or not 0 < args.idle_s <= 60
    ):
        parser.error("counts must be at least 1 and --idle-s in (0, 60]")

    model = (args.model or models_dir() / DEFAULT_MODEL).resolve()
    if not model.is_file():
        parser.error(f"no model at {model} (run scripts/fetch_test_data.py)")
    session = load_session(model)
    shapes = resolve_shapes(
        session.inputs, parse_shape_args(args.shape or default_shape_arg(model)), model.name
    )
    feeds = make_inputs(session.inputs, shapes)
    reference = session.run(feeds)
    output_names = list(reference)
    report: dict[str, Any] = {
        **benchlib.report_header("serving"),
        "loadavg_1min_start": benchlib.loadavg(),
        "model": model.name,
        "shapes": {k: list(v) for k, v in shapes.items()},
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k != "serve_bare"
        },
    }
    with tempfile.TemporaryDirectory(prefix="edged-bench-srv-") as name:
        tmp = Path(name)
        closers: list[Callable[[], Any]] = []
        try:
            log("starting the bare endpoint and two daemons (batching off / on)")
            bare = BareServer(model)
            closers.append(bare.stop)
            daemons: dict[str, Edged] = {}
            for label, max_batch, delay in (("batching_off", 1, 0), ("batching_on", 8, 500)):
                config = write_config(
                    _mkdir(tmp / label), model, shapes, tmp / "state", max_batch, delay
                )
                daemon = Edged(tmp / label, config)
                closers.append(daemon.stop)
                daemons[label] = daemon.wait_ready()
                with Client(daemon.tcp, timeout=10) as client:
                    status = client.status()["models"][0]
                    model_config = client.get_json(f"/v2/models/{MODEL_NAME}/config")
                if (status["backend"], status["device"]) != (BACKEND, "CPU"):
                    raise RuntimeError(
                        f"{label}: daemon runs {status['backend']}:"
                        f"{status['device']}, not {BACKEND}:CPU"
                    )
                report.setdefault("daemons", {})[label] = {
                    "backend": f"{status['backend']}:{status['device']}",
                    "batching": status["batching"],
                    "max_batch_size": model_config["max_batch_size"],
                }
            off = daemons["batching_off"]
            runners: dict[str, Callable[[], Any]] = {"inproc": lambda: session.run(feeds)}
            for key, (run, close) in {
                "bare_http": client_runner(f"127.0.0.1:{bare.port}", feeds),
                "bare_triton": triton_runner(f"127.0.0.1:{bare.port}", feeds, output_names),
                "edged_triton": triton_runner(off.tcp, feeds, output_names),
                "edged_unix": client_runner(off.unix, feeds),
                "edged_tcp": client_runner(off.tcp, feeds),
            }.items():
                runners[key] = run
                closers.append(close)
            for key, run in runners.items():  # every path answers what the model answers
                got = run()
                for out in output_names:
                    if not np.allclose(got[out], reference[out], rtol=1e-5, atol=1e-6):
                        raise RuntimeError(f"{key}: output {out} differs from in-process")
            log(
                f"sequential: {args.requests} requests x {len(runners)} paths x "
                f"{args.rounds} rounds"
            )
            before = phase_totals(off.tcp)
            per_round = sequential(runners, args.requests, args.rounds)
            report["sequential"] = summarize_sequential(per_round)
            report["sequential"]["edged_server_side"] = phase_means(before, phase_totals(off.tcp))
            import psutil

            report["rss_after_load_mib"] = round(
                psutil.Process(off.proc.pid).memory_info().rss / 2**20, 1
            )
            log("concurrency: batching off vs on, alternately")
            report["concurrency"] = concurrency(
                daemons, feeds, args.concurrency_requests, args.concurrency_rounds
            )
        finally:
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    close()
        log("start-up: fresh state dir, then the same (cached selection)")
        report["startup"] = startup(tmp, model, shapes, args.start_reps, args.idle_s)
    report["loadavg_1min_end"] = benchlib.loadavg()
    if args.json:
        benchlib.write_json(report)
    else:
        print_report(report)
    failed = [t for t in report["sequential"]["targets"] if not t["pass"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
