#!/usr/bin/env python3
"""What making INT8 variants in the background costs the model being served.

Two real daemons in turn, the same served model (PP-OCR cls, the FP32 original, pinned to
the last CPU) under the same periodic client (`--hz`, over the Unix socket):
  * "job": the model has `calibration` data (rendered text lines) and a fresh state dir, so
    the daemon serves the original and makes its variants in the background child
    (SCHED_IDLE, housekeeping CPUs); measured from READY until the job is done;
  * "no job": the same model and selection without calibration, measured as long.
Rounds alternate which one runs first. Figures: client-side latency p50/p99/p99.9 per phase,
the medians over rounds, the p99 ratio job / no job; the job's duration and peak memory
(its child's, from `edgectl status`). The swap at the end of the job (the new pick loading
on the model's CPU) is inside the "job" window, on purpose: it is part of the cost.

    .venv/bin/python scripts/bench_variant_job.py [--rounds R] [--hz HZ] [--json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib
import numpy as np
from benchlib import log
from fetch_test_data import models_dir

from edged.client import Client
from edged.selection.inputs import rendered_text_lines, text_like_images
from tests.support.daemon_harness import Daemon, write_config


def config(folder: Path, calibration: Path | None, cpu: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    calib = (
        f'calibration = {{ data = "{calibration}", mean = 0.5, std = 0.5 }}' if calibration else ""
    )
    return write_config(
        folder,
        f"""
[telemetry]
enabled = false

[[models]]
name = "cls"
path = "{models_dir() / "ppocr_cls.onnx"}"
threads = 1
cpus = "{cpu}"
shapes = {{ x = [1, 3, 48, 192] }}
{calib}
""",
    )


def client_loop(address: str, stop: threading.Event, hz: float, out: list[float]) -> None:
    grey = next(text_like_images(48, 192, 1, 0))
    x = {"x": (np.repeat(grey[None, None], 3, axis=1) * 2 - 1).astype(np.float32)}
    with Client(address) as client:
        next_at = time.monotonic()
        while not stop.is_set():
            t0 = time.perf_counter()
            client.infer("cls", x)
            out.append((time.perf_counter() - t0) * 1000.0)
            next_at += 1 / hz
            stop.wait(max(0.0, next_at - time.monotonic()))


def percentiles(ms: list[float]) -> dict[str, float]:
    stats = benchlib.latency_stats([x / 1e3 for x in ms])
    return {
        "n": len(ms),
        "p50_ms": round(stats.p50_ms, 3),
        "p99_ms": round(stats.p99_ms, 3),
        "p999_ms": round(stats.p999_ms, 3),
        "max_ms": round(max(ms), 3),
    }


def run_phase(
    folder: Path, calibration: Path | None, seconds: float | None, hz: float, cpu: int, log
) -> dict:
    daemon = Daemon(config(folder, calibration, cpu)).wait_ready()
    latencies: list[float] = []
    stop = threading.Event()
    sock = f"unix:{folder / 'edged.sock'}"
    thread = threading.Thread(target=client_loop, args=(sock, stop, hz, latencies))
    try:
        start = time.monotonic()
        thread.start()
        job = None
        with Client(sock) as control:
            while True:
                if calibration is not None:
                    job = control.status()["models"][0]["variants_job"]
                    if job and job["state"] not in ("pending", "running"):
                        break
                elif time.monotonic() - start >= (seconds or 0):
                    break
                time.sleep(0.25)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        thread.join()
        daemon.stop()
    result = {"seconds": round(elapsed, 1), **percentiles(latencies)}
    if job is not None:
        result["job"] = {
            k: job.get(k)
            for k in (
                "state",
                "duration_s",
                "peak_rss_bytes",
                "scheduling",
                "cpus",
                "pick",
                "error",
            )
        }
    log(f"{'job' if calibration else 'no job'}: {result}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hz", type=float, default=100.0, help="client request rate")
    parser.add_argument("--samples", type=int, default=60, help="calibration images")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    cpu = max(os.sched_getaffinity(0))
    rounds = []
    with tempfile.TemporaryDirectory(prefix="edged-bench-job-") as tmp:
        root = Path(tmp)
        images = root / "calibration"
        images.mkdir()
        for index, image in enumerate(rendered_text_lines(args.samples, seed=7)):
            image.save(images / f"{index:03d}.png")
        for r in range(args.rounds):
            order = ("job", "no job") if r % 2 == 0 else ("no job", "job")
            phases: dict[str, dict] = {}
            for kind in order:
                folder = root / f"round{r}-{kind.replace(' ', '')}"
                seconds = phases["job"]["seconds"] if "job" in phases else None
                if kind == "no job" and seconds is None:
                    seconds = 30.0  # a first "no job" phase: the job's usual length here
                phases[kind] = run_phase(
                    folder, images if kind == "job" else None, seconds, args.hz, cpu, log
                )
            rounds.append(phases)
    ratio = statistics.median(r["job"]["p99_ms"] / r["no job"]["p99_ms"] for r in rounds)
    report = {
        **benchlib.report_header("variant_job"),
        "model_cpu": cpu,
        "hz": args.hz,
        "rounds": rounds,
        "median": {
            kind: {
                k: statistics.median(r[kind][k] for r in rounds)
                for k in ("p50_ms", "p99_ms", "p999_ms")
            }
            for kind in ("job", "no job")
        },
        "p99_job_over_no_job": round(ratio, 3),
        "job_duration_s_median": statistics.median(
            r["job"]["job"]["duration_s"] or 0 for r in rounds
        ),
        "job_peak_rss_mib_median": round(
            statistics.median((r["job"]["job"]["peak_rss_bytes"] or 0) for r in rounds) / 2**20, 1
        ),
    }
    if args.json:
        benchlib.write_json(report)
    else:
        print(
            f"{benchlib.machine_line(report['machine'])}; model on CPU {cpu}, client at "
            f"{args.hz:g} Hz over the Unix socket"
        )
        for i, r in enumerate(rounds, 1):
            for kind in ("job", "no job"):
                x = r[kind]
                print(
                    f"  round {i} {kind:6}: {x['seconds']:6.1f} s, n={x['n']:5d}, p50 "
                    f"{x['p50_ms']:.3f} ms, p99 {x['p99_ms']:.3f} ms, p99.9 "
                    f"{x['p999_ms']:.3f} ms, max {x['max_ms']:.3f} ms"
                )
        m = report["median"]
        print(
            f"median p99: job {m['job']['p99_ms']:.3f} ms, no job {m['no job']['p99_ms']:.3f} "
            f"ms -> ratio {report['p99_job_over_no_job']:.2f}; job {report['job_duration_s_median']:.1f} s, "  # noqa: E501
            f"peak {report['job_peak_rss_mib_median']:.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
