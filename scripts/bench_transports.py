#!/usr/bin/env python3
"""The protocol's transports side by side (issue 14): what each adds over running the model
in-process, for a small input (the cls model, 1x3x48x192 FP32, 110 KiB) and a large one (the
det model at 1x3x640x640 FP32, 4.9 MB).

One real daemon (`python -m edged.daemon`, onnxruntime CPU, 1 thread, max_batch_size 1,
`allow_shared_memory = true`) serves both models, next to a bare floor for each transport;
unmodified tritonclient calls them all along:

  inproc          the same backend loaded in this process, `session.run`
  bare_http       bench_serving's bare ASGI endpoint (uvicorn, httptools, uvloop), tritonclient
  http            edged, tritonclient.http, binary tensors, TCP
  bare_grpc_tcp   a bare grpcio asyncio servicer, tritonclient.grpc over TCP
  grpc_tcp        edged, tritonclient.grpc over TCP
  bare_grpc_unix  the bare servicer over a Unix socket
  grpc_unix       edged, tritonclient.grpc over its Unix socket
  http_shm        edged, tritonclient.http, input and output in system shared memory
  grpc_shm        edged, tritonclient.grpc (TCP), input and output in system shared memory

The bare servicer is the floor of a Python gRPC server: ModelInfer only, parsed with
tritonclient's own generated messages, the tensor taken from raw_input_contents with no
checks, the session run on the event loop (uvloop, as the daemon's), the outputs sent in
raw_output_contents; no admission, queue, metrics or statistics. Both bare servers run in
subprocesses of this script, each with its own session.

With shared memory the input is written into its region once (a camera application writes
its frame there itself) and each request reads the output from its region as a numpy view.
Paths are interleaved in blocks within a round, the order rotated per round; "added" is a
path's p50 minus in-process p50 of the same round, and the figures are medians over rounds.

The issue's goals: gRPC's added latency within 1.3x its bare floor's (per round, median of
the rounds' ratios, on TCP and on the Unix socket, for each model); with shared memory, the
4.9 MB input's added latency at most 1.2x the small one's, so that size stops mattering.

Usage: bench_transports.py [--rounds N] [--requests N] [--json]
Exit 0 when the goals are met, 1 when one is missed; the report names which. Prints the ISA.
Internal: `--serve-bare-grpc SOCKET MODEL...` runs the bare servicer (used by the script).
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from bench_serving import BareServer, Edged, load_session, triton_runner
from benchlib import log
from fetch_test_data import models_dir

from edged.selection.bench import LatencyStats

MODELS = {"cls": ("ppocr_cls.onnx", (1, 3, 48, 192)), "det": ("ppocrv4_det.onnx", (1, 3, 640, 640))}
PATHS = (
    "inproc",
    "bare_http",
    "http",
    "bare_grpc_tcp",
    "grpc_tcp",
    "bare_grpc_unix",
    "grpc_unix",
    "http_shm",
    "grpc_shm",
)
FLOORS = {"http": "bare_http", "grpc_tcp": "bare_grpc_tcp", "grpc_unix": "bare_grpc_unix"}
BLOCK = 10
FLOOR_GOAL = 1.3  # gRPC: edged's added latency <= 1.3x the bare servicer's
SHM_GOAL = 1.2
SERVICE = "inference.GRPCInferenceService"


def write_config(folder: Path, models: Path) -> Path:
    tables = "".join(
        f"""
[[models]]
name = "{name}"
path = "{models / file}"
backend = "onnxruntime"
threads = 1
shapes = {{ x = {list(shape)} }}
"""
        for name, (file, shape) in MODELS.items()
    )
    config = folder / "edged.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:0"
socket = "{folder / "edged.sock"}"
grpc_socket = "{folder / "grpc.sock"}"
state_dir = "{folder / "state"}"
allow_shared_memory = true
max_body_bytes = 67108864
{tables}""")
    return config


# -- the bare gRPC floor, run in a subprocess --------------------------------------------------


