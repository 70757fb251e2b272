#!/usr/bin/env python3
"""Full-integer TFLite against float on LiteRT, and Vela's Ethos-U estimate, for MediaPipe's
face detector (face_detection_short_range.tflite, 128x128) and palm detector
(palm_detection_lite.tflite, 192x192).

1. Quantize: each model is made full-integer by `edged.quantize.quantizer.quantize_model`
   (LiteRT's quantizer: int8 weights per channel, int8 activations), the way the tests do
   it: calibration images from the test data's images/detector-calibration, the held-out
   images/detector-eval for the gate, `Settings(targets=("litert", "litert:CPU"),
   require_int8=True, scores=ScoreMap(...))`, once with int8 inputs and outputs
   (`io="int8"`, what an NPU wants) and once with float ones (`io="float"`, int8 inside).
   `max_drop=0.99`, so a full-integer file is always written and no mixed-precision retry
   runs; the gate's figure per target is read from the report and judged here at the
   budgets 0.05 (the face's budget in the tests) and 0.01 (the default). Printed per model,
   IO and target: the detection-rule score (`edged.selection.accuracy`: score-weighted
   agreement of the detections at score >= 0.5, the lower of that and the box cosine at
   the anchors both detect, mean over the evaluation images), the raw cosine of the outputs
   (mean / worst image), the largest absolute difference, the verdicts, and the quantize
   wall time (calibration, both gates and quantize_model's own short benchmark).
2. Latency: per model, LiteRT target (`litert`: XNNPACK; `litert:CPU`: the built-in
   kernels) and thread count, four callables are timed interleaved by
   `edged.selection.bench.benchmark`, in rounds whose order rotates: the float model
   (precision fp32), the int8-IO model fed float through its own scales (`load_session`'s
   float IO: quantizing the input and dequantizing the outputs in numpy is part of the
   time), the same interpreter fed int8 tensors quantized beforehand (the interpreter
   alone), and the float-IO full-integer model. Every callable cycles through the same
   evaluation images. Figures are medians over rounds of p50 and p99; the ratio is float
   p50 / int8 p50 of the same round (above 1: int8 is faster), median and range over
   rounds. The XNNPACK sessions also show how many ops the delegate took and which op types
   it left to the built-in kernels.
3. Vela (ethos-u-vela, `backends.vela.compile_model`): the int8-IO model compiled for
   ethos-u65-256, ethos-u55-128 and ethos-u85-256, and the float-IO model for ethos-u65-256
   (its QUANTIZE/DEQUANTIZE at the edges stay on the CPU): NPU ops, CPU ops by name, and the
   estimate -- Vela's performance model of its default system configuration and memory mode,
   not a measurement.

Run from a checkout: `.venv/bin/python scripts/bench_tflite_int8.py [--models face,palm]
[--threads 1,2] [--rounds 3] [--runs 300] [--time-budget 4] [--json]` (about 2.5 minutes on
2 CPUs with the defaults).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from benchlib import log
from fetch_test_data import images_dir, models_dir

from backends.litert_backend import quiet_native_info
from edged.quantize.calibration import calibration_and_evaluation
from edged.quantize.calibration_spec import Preprocess
from edged.quantize.quantizer import input_specs, load_session, quantize_model
from edged.quantize.recipes import Settings
from edged.selection.accuracy import ScoreMap
from edged.selection.bench import LatencyStats, benchmark

# name -> file, input size, score output (what the tests and `edgectl quantize` are given)
MODELS: dict[str, dict[str, Any]] = {
    "face": {"file": "face_detection_short_range.tflite", "size": 128, "scores": "classificators"},
    "palm": {"file": "palm_detection_lite.tflite", "size": 192, "scores": "Identity_1"},
}
IMAGE_SETS = ("detector-calibration", "detector-eval")
GATE_TARGETS = ("litert", "litert:CPU")
TARGET_NAMES = {"litert": "XNNPACK", "litert:CPU": "built-in"}
IOS = ("int8", "float")
BUDGETS = (0.05, 0.01)  # the face's budget in the tests, and the default max drop
MAX_DROP = 0.99  # quantize_model then always writes the full-integer model
VELA_INT8 = ("ethos-u65-256", "ethos-u55-128", "ethos-u85-256")
VELA_FLOAT_IO = ("ethos-u65-256",)
ESTIMATE_LABEL = "estimate (Vela's performance model, not a measurement)"
# The timed callables of one (model, target, threads) group, in their first-round order.
VARIANTS = {
    "float": "float model",
    "int8io": "int8 IO, fed float",
    "int8raw": "int8 IO, int8 tensors",
    "floatio": "float IO (int8 inside)",
}


# -- 1. quantize ----------------------------------------------------------------------------


def quantize_one(
    name: str, model: Path, io: str, calibration, evaluation, warnings, out: Path
) -> dict[str, Any]:
    spec = MODELS[name]
    settings = Settings(
        targets=GATE_TARGETS,
        runs=20,
        time_budget_s=2.0,
        io=io,
        require_int8=True,
        scores=ScoreMap(spec["scores"]),
        max_drop=MAX_DROP,
    )
    t0 = time.perf_counter()
    report = quantize_model(model, out, calibration, evaluation, settings, warnings)
    wall = time.perf_counter() - t0
    data = report.to_dict()
    if not report.int8:
        raise SystemExit(
            f"bench_tflite_int8: {name} io={io}: no full-integer model: {report.reason}"
        )
    per_target = {}
    for attempt in data["attempts"]:
        acc = attempt["accuracy"]
        if acc is None:
            per_target[attempt["target"]] = {"error": attempt["error"]}
            continue
        per_target[attempt["target"]] = {
            "score": acc["score"],
            "cosine": acc["cosine"],
            "cosine_min": acc["cosine_min"],
            "max_abs": acc["max_abs"],
            "worst_sample": acc["worst_sample"],
            "passes": {str(b): acc["score"] >= 1.0 - b for b in BUDGETS},
        }
    log(
        f"{name} io={io}: {data['recipe']} in {wall:.1f} s, score "
        + ", ".join(f"{t} {v.get('score')}" for t, v in per_target.items())
    )
    return {
        "model": name,
        "io": io,
        "path": str(out),
        "recipe": data["recipe"],
        "wall_s": round(wall, 2),
        "rule": (data["accuracy"] or {}).get("rule"),
        "report_accuracy": data["accuracy"],  # the picked target's (report.accuracy)
        "report_target": data["target"],
        "per_target": per_target,
        "notes": data["notes"],
        "warnings": data["warnings"],
        "samples": data["samples"],
    }


# -- 2. latency -----------------------------------------------------------------------------


def undelegated(session) -> dict[str, Any]:
    """The XNNPACK partitions of a LiteRT session and the op types no partition took (they
    run on the built-in kernels between partitions). Reads the interpreter's op list: LiteRT
    lists the original nodes and appends one DELEGATE node per partition; a partition took
    the nodes on the paths from its outputs back to its inputs."""
    inner = getattr(session, "session", session)  # under backends.base.FloatIO
    ops = inner._interp._get_ops_details()
    partitions = [op for op in ops if op["op_name"] == "DELEGATE"]
    original = {op["index"]: op for op in ops if op["op_name"] != "DELEGATE"}
    producer = {int(t): i for i, op in original.items() for t in op["outputs"]}
    taken: set[int] = set()
    for node in partitions:
        stop = {int(t) for t in node["inputs"]}
        stack = [int(t) for t in node["outputs"]]
        while stack:
            tensor = stack.pop()
            if tensor in stop or tensor not in producer or producer[tensor] in taken:
                continue
            taken.add(producer[tensor])
            stack.extend(int(t) for t in original[producer[tensor]]["inputs"] if t >= 0)
    left = Counter(op["op_name"] for i, op in original.items() if i not in taken)
    return {
        "partitions": len(partitions),
        "delegated_ops": len(taken),
        "total_ops": len(original),
        "left_to_builtin": dict(left.most_common()),
    }


def quantized_feeds(session, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[dict]:
    """`feeds` as the int8-IO model's own input tensors (its input scale and zero point)."""
    inner = session.session
    dtypes = {s.name: np.dtype(s.dtype) for s in inner.inputs}
    out = []
    for feed in feeds:
        converted = {}
        for name, value in feed.items():
            scale, zero = inner.io_quantization[name]
            limits = np.iinfo(dtypes[name])
            q = np.clip(np.rint(value / scale) + zero, limits.min, limits.max)
            converted[name] = q.astype(dtypes[name])
        out.append(converted)
    return out


