#!/usr/bin/env python3
"""What Frigate's ZMQ detector path costs, against KServe and gRPC on the same model, and
what pictures cost before the model sees them.

One edged daemon serves the test data's real detector (NudeNet's YOLOv8n, 320x320, on
onnxruntime with 1 thread, as `[models.detector] type = "yologeneric"`), with the Frigate
front end on its Unix socket. Three parts:

1. Added latency over in-process, the paths taking turns in blocks within each round:
   (a) in-process `session.run` on the float tensor; (b) a Frigate-style ZMQ peer sending a
   uint8 RGB frame at the model's size and getting Frigate's 20 rows (edged fits, normalises
   and decodes boxes); (c) KServe over the Unix socket (edged's `Client`, the float tensor);
   (d) KServe gRPC over loopback TCP (tritonclient, the float tensor).
2. Two simulated Frigate instances at 10 fps each (each its own REQ socket, frames sent on a
   fixed schedule) plus a KServe client at --kserve-fps, on the one model, for --share-s
   seconds: each client's p50/p99 (from its scheduled send time: a late answer delays the
   next frame, and that delay counts) and its share of the requests, with the model's
   utilisation (requests per second x its in-process run time). Frigate's own timeout is
   200 ms; the target is p99 < 150 ms for both peers.
3. The picture path in-process (what edged does before the model, on the housekeeping
   CPUs): a 1080p JPEG decoded (Pillow, draft mode at the model's size) and fitted; the same
   decoded in full then fitted; a 1080p NV12 frame converted and fitted; each as a ratio of
   the model's own run. With --decoders, also simplejpeg and OpenCV where installed.

Exit codes: 0 all targets met, 1 a target missed, 2 cannot run (no test data).
Command: .venv/bin/python scripts/bench_frigate.py [--json] [--rounds N] [--share-s S]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from bench_serving import Edged
from benchlib import log
from fetch_test_data import cache_dir, models_dir

MODEL, SIZE = "nudenet_320n.onnx", 320
PEER_FPS = 10
P99_TARGET_MS = 150.0


def write_config(folder: Path, model: Path) -> Path:
    config = folder / "edged.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:0"
socket = "{folder / "edged.sock"}"
grpc_listen = "127.0.0.1:0"
state_dir = "{folder / "state"}"

[frigate]
enabled = true
socket = "{folder / "frigate.sock"}"

[[models]]
name = "det"
path = "{model}"
backend = "onnxruntime"
threads = 1
shapes = {{ images = [1, 3, {SIZE}, {SIZE}] }}
max_batch_size = 4
max_queue_delay_us = 2000
serves_as = ["{MODEL}"]
[models.detector]
type = "yologeneric"
labels = "model"
""")
    return config


