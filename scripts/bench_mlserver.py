#!/usr/bin/env python3
"""Seldon MLServer against edged: the same ONNX model behind both, the same tritonclient loop.

MLServer is installed by this script into a venv of its own (created once, then reused:
`--venv`, default ~/.cache/edged/mlserver-venv; `pip install mlserver==MLSERVER_VERSION
onnxruntime==<the project's onnxruntime version> numpy`), and serves `ppocr_cls.onnx` through
a minimal custom runtime written to a temporary model repository: a `mlserver.MLModel`
subclass that opens an onnxruntime session in `load()` (CPUExecutionProvider, 1 intra-op and
1 inter-op thread, sequential, no spinning: the options edged's onnxruntime backend uses) and
in `predict()` decodes the inputs with MLServer's NumpyCodec (`self.decode`), runs the session
and encodes the outputs with NumpyCodec. Server settings: HTTP and gRPC on free loopback
ports, metrics off (`metrics_endpoint: null`), `parallel_workers: 0` (inference in the server
process, on its event loop), `debug: false` (no access log); everything else is MLServer's
default. edged is the real daemon (`python -m edged.daemon`, temp config, as
scripts/bench_serving.py runs it) pinned to `backend = "onnxruntime"`, `threads = 1`,
`max_batch_size = 1`.

Both servers' answers are checked against in-process onnxruntime (allclose, atol 1e-4), then
one tritonclient (HTTP, keep-alive, one client per path) times sequential single requests:

  mlserver_json   MLServer, tritonclient JSON tensors (binary_data=False on input and output);
  mlserver_binary MLServer, tritonclient binary tensors: tried once first; MLServer's REST
                  server does not implement the binary-data extension, so this path is timed
                  only if that try returned the right answer;
  edged_json      edged, tritonclient JSON tensors;
  edged_binary    edged, tritonclient binary tensors (for reference);
  inproc          the in-process session.run, for scale;
  client_json     tritonclient's JSON request encoding alone, no server (InferInput +
                  set_data_from_numpy(binary_data=False) + generate_request_body): the part
                  of both JSON paths spent in the client before anything is sent.

Paths take turns in blocks within a round (the order rotates each round); figures are medians
over rounds of per-round p50/p99, ratios are taken per round, then the median. Target (from the
issue): edged's p50 at least 50x lower than MLServer's, JSON against JSON and MLServer's best
path against edged binary. Then the RSS of both server processes (psutil, children included).

`--tiny` serves a generated tiny CNN (1x3x64x64 input, ~0.2 ms in-process) instead: the
class of model the issue's figures were measured on, where server overhead dominates.

Run from a checkout: `.venv/bin/python scripts/bench_mlserver.py [--tiny] [--json]` (about 2 minutes
once the venv exists; creating it takes a few minutes more). Exit status 1 when the target is
missed, 2 when MLServer cannot be installed or started.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from benchlib import log

from edged.selection.bench import LatencyStats

MLSERVER_VERSION = "1.7.1"
DEFAULT_VENV = Path.home() / ".cache" / "edged" / "mlserver-venv"
MODEL_FILE = "ppocr_cls.onnx"
INPUT_SHAPE = (1, 3, 48, 192)
TINY_SHAPE = (1, 3, 64, 64)  # --tiny: the generated CNN's input
MODEL_NAME = "bench"
BLOCK = 10  # requests per path per turn within a round
WARMUP = 20  # untimed requests per path before the first round
READY_TIMEOUT_S = 120.0
PIP_TIMEOUT_S = 1200.0
TARGET_FACTOR = 50.0  # edged p50 at least 50x lower than MLServer's
ATOL = 1e-4

PATHS = {
    "inproc": "in-process session.run",
    "client_json": "tritonclient JSON encode only",
    "mlserver_json": "MLServer <- tritonclient JSON",
    "mlserver_binary": "MLServer <- tritonclient binary",
    "edged_json": "edged <- tritonclient JSON",
    "edged_binary": "edged <- tritonclient binary",
}

RUNTIME_PY = '''\
"""Minimal MLServer runtime: one ONNX model on onnxruntime, CPU, one intra-op thread."""

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxModel(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(await get_model_uri(self._settings), options,
                                             providers=["CPUExecutionProvider"])
        self._output_names = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {item.name: self.decode(item, default_codec=NumpyCodec)
                 for item in payload.inputs}
        results = self._session.run(self._output_names, feeds)
        return InferenceResponse(
            model_name=self.name, model_version=self.version,
            outputs=[NumpyCodec.encode_output(name, value)
                     for name, value in zip(self._output_names, results)])
'''


class SetupError(Exception):
    """MLServer could not be installed or started (exit status 2)."""


# -- the MLServer venv ---------------------------------------------------------------------------


def venv_versions(venv: Path) -> dict[str, str] | None:
    """Versions importable in the venv, or None when it is missing or broken."""
    python = venv / "bin" / "python"
    if not python.is_file() or not (venv / "bin" / "mlserver").is_file():
        return None
    code = (
        "import json, mlserver, numpy, onnxruntime; print(json.dumps({'mlserver': "
        "mlserver.__version__, 'onnxruntime': onnxruntime.__version__, "
        "'numpy': numpy.__version__}))"
    )
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def ensure_venv(venv: Path) -> dict[str, str]:
    """Create the venv and install MLServer into it, unless it already holds the pinned one.
    onnxruntime is pinned to the project's own version, so both servers run the same runtime."""
    import onnxruntime

    ort_version = onnxruntime.__version__
    have = venv_versions(venv)
    if have and have["mlserver"] == MLSERVER_VERSION and have["onnxruntime"] == ort_version:
        log(
            f"reusing {venv} (mlserver {have['mlserver']}, onnxruntime "
            f"{have['onnxruntime']}, numpy {have['numpy']})"
        )
        return have
    if not (venv / "bin" / "python").is_file():
        log(f"creating the venv {venv} (python3 -m venv)")
        venv.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["python3", "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise SetupError(f"python3 -m venv {venv} failed:\n{done.stderr.strip()}")
    wanted = [f"mlserver=={MLSERVER_VERSION}", f"onnxruntime=={ort_version}", "numpy"]
    log(f"pip install {' '.join(wanted)} into {venv} (this may take a few minutes)")
    started = time.monotonic()
    try:
        done = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                *wanted,
            ],
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"pip install did not finish within {PIP_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
        raise SetupError(f"pip install {' '.join(wanted)} failed (exit {done.returncode}):\n{tail}")
    have = venv_versions(venv)
    if not have:
        raise SetupError(f"pip install succeeded but mlserver does not import in {venv}")
    log(
        f"installed in {time.monotonic() - started:.0f} s: mlserver {have['mlserver']}, "
        f"onnxruntime {have['onnxruntime']}, numpy {have['numpy']}"
    )
    return have


