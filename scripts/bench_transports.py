#!/usr/bin/env python3
"""The protocol's transports side by side (issue 14): what each adds over running the model
in-process, for a small input (the cls model, 1x3x48x192 FP32, 110 KiB) and a large one (the
det model at 1x3x640x640 FP32, 4.9 MB).

One real daemon (`python -m edged.daemon`, onnxruntime CPU, 1 thread, max_batch_size 1,
`allow_shared_memory = true`) serves both models; unmodified tritonclient calls it along:

  inproc     the same backend loaded in this process, `session.run`
  http       tritonclient.http, binary tensors, TCP
  grpc_tcp   tritonclient.grpc over TCP
  grpc_unix  tritonclient.grpc over the Unix socket
  http_shm   tritonclient.http, input and output in system shared memory
  grpc_shm   tritonclient.grpc (TCP), input and output in system shared memory

With shared memory the input is written into its region once (a camera application writes
its frame there itself) and each request reads the output from its region as a numpy view.
Paths are interleaved in blocks within a round, the order rotated per round; "added" is a
path's p50 minus in-process p50 of the same round, and the figures are medians over rounds.

The issue's goal for shared memory: the 4.9 MB input's added latency at most 1.2x the small
one's, so that size stops mattering. Not here yet: the bare grpcio servicer floor (the
goal "gRPC within 1.3x its bare floor"); bench_serving.py has the bare HTTP floor.

Usage: bench_transports.py [--rounds N] [--requests N] [--json]   (exit 0; prints the ISA)
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from bench_serving import Edged, load_session
from benchlib import log
from fetch_test_data import models_dir

from edged.selection.bench import LatencyStats

MODELS = {"cls": ("ppocr_cls.onnx", (1, 3, 48, 192)), "det": ("ppocrv4_det.onnx", (1, 3, 640, 640))}
PATHS = ("inproc", "http", "grpc_tcp", "grpc_unix", "http_shm", "grpc_shm")
BLOCK = 10
SHM_GOAL = 1.2


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


def runners(daemon: Edged, grpc_tcp: str, grpc_unix: str, name: str, x: np.ndarray, outputs):
    """model -> path -> a callable doing one request; and the clean-up."""
    import tritonclient.grpc as tg
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as shm

    http = th.InferenceServerClient(daemon.tcp, network_timeout=60.0)
    g_tcp = tg.InferenceServerClient(grpc_tcp)
    g_unix = tg.InferenceServerClient(grpc_unix)
    out_name, out_array = next(iter(outputs.items()))
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
        "http": http_plain,
        "grpc_tcp": grpc_plain(g_tcp),
        "grpc_unix": grpc_plain(g_unix),
        "http_shm": shm_request(th, http),
        "grpc_shm": shm_request(tg, g_tcp),
    }

    def close() -> None:
        http.unregister_system_shared_memory()
        for region in (region_in, region_out):
            shm.destroy_shared_memory_region(region)
        http.close()
        g_tcp.close()
        g_unix.close()

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


def summarize(per_round: list[dict[str, LatencyStats]]) -> dict[str, Any]:
    out = {}
    for key in PATHS:
        out[key] = {
            "p50_ms": round(statistics.median(r[key].p50_ms for r in per_round), 3),
            "p99_ms": round(statistics.median(r[key].p99_ms for r in per_round), 3),
            "added_p50_ms": round(
                statistics.median(r[key].p50_ms - r["inproc"].p50_ms for r in per_round), 3
            ),
        }
    return out


def main(argv: list[str] | None = None) -> int:
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
        daemon = Edged(work, write_config(work, folder)).wait_ready()
        try:
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
                paths, close = runners(daemon, grpc_tcp, grpc_unix, name, x, outputs)
                want = next(iter(outputs.values()))
                for key, run in paths.items():  # every path answers what in-process does
                    np.testing.assert_allclose(run(), want, rtol=1e-4, atol=1e-5, err_msg=key)
                paths = {"inproc": lambda s=session, x=x: s.run({"x": x}), **paths}
                try:
                    per_round = measure(paths, args.requests, args.rounds)
                finally:
                    close()
                    session.close()
                report["models"][name] = {
                    "input_bytes": x.nbytes,
                    "paths": summarize(per_round),
                }
        finally:
            daemon.stop()
    small, large = report["models"]["cls"]["paths"], report["models"]["det"]["paths"]
    report["shm_large_vs_small_added"] = {
        key: round(large[key]["added_p50_ms"] / small[key]["added_p50_ms"], 2)
        if small[key]["added_p50_ms"] > 0
        else None
        for key in PATHS[1:]
    }
    report["shm_goal"] = SHM_GOAL
    if not args.json:
        print(format_report(report), flush=True)
    return benchlib.finish(report, started, args.json)


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{'path':<10} "
        + " ".join(f"{name + ' p50':>10} {name + ' added':>11}" for name in report["models"])
        + f" {'det/cls added':>14}"
    ]
    ratios = report["shm_large_vs_small_added"]
    for key in PATHS:
        row = f"{key:<10} "
        for model in report["models"].values():
            p = model["paths"][key]
            row += f"{p['p50_ms']:>8.3f}ms {p['added_p50_ms']:>9.3f}ms "
        ratio = ratios.get(key)
        row += f"{ratio:>13}x" if ratio is not None else f"{'-':>14}"
        lines.append(row)
    shm = [ratios[k] for k in ("http_shm", "grpc_shm") if ratios.get(k) is not None]
    met = all(r <= SHM_GOAL for r in shm) if shm else False
    lines.append(
        f"shared memory: the 4.9 MB input adds {', '.join(f'{r}x' for r in shm)} of what the "
        f"small one adds (goal <= {SHM_GOAL}x: {'met' if met else 'missed'})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