def cycling(run: Callable[[Mapping[str, np.ndarray]], Any], feeds: Sequence) -> Callable:
    """A no-argument callable running `run` on the next of `feeds` each call."""
    state = {"i": 0}

    def call():
        feed = feeds[state["i"] % len(feeds)]
        state["i"] += 1
        return run(feed)

    return call


def time_group(
    name: str, paths: dict[str, Path], target: str, threads: int, feeds, args
) -> dict[str, Any]:
    t0 = time.perf_counter()
    sessions = {
        "float": load_session(paths["float_model"], target, "fp32", threads, None),
        "int8io": load_session(paths["int8"], target, "model", threads, None),
        "floatio": load_session(paths["float"], target, "model", threads, None),
    }
    int8_feeds = quantized_feeds(sessions["int8io"], feeds)
    runners = {
        "float": cycling(sessions["float"].run, feeds),
        "int8io": cycling(sessions["int8io"].run, feeds),
        "int8raw": cycling(sessions["int8io"].session.run, int8_feeds),
        "floatio": cycling(sessions["floatio"].run, feeds),
    }
    coverage = {k: undelegated(s) for k, s in sessions.items()} if target == "litert" else {}
    keys = list(runners)
    per_round: list[dict[str, LatencyStats]] = []
    load_before = benchlib.loadavg()
    for r in range(args.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        per_round.append(
            benchmark(
                {k: runners[k] for k in order},
                args.runs,
                args.warmup,
                time_budget_s=args.time_budget,
            )
        )
    load_after = benchlib.loadavg()
    for session in sessions.values():
        session.close()
    rows: dict[str, Any] = {}
    for key in keys:
        rows[key] = {
            "p50_ms": round(benchlib.median([rs[key].p50_ms for rs in per_round]), 4),
            "p99_ms": round(benchlib.median([rs[key].p99_ms for rs in per_round]), 4),
            "runs": [rs[key].runs for rs in per_round],
        }
        if key != "float":
            ratios = [rs["float"].p50_ms / rs[key].p50_ms for rs in per_round]
            rows[key]["ratio_p50"] = round(benchlib.median(ratios), 3)
            rows[key]["ratio_p50_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    wall = time.perf_counter() - t0
    log(
        f"{name} {target} threads={threads}: float {rows['float']['p50_ms']:.3f} ms, int8 IO "
        f"{rows['int8io']['p50_ms']:.3f} ms (x{rows['int8io']['ratio_p50']:.2f}) in {wall:.1f} s"
    )
    return {
        "model": name,
        "target": target,
        "threads": threads,
        "loadavg_1min": [load_before, load_after],
        "wall_s": round(wall, 1),
        "variants": rows,
        "xnnpack": coverage,
        "per_round": [{k: v.to_dict() for k, v in rs.items()} for rs in per_round],
    }


# -- 3. Vela --------------------------------------------------------------------------------


def vela_one(name: str, io: str, model: Path, accelerator: str, workdir: Path) -> dict[str, Any]:
    from backends.vela import compile_model

    t0 = time.perf_counter()
    out = workdir / f"{name}-{io}-{accelerator}_vela.tflite"
    report = compile_model(model, accelerator, out).to_dict()
    est = report["estimate"]
    keep = ("inference_ms", "inferences_per_second", "clock_mhz", "sram_used_kib")
    keep += ("dram_used_kib", "macs", "cycles_npu", "weights_encoded_bytes")
    return {
        "model": name,
        "io": io,
        "accelerator": report["accelerator"],
        "vela_version": report["vela_version"],
        "system_config": report["system_config"],
        "memory_mode": report["memory_mode"],
        "config": report["config"],
        "defaults": report["defaults"],
        "npu_ops": report["npu_ops"],
        "npu_partitions": report["npu_partitions"],
        "cpu_ops": [f"{op['op']} {op['name']}" for op in report["cpu_ops"]],
        "estimate": {k: est.get(k) for k in keep},
        "kind": ESTIMATE_LABEL,
        "warnings": report["warnings"],
        "wall_s": round(time.perf_counter() - t0, 2),
    }


# -- the text report ------------------------------------------------------------------------


def format_quantize(rows: list[dict[str, Any]]) -> str:
    lines = [
        "accuracy against the float model on the built-in kernels "
        f"({rows[0]['samples']['calibration']} calibration / "
        f"{rows[0]['samples']['evaluation']} evaluation images); score: "
        f"{rows[0]['rule']}",
        f"  {'model':5} {'IO':6} {'target':9} {'score':>7} {'cosine':>7} {'min':>7} "
        f"{'max-abs':>8} " + " ".join(f"{f'gate {b}':>9}" for b in BUDGETS) + f" {'wall':>7}",
    ]
    for r in rows:
        for target, acc in r["per_target"].items():
            if "error" in acc:
                lines.append(
                    f"  {r['model']:5} {r['io']:6} {TARGET_NAMES[target]:9} {acc['error']}"
                )
                continue
            gates = " ".join(f"{'pass' if acc['passes'][str(b)] else 'FAIL':>9}" for b in BUDGETS)
            lines.append(
                f"  {r['model']:5} {r['io']:6} {TARGET_NAMES[target]:9} {acc['score']:7.4f} "
                f"{acc['cosine']:7.4f} {acc['cosine_min']:7.4f} {acc['max_abs']:8.1f} "
                f"{gates} {r['wall_s']:6.1f}s"
            )
    for r in rows:
        for note in r["notes"]:
            short = note if len(note) <= 120 else note[:117] + "..."
            lines.append(f"  note ({r['model']} io={r['io']}): {short}")
    return "\n".join(lines)


def format_latency(groups: list[dict[str, Any]], args) -> str:
    lines = [
        f"latency (ms; medians over {args.rounds} rounds of interleaved runs, up to "
        f"{args.runs} per callable per round within {args.time_budget:g} s per round, "
        f"{args.warmup} warm-up; x = float p50 / that p50, median (min-max) over rounds)",
        f"  {'model':5} {'target':9} {'thr':>3} {'runs':>7} {'float p50':>9} {'p99':>7} "
        + " ".join(f"{VARIANTS[k]:>31}" for k in ("int8io", "int8raw", "floatio")),
    ]
    for g in groups:
        v = g["variants"]
        counts = [n for row in v.values() for n in row["runs"]]
        runs = f"{min(counts)}-{max(counts)}" if min(counts) != max(counts) else str(counts[0])
        cells = []
        for key in ("int8io", "int8raw", "floatio"):
            lo, hi = v[key]["ratio_p50_range"]
            cells.append(
                f"{v[key]['p50_ms']:7.3f}/{v[key]['p99_ms']:7.3f} "
                f"x{v[key]['ratio_p50']:.2f} ({lo:.2f}-{hi:.2f})"
            )
        lines.append(
            f"  {g['model']:5} {TARGET_NAMES[g['target']]:9} {g['threads']:>3} "
            f"{runs:>7} {v['float']['p50_ms']:9.3f} {v['float']['p99_ms']:7.3f} "
            + " ".join(f"{c:>31}" for c in cells)
        )
    lines.append(
        "  (runs: timed runs per callable per round, min-max; int8 cells: p50/p99 x ratio; "
        "loadavg per group in --json)"
    )
    seen = set()
    for g in groups:
        if g["target"] != "litert" or g["model"] in seen:
            continue
        seen.add(g["model"])
        for key, cov in g["xnnpack"].items():
            left = ", ".join(f"{op} {n}" for op, n in cov["left_to_builtin"].items()) or "none"
            lines.append(
                f"  XNNPACK {g['model']} {VARIANTS.get(key, key)}: {cov['partitions']} "
                f"partition(s), {cov['delegated_ops']}/{cov['total_ops']} ops delegated; "
                f"left to the built-in kernels: {left}"
            )
    return "\n".join(lines)


def format_vela(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Vela {rows[0]['vela_version']}: {ESTIMATE_LABEL}",
        f"  {'model':5} {'IO':6} {'accelerator':14} {'system config':28} {'memory mode':22} "
        f"{'NPU':>4} {'CPU':>4} {'ms':>8} {'inf/s':>8} {'MHz':>5} {'SRAM KiB':>9} "
        f"{'DRAM KiB':>9}",
    ]
    for r in rows:
        e = r["estimate"]
        lines.append(
            f"  {r['model']:5} {r['io']:6} {r['accelerator']:14} {r['system_config']:28} "
            f"{r['memory_mode']:22} {r['npu_ops']:>4} {len(r['cpu_ops']):>4} "
            f"{e['inference_ms']:8.3f} {e['inferences_per_second']:8.1f} "
            f"{e['clock_mhz']:5.0f} {e['sram_used_kib']:9.1f} {e['dram_used_kib']:9.1f}"
        )
    for r in rows:
        if r["cpu_ops"]:
            lines.append(
                f"  CPU ops of {r['model']} io={r['io']} on {r['accelerator']}: "
                + ", ".join(r["cpu_ops"])
            )
    defaults = sorted({d for r in rows for d in r["defaults"]})
    if defaults:
        lines.append(f"  Vela's defaults used ({rows[0]['config']}): {', '.join(defaults)}")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="face,palm", help="comma list of face, palm")
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts")
    parser.add_argument("--rounds", type=int, default=3, help="benchmark rounds (medians)")
    parser.add_argument(
        "--runs", type=int, default=300, help="timed runs per callable per round, at most"
    )
    parser.add_argument("--warmup", type=int, default=5, help="warm-up runs per round")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=4.0,
        metavar="S",
        help="seconds per round of one (model, target, threads) group (default 4)",
    )
    parser.add_argument("--no-vela", action="store_true", help="skip the Vela compiles")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models {args.models}: use a comma list of {', '.join(MODELS)}")
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--threads {args.threads}: use a comma list of integers")
    if not threads or min(threads) < 1:
        parser.error("--threads: at least one count, each at least 1")
    if args.rounds < 1 or args.runs < 10 or args.warmup < 0 or args.time_budget <= 0:
        parser.error("--rounds >= 1, --runs >= 10, --warmup >= 0 and --time-budget > 0")

    quiet_native_info()  # LiteRT's "INFO: Created ... XNNPACK delegate" lines
    folder = models_dir([MODELS[m]["file"] for m in models])
    images = images_dir(IMAGE_SETS)
    report: dict[str, Any] = {
        **benchlib.report_header("tflite_int8", runtimes=True),
        "settings": {
            "rounds": args.rounds,
            "runs": args.runs,
            "warmup": args.warmup,
            "time_budget_s": args.time_budget,
            "threads": threads,
            "max_drop": MAX_DROP,
            "budgets": list(BUDGETS),
        },
        "loadavg_1min_start": benchlib.loadavg(),
        "quantize": [],
        "latency": [],
        "vela": [],
    }
    if not args.json:
        print(benchlib.machine_line(report["machine"]))
        print(
            "runtimes: "
            + ", ".join(f"{k} {v}" for k, v in report["machine"]["runtimes"].items())
            + f"; loadavg {report['loadavg_1min_start']}",
            flush=True,
        )
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edged-bench-tflite-int8-") as tmp:
        workdir = Path(tmp)
        paths: dict[str, dict[str, Path]] = {}
        feeds: dict[str, list] = {}
        for name in models:
            spec = MODELS[name]
            model = folder / spec["file"]
            pre = Preprocess(
                size=(spec["size"], spec["size"]), scale=1 / 255, mean=(0.5,), std=(0.5,)
            )
            calibration, evaluation, warnings = calibration_and_evaluation(
                images / IMAGE_SETS[0], images / IMAGE_SETS[1], input_specs(model), pre
            )
            feeds[name] = list(evaluation.feeds)
            paths[name] = {"float_model": model}
            for io in IOS:
                out = workdir / f"{name}_full_integer_{io}.tflite"
                report["quantize"].append(
                    quantize_one(name, model, io, calibration, evaluation, warnings, out)
                )
                paths[name][io] = out
        if not args.json:
            print(format_quantize(report["quantize"]), flush=True)
        for name in models:
            for target in GATE_TARGETS:
                for count in threads:
                    report["latency"].append(
                        time_group(name, paths[name], target, count, feeds[name], args)
                    )
        if not args.json:
            print(format_latency(report["latency"], args), flush=True)
        if not args.no_vela:
            for name in models:
                for io, accelerators in (("int8", VELA_INT8), ("float", VELA_FLOAT_IO)):
                    for accelerator in accelerators:
                        report["vela"].append(
                            vela_one(name, io, paths[name][io], accelerator, workdir)
                        )
            if not args.json:
                print(format_vela(report["vela"]), flush=True)
    return benchlib.finish(report, t_all, args.json)


if __name__ == "__main__":
    sys.exit(main())