# -- MLServer -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_repository(folder: Path, model: Path) -> tuple[int, int]:
    """settings.json (server) + bench/model-settings.json + bench/runtime.py."""
    http_port, grpc_port = free_port(), free_port()
    while grpc_port == http_port:  # bounded in practice: the kernel hands out distinct ports
        grpc_port = free_port()
    (folder / "settings.json").write_text(
        json.dumps(
            {
                "host": "127.0.0.1",
                "http_port": http_port,
                "grpc_port": grpc_port,
                "metrics_endpoint": None,
                "parallel_workers": 0,
                "debug": False,
                "load_models_at_startup": True,
            },
            indent=2,
        )
    )
    model_dir = folder / MODEL_NAME
    model_dir.mkdir()
    (model_dir / "runtime.py").write_text(RUNTIME_PY)
    (model_dir / "model-settings.json").write_text(
        json.dumps(
            {
                "name": MODEL_NAME,
                "implementation": "runtime.OnnxModel",
                "parameters": {"uri": str(model)},
            },
            indent=2,
        )
    )
    return http_port, grpc_port


def http_status(port: int, path: str) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()
    except OSError:
        return None


class MLServer:
    def __init__(self, venv: Path, folder: Path, model: Path) -> None:
        self.folder = folder
        self.port, self.grpc_port = write_repository(folder, model)
        self.log_path = folder / "mlserver.log"
        self._log = self.log_path.open("w")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MLSERVER_", "PYTHON", "VIRTUAL_ENV"))
        }
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        self.started = time.perf_counter()
        # cwd: MLServer reads a .env there and puts .envs/.metrics folders there
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "mlserver"), "start", str(folder)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=folder,
        )
        self.ready_s: float | None = None

    def wait_ready(self) -> MLServer:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if (
                http_status(self.port, "/v2/health/ready") == 200
                and http_status(self.port, f"/v2/models/{MODEL_NAME}/ready") == 200
            ):
                self.ready_s = time.perf_counter() - self.started
                return self
            if self.proc.poll() is not None:
                raise SetupError(
                    f"mlserver exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise SetupError(
                    f"mlserver not ready within {READY_TIMEOUT_S:.0f} s; log "
                    f"tail:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        finally:
            self._log.close()


# -- clients ------------------------------------------------------------------------------------


def triton_runner(address: str, feeds: Mapping[str, np.ndarray], outputs: list[str], binary: bool):
    import tritonclient.http as th

    client = th.InferenceServerClient(url=address, connection_timeout=30.0, network_timeout=30.0)

    def run() -> dict[str, np.ndarray]:
        inputs = []
        for name, array in feeds.items():
            item = th.InferInput(name, list(array.shape), "FP32")
            item.set_data_from_numpy(array, binary_data=binary)
            inputs.append(item)
        wanted = [th.InferRequestedOutput(name, binary_data=binary) for name in outputs]
        result = client.infer(MODEL_NAME, inputs, outputs=wanted)
        return {name: result.as_numpy(name) for name in outputs}

    return run, client.close


def json_encode_runner(feeds: Mapping[str, np.ndarray], outputs: list[str]):
    """What tritonclient does to a JSON request before sending it, without a server."""
    import tritonclient.http as th

    def run() -> bytes:
        inputs = []
        for name, array in feeds.items():
            item = th.InferInput(name, list(array.shape), "FP32")
            item.set_data_from_numpy(array, binary_data=False)
            inputs.append(item)
        wanted = [th.InferRequestedOutput(name, binary_data=False) for name in outputs]
        body, _ = th.InferenceServerClient.generate_request_body(inputs, outputs=wanted)
        return body

    return run


def check(name: str, got: Mapping[str, Any], reference: Mapping[str, np.ndarray]) -> None:
    for out, want in reference.items():
        value = got.get(out)
        if value is None:
            raise RuntimeError(f"{name}: no output {out!r} in the answer")
        value = np.asarray(value, dtype=np.float32).reshape(want.shape)
        if not np.allclose(value, want, rtol=0.0, atol=ATOL):
            raise RuntimeError(
                f"{name}: output {out!r} differs from in-process onnxruntime "
                f"(max abs diff {float(np.max(np.abs(value - want))):.3g})"
            )


# -- timing -------------------------------------------------------------------------------------


def summarize(per_round: list[dict[str, LatencyStats]]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for key in PATHS:
        if key not in per_round[0]:
            continue
        p50 = [r[key].p50_ms for r in per_round]
        p99 = [r[key].p99_ms for r in per_round]
        paths[key] = {
            "label": PATHS[key],
            "p50_ms": round(benchlib.median(p50), 4),
            "p99_ms": round(benchlib.median(p99), 4),
            "p50_ms_rounds": p50,
            "p99_ms_rounds": p99,
            "max_ms_rounds": [r[key].max_ms for r in per_round],
        }
    for key in ("mlserver_json", "edged_json"):
        if key in paths and "client_json" in paths:
            paths[key]["minus_client_json_p50_ms"] = round(
                benchlib.median([r[key].p50_ms - r["client_json"].p50_ms for r in per_round]), 4
            )
    ml_keys = [k for k in ("mlserver_json", "mlserver_binary") if k in paths]
    best = min(ml_keys, key=lambda k: paths[k]["p50_ms"])
    targets = []
    for ml, edged, what in (
        ("mlserver_json", "edged_json", "JSON vs JSON"),
        (best, "edged_binary", f"MLServer's best ({best}) vs edged binary"),
    ):
        values = [r[ml].p50_ms / r[edged].p50_ms for r in per_round]
        ratio = benchlib.median(values)
        targets.append(
            {
                "target": f"{what}: MLServer p50 / edged p50 >= {TARGET_FACTOR:g}",
                "value": round(ratio, 2),
                "rounds": [round(v, 2) for v in values],
                "figures": f"{paths[ml]['p50_ms']:.3f} ms / {paths[edged]['p50_ms']:.3f} ms: "
                f"{ratio:.1f}x (rounds {min(values):.1f}-{max(values):.1f}x)",
                "pass": ratio >= TARGET_FACTOR,
            }
        )
    return {"paths": paths, "targets": targets}


def rss_mib(pid: int) -> dict[str, Any]:
    import psutil

    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return {"rss_mib": round(total / 2**20, 1), "processes": len(procs)}


def write_tiny_model(path: Path) -> Path:
    """A tiny CNN (conv 3->32, conv 32->64 stride 2, global pool, 64->10 dense; fixed random
    weights) written with onnx.helper: the class of model the issue's 50x figure was measured
    on (0.15-0.3 ms in-process), where the server's own overhead dominates. Opset 13, IR 8:
    any onnxruntime of the last years loads it, MLServer's venv included."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name
        )

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(TINY_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [
            weight("w1", 32, 3, 3, 3),
            weight("b1", 32),
            weight("w2", 64, 32, 3, 3),
            weight("b2", 64),
            weight("w3", 64, 10),
            weight("b3", 10),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


# -- report -------------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    seq = report["sequential"]
    print(
        f"model {report['model']} x {next(iter(report['input'].values()))} FP32; MLServer "
        f"{report['mlserver']['version']} (custom runtime, onnxruntime "
        f"{report['mlserver']['onnxruntime']}) vs edged (onnxruntime "
        f"{report['onnxruntime']}, 1 thread, max_batch_size 1); tritonclient "
        f"{report['tritonclient']}; {report['args']['requests']} requests/path/round x "
        f"{report['args']['rounds']} rounds (medians of per-round figures); loadavg "
        f"{report['loadavg_1min_start']} -> {report['loadavg_1min_end']}"
    )
    print(f"{'path':34} {'p50 ms':>9} {'p99 ms':>9} {'p50 - JSON encode':>18}")
    for row in seq["paths"].values():
        rest = row.get("minus_client_json_p50_ms")
        print(
            f"{row['label']:34} {row['p50_ms']:9.3f} {row['p99_ms']:9.3f} "
            f"{'' if rest is None else f'{rest:18.3f}'}"
        )
    binary = report["mlserver_binary_try"]
    print(
        f"MLServer with tritonclient binary tensors: "
        f"{'works' if binary['works'] else 'fails: ' + binary['error']}"
    )
    print()
    for target in seq["targets"]:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {target['figures']}")
    print()
    ml, ed = report["mlserver_process"], report["edged_process"]
    print(
        f"RSS after the runs (children included): MLServer {ml['rss_mib']} MiB "
        f"({ml['processes']} process(es)), edged {ed['rss_mib']} MiB "
        f"({ed['processes']} process(es)); start-to-ready: MLServer "
        f"{report['mlserver']['ready_s']:.2f} s (HTTP poll), edged "
        f"{report['edged_ready_s']:.2f} s (READY=1)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import version

    import onnxruntime as ort
    from bench_serving import Edged, sequential, write_config
    from fetch_test_data import models_dir

    versions = ensure_venv(args.venv.expanduser().resolve())
    shape = TINY_SHAPE if args.tiny else INPUT_SHAPE
    model_dir = tempfile.TemporaryDirectory(prefix="edged-bench-tiny-")
    if args.tiny:
        model = write_tiny_model(Path(model_dir.name) / "tiny_cnn.onnx")
    else:
        model = (models_dir() / MODEL_FILE).resolve()
    if not model.is_file():
        raise SetupError(f"no model at {model} (run scripts/fetch_test_data.py)")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    output_names = [o.name for o in session.get_outputs()]
    feeds = {input_name: np.random.default_rng(0).random(shape, dtype=np.float32)}
    reference = dict(zip(output_names, session.run(output_names, feeds), strict=True))
    report: dict[str, Any] = {
        **benchlib.report_header("mlserver"),
        "loadavg_1min_start": benchlib.loadavg(),
        "model": model.name,
        "input": {input_name: list(shape)},
        "onnxruntime": ort.__version__,
        "tritonclient": version("tritonclient"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory(prefix="edged-bench-mls-") as name:
        tmp = Path(name)
        closers: list[Callable[[], Any]] = []
        try:
            (tmp / "mlserver").mkdir()
            log("starting MLServer")
            mls = MLServer(args.venv.expanduser().resolve(), tmp / "mlserver", model)
            closers.append(mls.stop)
            mls.wait_ready()
            log(f"MLServer ready on 127.0.0.1:{mls.port} after {mls.ready_s:.1f} s")
            report["mlserver"] = {
                **{k: versions[k] for k in ("onnxruntime", "numpy")},
                "version": versions["mlserver"],
                "ready_s": round(mls.ready_s or 0.0, 2),
            }
            log("starting edged")
            (tmp / "edged").mkdir()
            config = write_config(
                tmp / "edged", model, {input_name: shape}, tmp / "edged" / "state", 1, 0
            )
            daemon = Edged(tmp / "edged", config)
            closers.append(daemon.stop)
            daemon.wait_ready()
            report["edged_ready_s"] = round(daemon.ready_s or 0.0, 2)
            from edged.client import Client

            with Client(daemon.tcp, timeout=10) as client:
                status = client.status()["models"][0]
            if (status["backend"], status["device"]) != ("onnxruntime", "CPU"):
                raise RuntimeError(
                    f"edged runs {status['backend']}:{status['device']}, not onnxruntime:CPU"
                )
            mls_address = f"127.0.0.1:{mls.port}"
            runners: dict[str, Callable[[], Any]] = {
                "inproc": lambda: session.run(output_names, feeds),
                "client_json": json_encode_runner(feeds, output_names),
            }
            for key, address, binary in (
                ("mlserver_json", mls_address, False),
                ("edged_json", daemon.tcp, False),
                ("edged_binary", daemon.tcp, True),
            ):
                call, close = triton_runner(address, feeds, output_names, binary)
                closers.append(close)
                check(key, call(), reference)
                runners[key] = call
            call, close = triton_runner(mls_address, feeds, output_names, True)
            closers.append(close)
            try:
                check("mlserver_binary", call(), reference)
                report["mlserver_binary_try"] = {"works": True, "error": ""}
                runners["mlserver_binary"] = call
            except Exception as exc:  # the expected outcome: reported, not timed
                message = " ".join(f"{type(exc).__name__}: {exc}".split())
                report["mlserver_binary_try"] = {"works": False, "error": message[:300]}
                log(f"MLServer with tritonclient binary tensors fails: {message[:300]}")
            log(
                "outputs agree with in-process onnxruntime (atol 1e-4); sequential: "
                f"{args.requests} requests x {len(runners)} paths x {args.rounds} rounds"
            )
            per_round = sequential(runners, args.requests, args.rounds, BLOCK, WARMUP)
            report["sequential"] = summarize(per_round)
            report["mlserver_process"] = rss_mib(mls.proc.pid)
            report["edged_process"] = rss_mib(daemon.proc.pid)
            if mls.proc.poll() is not None or daemon.proc.poll() is not None:
                raise RuntimeError("a server exited during the runs")
        finally:
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    close()
    model_dir.cleanup()
    report["loadavg_1min_end"] = benchlib.loadavg()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv",
        type=Path,
        default=DEFAULT_VENV,
        help=f"MLServer's venv, created when missing (default {DEFAULT_VENV})",
    )
    parser.add_argument(
        "--requests", type=int, default=300, help="timed sequential requests per path per round"
    )
    parser.add_argument("--rounds", type=int, default=6, help="sequential rounds")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=f"serve a generated tiny CNN ({'x'.join(map(str, TINY_SHAPE))} "
        f"input, ~0.2 ms in-process) instead of {MODEL_FILE}",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if min(args.requests, args.rounds) < 1:
        parser.error("--requests and --rounds must be at least 1")
    try:
        report = run(args)
    except SetupError as exc:
        print(f"bench_mlserver: cannot run the MLServer comparison: {exc}", file=sys.stderr)
        return 2
    if args.json:
        benchlib.write_json(report)
    else:
        print_report(report)
    return 0 if all(t["pass"] for t in report["sequential"]["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
