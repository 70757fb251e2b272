#!/usr/bin/env python3
"""`edgectl quantize` per model and backend: FP32 against the INT8 recipe it picks.

For each model (the PP-OCRv4 text detector and the PP-OCR direction classifier) a
calibration set and a separate evaluation set (another seed) of rendered text images are
written as PNG files to a temporary folder and read back with
`edged.quantize.calibration.load_samples` (the path `edgectl quantize --calibration DIR
--eval DIR` takes). Then, for each target backend on its own,
`edged.quantize.quantizer.quantize_model` runs with `Settings(targets=(target,))`:
every recipe is quantized, gated on accuracy against the FP32 outputs (with mixed-precision
retries), and the passing ones are timed against FP32 in one interleaved benchmark on that
backend. Printed per model and backend: FP32 p50, the recipe picked (or FP32 kept, and why),
its p50 and speedup from that same run, its accuracy (cosine mean/min, max-abs, top-1
agreement for the classifier), its FP32 node count, every attempted recipe with its gate
result and speedup, and the wall time of the quantize run.

Run from a checkout: `.venv/bin/python scripts/bench_quantize.py [--models det,cls]
[--targets onnxruntime,openvino] [--json]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
from benchlib import log
from fetch_test_data import models_dir

from backends import quantize_targets
from edged.quantize.calibration import (
    load_samples,
    narrowness_warnings,
    parse_size,
)
from edged.quantize.calibration_spec import CalibrationError, Preprocess
from edged.quantize.quantizer import input_specs, quantize_model
from edged.quantize.recipes import Settings
from edged.selection.inputs import rendered_text_lines, rendered_text_pages

# name -> file, image generator, preprocessing (what `edgectl quantize` would be given)
MODELS: dict[str, dict[str, Any]] = {
    "det": {
        "file": "ppocrv4_det.onnx",
        "images": lambda count, seed, sizes: rendered_text_pages(count, seed, sizes=sizes),
        "preprocess": Preprocess(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
        "cli": "--mean 0.485,0.456,0.406 --std 0.229,0.224,0.225",
    },
    "cls": {
        "file": "ppocr_cls.onnx",
        "images": lambda count, seed, sizes: rendered_text_lines(count, seed, height=48, width=192),
        "preprocess": Preprocess(size=(48, 192), mean=(0.5,), std=(0.5,)),
        "cli": "--resize 48x192 --mean 0.5 --std 0.5",
    },
}
# rendered_text_pages' default page sizes (height, width); the interleaved benchmark of
# quantize_model times the first evaluation sample, so the first size is the timed one.
DET_SIZES = "128x256,160x320,96x384"
CALIBRATION_SEED = 1000
EVALUATION_SEED = 2000


def write_images(folder: Path, images) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index, image in enumerate(images):
        image.save(folder / f"{index:04d}.png")
    return folder


class Progress:
    """quantize_model's progress as plain stderr lines: each phase once, and its end."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.phase = ""
        self.start = time.perf_counter()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase:
            self.phase = phase
            log(f"{self.prefix}: {phase} ({total}) at {time.perf_counter() - self.start:.1f} s")


def run_one(
    name: str,
    spec: dict[str, Any],
    path: Path,
    target: str,
    calibration,
    evaluation,
    warnings: list[str],
    args,
    workdir: Path,
    log,
) -> dict[str, Any]:
    settings = Settings(
        targets=(target,), threads=args.threads, runs=args.runs, time_budget_s=args.time_budget
    )
    t0 = time.perf_counter()
    report = quantize_model(
        path,
        workdir / f"{name}-{target}.onnx",
        calibration,
        evaluation,
        settings,
        warnings,
        Progress(f"{name} {target}"),
    )
    wall = time.perf_counter() - t0
    out = report.to_dict()
    out["wall_s"] = round(wall, 1)
    out["model"] = name
    out["timed_shape"] = [list(v.shape) for v in evaluation.feeds[0].values()]
    fp32 = out["fp32_ms"].get(target)
    log(
        f"{name} {target}: {out['recipe']} in {wall:.1f} s"
        + (f", fp32 p50 {fp32:.3f} ms" if fp32 is not None else "")
    )
    return out


