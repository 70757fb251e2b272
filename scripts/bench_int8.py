#!/usr/bin/env python3
"""INT8 against FP32 of the PP-OCRv4 text detector, per backend, on this machine.

For every available candidate (onnxruntime:CPU, openvino:CPU:fp32, openvino:CPU:bf16, ...)
both the fp32 and the INT8 QDQ model are loaded, and all sessions are timed in one
`edged.selection.bench.benchmark` call per round, so a noisy neighbour's bursts land on every
session alike. Figures are medians over rounds of per-round figures; the speedup is fp32/int8 of the
same round (above 1: INT8 is faster). Accuracy: the INT8 model's output against the fp32
model's output on the same text-like images, by cosine (`edged.selection.accuracy.compare`), and the
IoU of the binarised text maps at 0.3 (the DB post-processing threshold of PP-OCR).

Run from a checkout: `.venv/bin/python scripts/bench_int8.py [--size 640 --size 320] [--json]`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from benchlib import log
from fetch_test_data import models_dir

from backends import LoadOptions, get_backend, probe_hardware
from backends.base import Candidate, Session
from backends.errors import BackendError, InputError, ModelError
from backends.model_info import ModelInfo, inspect_model
from edged.selection.accuracy import compare
from edged.selection.bench import LatencyStats, benchmark
from edged.selection.candidates import all_candidates, matches
from edged.selection.inputs import make_inputs, resolve_shapes

FP32_MODEL = "ppocrv4_det.onnx"
INT8_MODEL = "ppocrv4_det_int8.onnx"
DB_THRESHOLD = 0.3  # PP-OCR's det_db_thresh: pixels above it are text


def mask_iou(a: np.ndarray, b: np.ndarray, threshold: float = DB_THRESHOLD) -> float:
    """IoU of the text pixels (> threshold) of two probability maps; 1.0 when both empty."""
    ma, mb = np.asarray(a) > threshold, np.asarray(b) > threshold
    union = np.logical_or(ma, mb).sum()
    return float(np.logical_and(ma, mb).sum() / union) if union else 1.0


def first_output(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    return next(iter(outputs.values()))


def load_sessions(
    candidates: list[Candidate], models: dict[str, ModelInfo], options: LoadOptions
) -> tuple[dict[tuple[str, str], Session], list[dict]]:
    sessions: dict[tuple[str, str], Session] = {}
    errors = []
    for candidate in candidates:
        for label, info in models.items():
            try:
                sessions[candidate.key, label] = get_backend(candidate.backend).load(
                    info, candidate, options
                )
            except (BackendError, ModelError, ImportError) as exc:
                errors.append({"candidate": candidate.key, "model": label, "error": str(exc)})
    return sessions, errors


def accuracy(
    sessions: dict[tuple[str, str], Session], input_specs, shapes, seeds: int
) -> tuple[dict[tuple[str, str], dict[str, float]], str | None]:
    """Per session: median and worst cosine and IoU, and the largest max-abs difference, over
    `seeds` text-like images against (a) the same backend's fp32-model output and (b)
    onnxruntime's fp32-model output (true float32; another fp32 session when it is not
    benchmarked). Returns the rows and the reference's key."""
    feeds = [make_inputs(input_specs, shapes, seed=s) for s in range(seeds)]
    outputs = {key: [s.run(f) for f in feeds] for key, s in sessions.items()}
    ort_ref = next(
        (k for k in outputs if k[0].startswith("onnxruntime:CPU") and k[1] == "fp32"), None
    ) or next((k for k in outputs if k[1] == "fp32"), None)
    result = {}
    for key, outs in outputs.items():
        row: dict[str, float] = {}
        same = (key[0], "fp32")
        for name, ref_key in (("same_backend", same), ("reference", ort_ref)):
            if ref_key not in outputs:
                continue
            pairs = [compare(r, o) for r, o in zip(outputs[ref_key], outs, strict=True)]
            ious = [
                mask_iou(first_output(r), first_output(o))
                for r, o in zip(outputs[ref_key], outs, strict=True)
            ]
            row[f"cosine_vs_{name}_fp32"] = round(benchlib.median([p[0] for p in pairs]), 6)
            row[f"min_cosine_vs_{name}_fp32"] = round(min(p[0] for p in pairs), 6)
            row[f"max_abs_vs_{name}_fp32"] = round(max(p[1] for p in pairs), 6)
            row[f"iou_vs_{name}_fp32"] = round(benchlib.median(ious), 4)
            row[f"min_iou_vs_{name}_fp32"] = round(min(ious), 4)
        result[key] = row
    return result, "|".join(ort_ref) if ort_ref else None