def serve_bare_grpc(unix_socket: Path, models: list[Path]) -> int:
    """ModelInfer for each model (by its MODELS name) on loopback TCP and `unix_socket`;
    prints the TCP port once serving."""
    import asyncio

    import grpc
    import uvloop
    from tritonclient.grpc import service_pb2

    from edged.serving.protocol import DATATYPES, datatype_of

    by_file = {file: name for name, (file, _) in MODELS.items()}
    sessions = {by_file[path.name]: load_session(path) for path in models}

    async def infer(raw: bytes, context) -> bytes:
        request = service_pb2.ModelInferRequest.FromString(raw)
        session = sessions[request.model_name]
        feeds = {
            t.name: np.frombuffer(request.raw_input_contents[i], DATATYPES[t.datatype]).reshape(
                t.shape
            )
            for i, t in enumerate(request.inputs)
        }
        response = service_pb2.ModelInferResponse(model_name=request.model_name)
        for name, array in session.run(feeds).items():
            response.outputs.add(
                name=name, datatype=datatype_of(array.dtype.name), shape=array.shape
            )
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
        return response.SerializeToString()

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 26)])
        methods = {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.add_insecure_port(f"unix:{unix_socket}")
        await server.start()
        print(port, flush=True)  # the parent reads the port from this line
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(1.0)

    uvloop.run(serve())
    return 0


class BareGrpc:
    def __init__(self, unix_socket: Path, models: list[Path]) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve-bare-grpc"]
        self.proc = subprocess.Popen(
            [*command, str(unix_socket), *map(str, models)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # bounded: the child prints or exits
        if not line.isdigit():
            self.stop()
            raise RuntimeError(f"bare gRPC servicer did not start (got {line!r})")
        self.tcp, self.unix = f"127.0.0.1:{line}", f"unix://{unix_socket}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        if self.proc.stdout:
            self.proc.stdout.close()


# -- the paths ---------------------------------------------------------------------------------


def runners(daemon: Edged, grpc_tcp: str, grpc_unix: str, bare: dict[str, str], name, x, outputs):
    """path -> a callable doing one request of model `name`; and the clean-up."""
    import tritonclient.grpc as tg
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as shm

    http = th.InferenceServerClient(daemon.tcp, network_timeout=60.0)
    grpc_clients = {
        key: tg.InferenceServerClient(url)
        for key, url in {
            "grpc_tcp": grpc_tcp,
            "grpc_unix": grpc_unix,
            "bare_grpc_tcp": bare["grpc_tcp"],
            "bare_grpc_unix": bare["grpc_unix"],
        }.items()
    }
    out_name, out_array = next(iter(outputs.items()))
    bare_http, close_bare_http = triton_runner(bare["http"], {"x": x}, [out_name])
    key_in, key_out = f"/edged-bench-{name}-in", f"/edged-bench-{name}-out"
    region_in = shm.create_shared_memory_region(f"{name}_in", key_in, x.nbytes)
    region_out = shm.create_shared_memory_region(f"{name}_out", key_out, out_array.nbytes)
    shm.set_shared_memory_region(region_in, [x])
    http.register_system_shared_memory(f"{name}_in", key_in, x.nbytes)
    http.register_system_shared_memory(f"{name}_out", key_out, out_array.nbytes)

    def http_plain():
        item = th.InferInput("x", list(x.shape), "FP32")
        item.set_data_from_numpy(x, binary_data=True)
        wanted = [th.InferRequestedOutput(out_name, binary_data=True)]
        return http.infer(name, [item], outputs=wanted).as_numpy(out_name)

    def grpc_plain(client):
        def run():
            item = tg.InferInput("x", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            return client.infer(name, [item]).as_numpy(out_name)

        return run

    def shm_request(lib, client):
        def run():
            item = lib.InferInput("x", list(x.shape), "FP32")
            item.set_shared_memory(f"{name}_in", x.nbytes)
            wanted = lib.InferRequestedOutput(out_name)
            wanted.set_shared_memory(f"{name}_out", out_array.nbytes)
            client.infer(name, [item], outputs=[wanted])
            return shm.get_contents_as_numpy(region_out, np.float32, out_array.shape)

        return run

    paths = {
        "bare_http": lambda: bare_http()[out_name],
        "http": http_plain,
        **{key: grpc_plain(client) for key, client in grpc_clients.items()},
        "http_shm": shm_request(th, http),
        "grpc_shm": shm_request(tg, grpc_clients["grpc_tcp"]),
    }

    def close() -> None:
        http.unregister_system_shared_memory()
        for region in (region_in, region_out):
            shm.destroy_shared_memory_region(region)
        http.close()
        close_bare_http()
        for client in grpc_clients.values():
            client.close()

    return paths, close


def measure(paths: dict[str, Any], requests: int, rounds: int) -> list[dict[str, LatencyStats]]:
    for run in paths.values():
        for _ in range(10):
            run()
    keys = list(paths)
    per_round = []
    for r in range(rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        samples: dict[str, list[int]] = {k: [] for k in keys}
        while any(len(samples[k]) < requests for k in keys):
            for key in order:
                for _ in range(min(BLOCK, requests - len(samples[key]))):
                    start = time.perf_counter_ns()
                    paths[key]()
                    samples[key].append(time.perf_counter_ns() - start)
        per_round.append({k: LatencyStats.from_ns(v) for k, v in samples.items()})
        log(
            f"round {r + 1}/{rounds}: "
            + ", ".join(f"{k} {s.p50_ms:.3f}" for k, s in per_round[-1].items())
            + " (p50 ms)"
        )
    return per_round


def added(rnd: dict[str, LatencyStats], key: str) -> float:
    return rnd[key].p50_ms - rnd["inproc"].p50_ms


def summarize(per_round: list[dict[str, LatencyStats]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        key: {
            "p50_ms": round(statistics.median(r[key].p50_ms for r in per_round), 3),
            "p99_ms": round(statistics.median(r[key].p99_ms for r in per_round), 3),
            "added_p50_ms": round(statistics.median(added(r, key) for r in per_round), 3),
        }
        for key in PATHS
    }
    for key, floor in FLOORS.items():  # per round, then the median of the rounds' ratios
        ratios = [added(r, key) / added(r, floor) for r in per_round if added(r, floor) > 0]
        out[key]["vs_floor"] = round(statistics.median(ratios), 2) if ratios else None
    return out


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the issue, with its figure and whether it was met."""
    found = []
    for model, facts in report["models"].items():
        for key in ("grpc_tcp", "grpc_unix"):
            ratio = facts["paths"][key]["vs_floor"]
            found.append(
                {
                    "goal": f"{model} {key}: added p50 <= {FLOOR_GOAL}x the bare servicer's",
                    "figure": ratio,
                    "met": ratio is not None and ratio <= FLOOR_GOAL,
                }
            )
    for key in ("http_shm", "grpc_shm"):
        ratio = report["shm_large_vs_small_added"][key]
        found.append(
            {
                "goal": f"{key}: det added p50 <= {SHM_GOAL}x cls added p50",
                "figure": ratio,
                "met": ratio is not None and ratio <= SHM_GOAL,
            }
        )
    return found


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--serve-bare-grpc"]:
        return serve_bare_grpc(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=40, help="per path per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 10:
        parser.error("--rounds >= 1, --requests >= 10")
    folder = models_dir([file for file, _ in MODELS.values()])
    report: dict[str, Any] = {
        **benchlib.report_header("transports"),
        "settings": {"rounds": args.rounds, "requests": args.requests, "block": BLOCK},
        "loadavg_1min_start": benchlib.loadavg(),
    }
    if not args.json:
        print(benchlib.machine_line(report["machine"]), flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edged-bench-transports-") as tmp:
        work = Path(tmp)
        files = [folder / file for file, _ in MODELS.values()]
        bare_grpc = BareGrpc(work / "bare-grpc.sock", files)
        daemon = None
        try:
            daemon = Edged(work, write_config(work, folder)).wait_ready()
            found = re.search(r"gRPC \(\S+\) on (127\.0\.0\.1:\d+)", daemon.log_text())
            if not found:
                raise RuntimeError(f"no gRPC address in the log:\n{daemon.log_text()}")
            grpc_tcp, grpc_unix = found.group(1), f"unix://{work / 'grpc.sock'}"
            report["models"] = {}
            for name, (file, shape) in MODELS.items():
                log(f"{name}: {'x'.join(map(str, shape))}")
                x = np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float32)
                session = load_session(folder / file)
                outputs = session.run({"x": x})
                bare_http = BareServer(folder / file)
                bare = {
                    "http": f"127.0.0.1:{bare_http.port}",
                    "grpc_tcp": bare_grpc.tcp,
                    "grpc_unix": bare_grpc.unix,
                }
                paths, close = runners(daemon, grpc_tcp, grpc_unix, bare, name, x, outputs)
                try:
                    want = next(iter(outputs.values()))
                    for key, run in paths.items():  # every path answers what in-process does
                        np.testing.assert_allclose(run(), want, rtol=1e-4, atol=1e-5, err_msg=key)
                    paths = {"inproc": lambda s=session, x=x: s.run({"x": x}), **paths}
                    per_round = measure(paths, args.requests, args.rounds)
                finally:
                    close()
                    session.close()
                    bare_http.stop()
                report["models"][name] = {
                    "input_bytes": x.nbytes,
                    "paths": summarize(per_round),
                }
        finally:
            if daemon is not None:
                daemon.stop()
            bare_grpc.stop()
    small, large = report["models"]["cls"]["paths"], report["models"]["det"]["paths"]
    report["shm_large_vs_small_added"] = {
        key: round(large[key]["added_p50_ms"] / small[key]["added_p50_ms"], 2)
        if small[key]["added_p50_ms"] > 0
        else None
        for key in PATHS[1:]
    }
    report["goals"] = goals(report)
    if not args.json:
        print(format_report(report), flush=True)
    benchlib.finish(report, started, args.json)
    return 0 if all(goal["met"] for goal in report["goals"]) else 1


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{'path':<15} "
        + " ".join(
            f"{name + ' p50':>10} {name + ' added':>11} {'vs bare':>7}" for name in report["models"]
        )
        + f" {'det/cls added':>14}"
    ]
    ratios = report["shm_large_vs_small_added"]
    for key in PATHS:
        row = f"{key:<15} "
        for model in report["models"].values():
            p = model["paths"][key]
            floor = p.get("vs_floor")
            row += f"{p['p50_ms']:>8.3f}ms {p['added_p50_ms']:>9.3f}ms "
            row += f"{floor:>6}x " if floor is not None else f"{'-':>7} "
        ratio = ratios.get(key)
        row += f"{ratio:>13}x" if ratio is not None else f"{'-':>14}"
        lines.append(row)
    for goal in report["goals"]:
        verdict = "met" if goal["met"] else "MISSED"
        lines.append(f"goal {goal['goal']}: {goal['figure']}x, {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