class ZmqPeer:
    """A Frigate-style client: a REQ socket, the handshake, then frames."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(endpoint)
        self.sock.send(json.dumps({"model_request": True, "model_name": MODEL}).encode())
        answer = json.loads(self.sock.recv())
        if not answer.get("model_loaded"):
            raise RuntimeError(f"handshake refused: {answer}")

    def detect(self, frame: np.ndarray) -> np.ndarray:
        head = {"shape": list(frame.shape), "dtype": "uint8", "model_type": "yologeneric"}
        self.sock.send_multipart([json.dumps(head).encode(), frame.tobytes()])
        reply = self.sock.recv_multipart()
        return np.frombuffer(reply[-1], np.float32).reshape(20, 6)

    def close(self) -> None:
        self.sock.close(0)


def grpc_port(daemon: Edged) -> int:
    import re

    match = re.search(r"GRPCInferenceService\) on 127\.0\.0\.1:(\d+)", daemon.log_text())
    if not match:
        raise RuntimeError("no gRPC port in the daemon's log")
    return int(match.group(1))


def frame_and_tensor(photo: Path) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    img = Image.open(photo).convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    frame = np.asarray(img)[None]
    tensor = np.ascontiguousarray(frame.transpose(0, 3, 1, 2), dtype=np.float32) / 255.0
    return frame, tensor


# -- 1. added latency -----------------------------------------------------------------------


def latency(daemon: Edged, model: Path, frame, tensor, rounds: int, per_round: int) -> dict:
    import onnxruntime as ort
    import tritonclient.grpc as tg

    from edged.client import Client

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    peer = ZmqPeer(f"ipc://{daemon.folder / 'frigate.sock'}")
    unix = Client(daemon.unix)
    grpc_client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port(daemon)}")
    grpc_in = tg.InferInput("images", list(tensor.shape), "FP32")
    grpc_in.set_data_from_numpy(tensor)
    paths = {
        "in-process": lambda: session.run(None, {"images": tensor}),
        "frigate zmq": lambda: peer.detect(frame),
        "kserve unix": lambda: unix.infer("det", {"images": tensor}),
        "kserve grpc": lambda: grpc_client.infer("det", [grpc_in]),
    }
    for call in paths.values():  # warm every path
        for _ in range(5):
            call()
    per_path: dict[str, list[dict]] = {k: [] for k in paths}
    block = 10
    try:
        for r in range(rounds):
            samples: dict[str, list[float]] = {k: [] for k in paths}
            order = list(paths)[r % len(paths) :] + list(paths)[: r % len(paths)]
            for _ in range(per_round // block):
                for key in order:
                    for _ in range(block):
                        start = time.perf_counter()
                        paths[key]()
                        samples[key].append(time.perf_counter() - start)
            for key, values in samples.items():
                stats = benchlib.latency_stats(values)
                per_path[key].append({"p50": stats.p50_ms, "p99": stats.p99_ms})
            log(f"latency round {r + 1}/{rounds}")
    finally:
        peer.close()
        unix.close()
        grpc_client.close()
    base = [row["p50"] for row in per_path["in-process"]]
    out = {}
    for key, rows in per_path.items():
        added = [row["p50"] - b for row, b in zip(rows, base, strict=True)]
        out[key] = {
            "p50_ms": round(benchlib.median(r["p50"] for r in rows), 3),
            "p99_ms": round(benchlib.median(r["p99"] for r in rows), 3),
            "added_p50_ms": round(benchlib.median(added), 3),
        }
    return out


# -- 2. two Frigate instances and a KServe client ------------------------------------------------


def share(daemon: Edged, frame, tensor, seconds: float, kserve_fps: float) -> dict:
    from edged.client import Client

    stop = time.monotonic() + seconds
    results: dict[str, list[float]] = {"frigate-1": [], "frigate-2": [], "kserve": []}
    errors: list[str] = []

    def paced(name: str, fps: float, offset: float, send) -> None:
        period = 1.0 / fps
        due = time.monotonic() + offset
        try:
            while due < stop:
                time.sleep(max(0.0, due - time.monotonic()))
                send()
                results[name].append(time.monotonic() - due)  # from the scheduled send
                due += period
        except Exception as exc:  # a bench reports, it does not hide
            errors.append(f"{name}: {exc}")

    def peer(name: str, offset: float) -> None:
        client = ZmqPeer(f"ipc://{daemon.folder / 'frigate.sock'}")
        try:
            paced(name, PEER_FPS, offset, lambda: client.detect(frame))
        finally:
            client.close()

    def kserve() -> None:
        with Client(daemon.unix) as client:
            paced("kserve", kserve_fps, 0.025, lambda: client.infer("det", {"images": tensor}))

    threads = [
        threading.Thread(target=peer, args=("frigate-1", 0.0)),
        threading.Thread(target=peer, args=("frigate-2", 0.05)),
        threading.Thread(target=kserve),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(len(v) for v in results.values())
    out: dict[str, Any] = {"seconds": seconds, "errors": errors}
    for name, values in results.items():
        stats = benchlib.latency_stats(values)
        out[name] = {
            "requests": len(values),
            "per_s": round(len(values) / seconds, 1),
            "share": round(len(values) / total, 3),
            "p50_ms": round(stats.p50_ms, 2),
            "p99_ms": round(stats.p99_ms, 2),
        }
    return out


# -- 3. the picture path ---------------------------------------------------------------------


def pictures(model: Path, photo: Path, rounds: int, decoders: bool) -> dict:
    import onnxruntime as ort
    from PIL import Image

    from backends.tensors import TensorSpec
    from edged.serving.pictures import Pictures
    from edged.vision.images import fit, image_input, tensor
    from edged.vision.settings import Preprocessing
    from tests.support.frames import to_yuv420

    target = image_input(TensorSpec("images", "float32", (1, 3, SIZE, SIZE)), Preprocessing())
    pics = Pictures(target, ("output0",), None)
    big = Image.open(photo).convert("RGB").resize((1920, 1080), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    big.save(out, "JPEG", quality=90)
    jpeg = out.getvalue()
    nv12 = to_yuv420(np.asarray(big), "nv12")[None]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    x = pics.to_tensor(jpeg, "jpeg")[0]

    def full_decode() -> np.ndarray:
        with Image.open(io.BytesIO(jpeg)) as img:
            return tensor(fit(np.asarray(img.convert("RGB")), target)[0], target)

    steps = {
        "model run (reference)": lambda: session.run(None, {"images": x}),
        "1080p JPEG, Pillow draft + fit": lambda: pics.to_tensor(jpeg, "jpeg"),
        "1080p JPEG, Pillow full decode + fit": full_decode,
        "1080p NV12 frame, convert + fit": lambda: pics.frames(nv12, "nv12"),
    }
    if decoders:
        try:
            import simplejpeg

            steps["1080p JPEG, simplejpeg (scaled) + fit"] = lambda: tensor(
                fit(
                    simplejpeg.decode_jpeg(jpeg, colorspace="RGB", min_height=SIZE, min_width=SIZE),
                    target,
                )[0],
                target,
            )
        except ImportError:
            log("simplejpeg not installed: left out")
        try:
            import cv2

            def opencv() -> np.ndarray:
                bgr = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_REDUCED_COLOR_2)
                return tensor(fit(bgr[..., ::-1], target)[0], target)

            steps["1080p JPEG, OpenCV (reduced 2) + fit"] = opencv
        except ImportError:
            log("OpenCV not installed: left out")
    per_step: dict[str, list[float]] = {k: [] for k in steps}
    for call in steps.values():
        call()
    for r in range(rounds):
        for key in list(steps)[r % len(steps) :] + list(steps)[: r % len(steps)]:
            times = []
            for _ in range(10):
                start = time.perf_counter()
                steps[key]()
                times.append(time.perf_counter() - start)
            per_step[key].append(benchlib.median(times) * 1e3)
    reference = benchlib.median(per_step["model run (reference)"])
    return {
        key: {
            "ms": round(benchlib.median(v), 2),
            "vs_model_run": round(benchlib.median(v) / reference, 2),
        }
        for key, v in per_step.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="latency rounds (default 8)")
    parser.add_argument("--per-round", type=int, default=100, help="requests per path and round")
    parser.add_argument("--kserve-fps", type=float, default=2.0, help="part 2's KServe rate (2)")
    parser.add_argument("--share-s", type=float, default=30.0, help="part 2's length (30 s)")
    parser.add_argument("--decoders", action="store_true", help="also simplejpeg and OpenCV")
    parser.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    args = parser.parse_args(argv)
    model = models_dir() / MODEL
    photo = cache_dir() / "images" / "photos" / "astronaut.png"
    if not model.exists() or not photo.exists():
        print(f"bench_frigate: {model} or {photo} missing: run `make data` first", file=sys.stderr)
        return 2
    started = time.perf_counter()
    report = benchlib.report_header("bench_frigate", runtimes=True)
    report["loadavg_1min_start"] = benchlib.loadavg()
    frame, x = frame_and_tensor(photo)
    with tempfile.TemporaryDirectory(prefix="edged-bench-frigate-") as tmp:
        daemon = Edged(Path(tmp), write_config(Path(tmp), model)).wait_ready()
        try:
            report["latency"] = latency(daemon, model, frame, x, args.rounds, args.per_round)
            log(f"two Frigate peers at {PEER_FPS} fps and a KServe client, {args.share_s:.0f} s")
            report["share"] = share(daemon, frame, x, args.share_s, args.kserve_fps)
            run_ms = report["latency"]["in-process"]["p50_ms"]
            rate = sum(report["share"][k]["per_s"] for k in ("frigate-1", "frigate-2", "kserve"))
            report["share"]["utilisation"] = round(rate * run_ms / 1000, 2)
        finally:
            daemon.stop()
    report["pictures"] = pictures(model, photo, args.rounds, args.decoders)
    peers = [report["share"][k]["p99_ms"] for k in ("frigate-1", "frigate-2")]
    report["targets"] = [
        {
            "target": f"each Frigate peer's p99 < {P99_TARGET_MS:.0f} ms beside another peer "
            "and a KServe client",
            "value": peers,
            "met": all(p < P99_TARGET_MS for p in peers) and not report["share"]["errors"],
        }
    ]
    code = 0 if all(t["met"] for t in report["targets"]) else 1
    if not args.json:
        print(format_report(report))
    benchlib.finish(report, started, args.json)
    return code


def format_report(report: dict[str, Any]) -> str:
    lines = [benchlib.machine_line(report["machine"]), "", "added latency (medians of rounds):"]
    lines.append(f"  {'path':<14} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10}")
    for key, row in report["latency"].items():
        lines.append(
            f"  {key:<14} {row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f} {row['added_p50_ms']:>+10.3f}"
        )
    share = report["share"]
    lines += [
        "",
        f"two Frigate peers at {PEER_FPS} fps + a KServe client, {share['seconds']:.0f} s "
        "(latency from each scheduled send):",
    ]
    for key in ("frigate-1", "frigate-2", "kserve"):
        row = share[key]
        lines.append(
            f"  {key:<10} {row['requests']:>6} req ({row['per_s']:>6.1f}/s, "
            f"share {row['share']:.2f}) p50 {row['p50_ms']:.1f} ms p99 {row['p99_ms']:.1f} ms"
        )
    lines.append(f"  the model's utilisation: {share['utilisation']:.2f} (rate x in-process p50)")
    if share["errors"]:
        lines.append(f"  errors: {share['errors']}")
    lines += ["", "picture path (in-process, medians):"]
    for key, row in report["pictures"].items():
        lines.append(
            f"  {key:<40} {row['ms']:>8.2f} ms  {row['vs_model_run']:>5.2f}x the model run"
        )
    lines.append("")
    for t in report["targets"]:
        lines.append(f"{'PASS' if t['met'] else 'FAIL'}: {t['target']} ({t['value']})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