def format_result(r: dict[str, Any]) -> str:
    target = r["attempts"][0]["target"] if r["attempts"] else r["target"]
    fp32 = r["fp32_ms"].get(target)
    shape = "x".join(str(d) for d in r["timed_shape"][0])
    lines = [
        f"{r['model']} on {target} (timed at {shape}; quantize wall {r['wall_s']:.1f} s; "
        f"{r['samples']['calibration']} calibration / {r['samples']['evaluation']} "
        f"evaluation images)"
    ]
    lines.append(f"  FP32 p50: {'-' if fp32 is None else f'{fp32:.3f} ms'}")
    if r["recipe"] == "fp32":
        lines.append(f"  picked: FP32 kept: {r['reason']}")
    else:
        acc = r["accuracy"]
        picked = next(a for a in r["attempts"] if a["recipe"] == r["recipe"])
        top1 = acc.get("top1_agreement")
        lines.append(
            f"  picked: {r['recipe']} ({len(r['fp32_nodes'])} FP32 nodes), p50 "
            f"{picked['p50_ms']:.3f} ms, {r['speedup']:.2f}x FP32; cosine "
            f"{acc['cosine']:.4f} mean / {acc['cosine_min']:.4f} min, max-abs "
            f"{acc['max_abs']:.3g}" + (f", top-1 agreement {top1:.3f}" if top1 is not None else "")
        )
    lines.append(
        f"  {'attempted recipe':<26} {'fp32 nodes':>10} {'cosine':>8} {'min':>8} "
        f"{'max-abs':>8} {'top-1':>6} {'gate':>5} {'p50 ms':>8} {'speedup':>7}"
    )
    for a in r["attempts"]:
        acc = a["accuracy"] or {}
        gate = "pass" if a["passed"] else ("error" if a["error"] else "fail")

        def fmt(value, spec):
            return "-" if value is None else format(value, spec)

        lines.append(
            f"  {a['recipe']:<26} {len(a['fp32_nodes']):>10} "
            f"{fmt(acc.get('cosine'), '.4f'):>8} {fmt(acc.get('cosine_min'), '.4f'):>8} "
            f"{fmt(acc.get('max_abs'), '.3g'):>8} "
            f"{fmt(acc.get('top1_agreement'), '.3f'):>6} {gate:>5} "
            f"{fmt(a['p50_ms'], '.3f'):>8} {fmt(a['speedup'], '.2f'):>7}"
        )
        if a["error"]:
            lines.append(f"    {a['error']}")
    for warning in r["warnings"]:
        lines.append(f"  warning: {warning}")
    return "\n".join(lines)


TARGETS = quantize_targets("onnx")  # the backends that gate an INT8 ONNX model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="det,cls", help="comma list of det, cls")
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma list of {', '.join(TARGETS)}; each is quantized for alone",
    )
    parser.add_argument(
        "--calibration", type=int, default=120, help="calibration images (default 120)"
    )
    parser.add_argument(
        "--eval", type=int, default=40, help="evaluation images, another seed (default 40)"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=200,
        help="timed runs per recipe in the interleaved benchmark (default 200)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds of benchmarking per model and target (default 10)",
    )
    parser.add_argument("--threads", type=int, default=None, help="inference threads")
    parser.add_argument(
        "--det-sizes",
        default=DET_SIZES,
        metavar="HxW,...",
        help="page sizes of the det images, cycled; the first is the timed "
        f"shape (default {DET_SIZES})",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models {args.models}: use a comma list of {', '.join(MODELS)}")
    if not targets or any(t not in TARGETS for t in targets):
        parser.error(f"--targets {args.targets}: use a comma list of {', '.join(TARGETS)}")
    if args.calibration < 1 or args.eval < 1 or args.runs < 1 or args.time_budget <= 0:
        parser.error("--calibration, --eval and --runs must be at least 1, --time-budget > 0")
    try:
        det_sizes = tuple(parse_size(s) for s in args.det_sizes.split(","))
    except CalibrationError as exc:
        parser.error(str(exc))
    if any(h % 32 or w % 32 for h, w in det_sizes):
        parser.error(f"--det-sizes {args.det_sizes}: the detector takes multiples of 32")

    folder = models_dir([MODELS[m]["file"] for m in models])
    report: dict[str, Any] = {
        **benchlib.report_header("quantize", runtimes=True),
        "calibration_images": args.calibration,
        "evaluation_images": args.eval,
        "det_sizes": [list(s) for s in det_sizes],
        "loadavg_1min_start": benchlib.loadavg(),
        "results": [],
    }
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edged-bench-quantize-") as tmp:
        workdir = Path(tmp)
        for name in models:
            spec = MODELS[name]
            path = folder / spec["file"]
            t0 = time.perf_counter()
            cal_dir = write_images(
                workdir / name / "calibration",
                spec["images"](args.calibration, CALIBRATION_SEED, det_sizes),
            )
            eval_dir = write_images(
                workdir / name / "eval", spec["images"](args.eval, EVALUATION_SEED, det_sizes)
            )
            inputs = input_specs(path)
            calibration = load_samples(cal_dir, inputs, spec["preprocess"])
            evaluation = load_samples(eval_dir, inputs, spec["preprocess"])
            warnings = narrowness_warnings(calibration, inputs)
            log(
                f"{name}: {len(calibration)} + {len(evaluation)} PNG images written and "
                f"loaded in {time.perf_counter() - t0:.1f} s"
                + (f"; warnings: {'; '.join(warnings)}" if warnings else "")
            )
            for target in targets:
                result = run_one(
                    name, spec, path, target, calibration, evaluation, warnings, args, workdir, log
                )
                result["cli_preprocess"] = spec["cli"]
                report["results"].append(result)
                if not args.json:
                    print(format_result(result), flush=True)
    return benchlib.finish(report, t_all, args.json)


if __name__ == "__main__":
    sys.exit(main())