def run_size(
    size: int,
    candidates: list[Candidate],
    models: dict[str, ModelInfo],
    args,
    log: Callable[[str], None],
) -> dict[str, Any]:
    # Learn the input name from one load, then load everything with static shapes.
    probe_session = get_backend(candidates[0].backend).load(
        models["fp32"], candidates[0], LoadOptions(threads=args.threads)
    )
    shapes = resolve_shapes(probe_session.inputs, {"": (1, 3, size, size)}, models["fp32"].name)
    probe_session.close()
    options = LoadOptions(threads=args.threads, shapes=shapes)
    start = time.perf_counter()
    sessions, errors = load_sessions(candidates, models, options)
    log(f"{size}x{size}: loaded {len(sessions)} sessions in {time.perf_counter() - start:.1f} s")
    if not sessions:
        raise SystemExit(f"bench_int8: no session loaded: {errors}")
    specs = next(iter(sessions.values())).inputs
    acc, reference = accuracy(sessions, specs, shapes, args.seeds)
    feeds = make_inputs(specs, shapes, seed=0)
    keys = list(sessions)
    per_round: list[dict[tuple[str, str], LatencyStats]] = []
    load_before = benchlib.loadavg()
    for r in range(args.rounds):
        # Rotate the order each round: no session always runs right after the same one.
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        runners = {f"{k[0]}|{k[1]}": (lambda s=sessions[k]: s.run(feeds)) for k in order}
        t0 = time.perf_counter()
        stats = benchmark(runners, args.runs, args.warmup)
        per_round.append({k: stats[f"{k[0]}|{k[1]}"] for k in keys})
        log(f"{size}x{size}: round {r + 1}/{args.rounds} in {time.perf_counter() - t0:.1f} s")
    load_after = benchlib.loadavg()
    rows = []
    for candidate in candidates:
        fp32, int8 = (candidate.key, "fp32"), (candidate.key, "int8")
        if fp32 not in sessions or int8 not in sessions:
            continue
        row: dict[str, Any] = {"candidate": candidate.key}
        for label, key in (("fp32", fp32), ("int8", int8)):
            row[f"{label}_precision"] = sessions[key].info().get("precision")
            for q in ("p50_ms", "p99_ms"):
                row[f"{label}_{q}"] = round(
                    benchlib.median([getattr(rs[key], q) for rs in per_round]), 3
                )
        for q in ("p50", "p99"):
            ratios = [
                getattr(rs[fp32], f"{q}_ms") / getattr(rs[int8], f"{q}_ms") for rs in per_round
            ]
            row[f"speedup_{q}"] = round(benchlib.median(ratios), 3)
            row[f"speedup_{q}_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        row["fp32_accuracy"] = acc[fp32]
        row["int8_accuracy"] = acc[int8]
        rows.append(row)
    best = {
        label: min(
            (k for k in keys if k[1] == label),
            key=lambda k: benchlib.median([rs[k].p50_ms for rs in per_round]),
            default=None,
        )
        for label in ("fp32", "int8")
    }
    for session in sessions.values():
        session.close()
    return {
        "size": [size, size],
        "shapes": {k: list(v) for k, v in shapes.items()},
        "runs": args.runs,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "threads": args.threads,
        "accuracy_images": args.seeds,
        "accuracy_reference": reference,
        "loadavg_1min": [load_before, load_after],
        "results": rows,
        "fastest_p50": {label: "|".join(k) if k else None for label, k in best.items()},
        "errors": errors,
        "per_round": [{"|".join(k): v.to_dict() for k, v in rs.items()} for rs in per_round],
    }


def format_size(block: dict[str, Any]) -> str:
    h, w = block["size"]
    lines = [
        f"det {h}x{w}: {block['rounds']} rounds x {block['runs']} runs per session, "
        f"{block['threads']} threads; medians of per-round figures (ms); "
        f"speedup = fp32/int8 (min-max over rounds); loadavg {block['loadavg_1min'][0]}"
        f" -> {block['loadavg_1min'][1]}"
    ]
    lines.append(
        f"  {'candidate':22} {'fp32 ran':9} {'p50':>7} {'p99':>7}  {'int8 ran':9} "
        f"{'p50':>7} {'p99':>7}  {'x p50':>17} {'x p99':>17}  {'cos med/min':>13} "
        f"{'IoU med/min':>11}"
    )
    for r in block["results"]:
        a = r["int8_accuracy"]
        sp50 = (
            f"{r['speedup_p50']:.2f} ({r['speedup_p50_range'][0]:.2f}-"
            f"{r['speedup_p50_range'][1]:.2f})"
        )
        sp99 = (
            f"{r['speedup_p99']:.2f} ({r['speedup_p99_range'][0]:.2f}-"
            f"{r['speedup_p99_range'][1]:.2f})"
        )
        lines.append(
            f"  {r['candidate']:22} {r['fp32_precision'] or '-':9} {r['fp32_p50_ms']:7.2f} "
            f"{r['fp32_p99_ms']:7.2f}  {r['int8_precision'] or '-':9} {r['int8_p50_ms']:7.2f} "
            f"{r['int8_p99_ms']:7.2f}  {sp50:>17} {sp99:>17}  "
            f"{a['cosine_vs_same_backend_fp32']:6.4f}/{a['min_cosine_vs_same_backend_fp32']:6.4f} "
            f"{a['iou_vs_same_backend_fp32']:5.3f}/{a['min_iou_vs_same_backend_fp32']:5.3f}"
        )
    lines.append(
        f"  cos, IoU: int8 model vs the same backend's fp32 model, median/worst of "
        f"{block['accuracy_images']} text-like images (IoU of text pixels > 0.3)"
    )
    lines.append(
        f"  vs the reference {block['accuracy_reference']} (fp32 model): cosine "
        "med/min, max-abs, IoU med/min"
    )
    for r in block["results"]:
        for label in ("fp32", "int8"):
            a = r[f"{label}_accuracy"]
            lines.append(
                f"    {r['candidate']:22} {label} model: "
                f"{a['cosine_vs_reference_fp32']:.4f}/"
                f"{a['min_cosine_vs_reference_fp32']:.4f}  "
                f"{a['max_abs_vs_reference_fp32']:.4f}  "
                f"{a['iou_vs_reference_fp32']:.3f}/{a['min_iou_vs_reference_fp32']:.3f}"
            )
    for r in block["results"]:
        verdict = (
            "pays off"
            if r["speedup_p50"] > 1.05 and r["speedup_p99"] > 1.0
            else ("no clear gain" if r["speedup_p50"] >= 0.95 else "is slower")
        )
        lines.append(
            f"  => {r['candidate']}: INT8 {verdict} (p50 x{r['speedup_p50']:.2f}, "
            f"p99 x{r['speedup_p99']:.2f})"
        )
    fast = block["fastest_p50"]
    lines.append(f"  => fastest p50 overall: fp32 model {fast['fp32']}, int8 model {fast['int8']}")
    for e in block["errors"]:
        lines.append(f"  failed: {e['candidate']} {e['model']}: {e['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        type=int,
        action="append",
        help="square input size, repeatable (default: 640 and 320)",
    )
    parser.add_argument("--runs", type=int, default=100, help="timed runs per session per round")
    parser.add_argument("--rounds", type=int, default=3, help="benchmark rounds (medians)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up runs per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=5, help="text-like images for accuracy")
    parser.add_argument(
        "--backend",
        default="all",
        help="all, or NAME[:DEVICE[:PRECISION]] (edgectl's --backend syntax)",
    )
    parser.add_argument("--fp32", type=Path, help=f"fp32 model (default: {FP32_MODEL})")
    parser.add_argument("--int8", type=Path, help=f"INT8 model (default: {INT8_MODEL})")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.warmup < 0 or args.seeds < 1:
        parser.error("--runs, --rounds and --seeds must be at least 1, --warmup at least 0")
    sizes = args.size or [640, 320]

    folder = None if (args.fp32 and args.int8) else models_dir((FP32_MODEL, INT8_MODEL))
    try:
        models = {
            "fp32": inspect_model(args.fp32 or folder / FP32_MODEL),
            "int8": inspect_model(args.int8 or folder / INT8_MODEL),
        }
    except ModelError as exc:
        parser.error(str(exc))
    if models["int8"].precision != "int8":
        log(f"warning: {models['int8'].name} is not INT8 ({models['int8'].precision_detail})")
    hw = probe_hardware()
    candidates = [
        c for c in all_candidates(hw, models["fp32"]) if c.available and matches(c, args.backend)
    ]
    if not candidates:
        parser.error(f"--backend {args.backend}: no available candidate")
    report: dict[str, Any] = {
        **benchlib.report_header("int8_vs_fp32", hw, runtimes=True),
        "models": {
            k: {"path": str(m.path), "precision": m.precision_detail} for k, m in models.items()
        },
        "sizes": [],
    }
    try:
        for size in sizes:
            report["sizes"].append(run_size(size, candidates, models, args, log))
            if not args.json:
                print(format_size(report["sizes"][-1]), flush=True)
    except InputError as exc:
        parser.error(str(exc))
    if args.json:
        benchlib.write_json(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
