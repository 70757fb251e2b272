"""`edgectl quantize`: the command line and the report around `edged.quantize.quantizer`.

An ONNX model becomes INT8 QDQ (targets onnxruntime, openvino); a float .tflite becomes
full-integer TFLite (targets litert, or an NPU: npu-vx, npu-neutron, edgetpu, and Arm's
Ethos-U configs such as ethos-u65-256, which are then compiled with Vela into
OUTPUT-stem_vela.tflite). For an NPU target the model's form is checked for its delegate.

Exit codes: 0 an INT8 model was written (and compiled, for an Ethos-U target; operators Vela
left on the CPU are named in the report); 1 no INT8 recipe passed the accuracy gate and beat
FP32 on the target (the FP32 model is written to --output instead, and the report says why;
for an NPU target, no recipe passed the gate), or for an Ethos-U target the full-integer
model was written but Vela did not compile it (the report's notes say why); 2 bad input
(usage, an unreadable model, calibration data that does not fit the model, an unknown
target).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from edged.cli.common import (
    Progress,
    UsageError,
    add_preprocess_arguments,
    check_output_name,
    check_threads,
    or_dash,
    parse_cpus,
    preprocess_of,
)
from edged.quantize.defaults import (
    DEFAULT_MAX_DROP,
    ETHOS_U_PREFIX,
    EVAL_SPLIT,
    IO_TYPES,
    METHODS,
)

ORDER = 100  # place in `edgectl --help`
EXIT_INT8, EXIT_FP32_KEPT = 0, 1


def register(sub) -> None:
    q = sub.add_parser(
        "quantize",
        help="FP32 ONNX -> INT8 QDQ, float TFLite -> full-integer: calibrated, "
        "accuracy-gated, the fastest recipe on the target measured",
    )
    q.add_argument("model", type=Path, help="the FP32 ONNX or float TFLite model")
    q.add_argument(
        "--calibration",
        type=Path,
        required=True,
        metavar="DATA",
        help="an .npz (arrays named after the inputs, first axis = samples), a "
        "folder of .npy files, or a folder of images",
    )
    q.add_argument("--output", type=Path, required=True, help="where the model goes")
    q.add_argument(
        "--eval",
        type=Path,
        default=None,
        metavar="DATA",
        help="evaluation data, kept apart from calibration (default: "
        f"{int(EVAL_SPLIT * 100)} %% of --calibration held out)",
    )
    q.add_argument(
        "--target",
        default="auto",
        metavar="TARGET",
        help="where the model will run (auto: try each CPU backend that runs the model's "
        "format, keep the fastest): one of those backends (ONNX: onnxruntime, openvino; "
        "TFLite: litert), an NPU whose delegate runs a full-integer .tflite (npu-vx, "
        f"npu-neutron, edgetpu), or an Ethos-U config ({ETHOS_U_PREFIX}55-128, "
        f"{ETHOS_U_PREFIX}65-256...: also compiled with Vela)",
    )
    q.add_argument(
        "--io",
        default=None,
        choices=IO_TYPES,
        help="a .tflite's input and output type (default: int8 for an NPU target, else "
        "float, so the model stands in for its float original)",
    )
    q.add_argument(
        "--scores",
        default=None,
        metavar="OUTPUT",
        help="a detector's score output (logits): the gate compares detections, not raw "
        "values, and a .tflite's score logits get a clipped range",
    )
    q.add_argument(
        "--max-drop",
        type=float,
        default=DEFAULT_MAX_DROP,
        metavar="X",
        help="largest accuracy drop allowed: 1 - cosine, or 1 - top-1 agreement "
        f"for classifiers (default {DEFAULT_MAX_DROP})",
    )
    q.add_argument(
        "--method",
        default="minmax",
        choices=METHODS,
        help="activation range calibration (default minmax)",
    )
    add_preprocess_arguments(q)
    q.add_argument("--threads", type=int, default=None, help="inference threads")
    q.add_argument("--cpus", default=None, help="CPU list to run on, e.g. 2-3")
    q.add_argument("--runs", type=int, default=200, help="timed runs per recipe (default 200)")
    q.add_argument(
        "--time-budget",
        type=float,
        default=20.0,
        metavar="S",
        help="seconds of benchmarking per target (default 20)",
    )
    q.add_argument("--json", action="store_true", help="machine-readable report")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args) -> int:
    from backends import ModelError
    from edged.quantize.calibration import calibration_and_evaluation
    from edged.quantize.calibration_spec import CalibrationError
    from edged.quantize.quantizer import input_specs, quantize_model
    from edged.quantize.recipes import QuantizeError, Settings

    if not 0.0 <= args.max_drop < 1.0:
        raise UsageError(f"--max-drop {args.max_drop}: must be at least 0 and below 1")
    if args.runs < 1 or args.time_budget <= 0:
        raise UsageError("--runs must be at least 1 and --time-budget above 0")
    check_threads(args)
    if args.output.resolve() == args.model.resolve():
        raise UsageError(f"--output {args.output} is the input model; write elsewhere")
    if args.output.is_dir():  # said now, not after minutes of quantizing
        raise UsageError(
            f"--output {args.output} is a folder; give the model file's path "
            f"(e.g. {args.output / (args.model.stem + '_int8' + args.model.suffix)})"
        )
    if args.output.parent.exists() and not os.access(args.output.parent, os.W_OK):
        raise UsageError(f"--output {args.output}: cannot write in {args.output.parent}")
    from backends.model_info import inspect_model

    fmt = inspect_model(args.model).format
    targets, npu = _targets(args.target, fmt)
    if args.io is not None and fmt != "tflite":
        raise UsageError(f"--io is for a .tflite model; {args.model} is {fmt}")
    io = (args.io or ("int8" if npu else "float")) if fmt == "tflite" else None
    check_output_name(args.model, args.scores, "--scores")
    if npu is not None and npu.startswith(ETHOS_U_PREFIX):  # said now, not after quantizing
        from backends.vela import VelaNotInstalled, accelerators

        try:
            known = accelerators()
        except VelaNotInstalled as exc:
            raise UsageError(str(exc)) from None
        if npu not in known:
            raise UsageError(f"--target {npu}: Vela compiles for {', '.join(known)}")
    try:
        calibration, evaluation, warnings = calibration_and_evaluation(
            args.calibration, args.eval, input_specs(args.model), preprocess_of(args)
        )
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    if not args.json:
        for warning in warnings:
            print(f"edgectl: warning: {warning}", file=sys.stderr)
    # onnxruntime.quantization warns through the root logger once per node and retry (e.g.
    # "Axis 1 is out-of-range for weight ..." for scalar weights it then quantizes
    # per-tensor); the report carries what matters, so only errors get through.
    logging.getLogger().setLevel(logging.ERROR)
    progress = Progress(not args.json)
    from edged.selection.accuracy import ScoreMap

    settings = Settings(
        targets=targets,
        method=args.method,
        max_drop=args.max_drop,
        threads=args.threads,
        cpus=parse_cpus(args.cpus),
        runs=args.runs,
        time_budget_s=args.time_budget,
        io=io,
        require_int8=npu is not None,
        scores=ScoreMap(args.scores) if args.scores else None,
    )
    try:
        report = quantize_model(
            args.model, args.output, calibration, evaluation, settings, warnings, progress
        )
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    except QuantizeError as exc:
        raise ModelError(str(exc)) from None
    finally:
        progress.close()
    if npu is not None and report.int8:
        _for_npu(report, npu, args.output, not args.json)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report.to_dict()))
    if npu is not None and npu.startswith(ETHOS_U_PREFIX) and report.int8 and not report.compiled:
        return EXIT_FP32_KEPT  # the full-integer model is written; Vela failed (notes say why)
    return EXIT_INT8 if report.int8 else EXIT_FP32_KEPT


def _targets(target: str, fmt: str) -> tuple[tuple[str, ...], str | None]:
    """The gate's targets for `--target` on a model of format `fmt` (the backends declare
    which: backends.quantize_targets), and the NPU target (or None for a CPU backend)."""
    from backends import npu_targets, quantize_targets

    gates = quantize_targets(fmt)
    npus = list(npu_targets()) if fmt == "tflite" else []
    if target == "auto":
        return gates, None
    if target in npus or (fmt == "tflite" and target.startswith(ETHOS_U_PREFIX)):
        return gates, target
    if target in gates:
        # A .tflite is gated on every LiteRT path (XNNPACK and the built-in kernels).
        return (gates if fmt == "tflite" else (target,)), None
    ethos = f" or an Ethos-U config such as {ETHOS_U_PREFIX}65-256" if fmt == "tflite" else ""
    raise UsageError(
        f"--target {target}: for {'a .tflite' if fmt == 'tflite' else 'an ONNX model'} use "
        f"auto, {', '.join([*gates, *npus])}{ethos}"
    )


def _for_npu(report, npu: str, output: Path, show_progress: bool) -> None:
    """The written full-integer model checked for its NPU's delegate; an Ethos-U target's
    compiled with Vela (`report.compiled`)."""
    from backends import npu_form_note

    if npu.startswith(ETHOS_U_PREFIX):
        from backends import BackendError, ModelError
        from backends.vela import compile_model

        vela_output = output.with_name(f"{output.stem}_vela{output.suffix or '.tflite'}")
        if show_progress:
            print(f"edgectl: compiling {output} for {npu} with Vela ...", file=sys.stderr)
        try:
            report.compiled = compile_model(output, npu, vela_output).to_dict()
        except (ModelError, BackendError) as exc:  # the INT8 model stays written; say why
            report.notes.append(f"Vela did not compile {output}: {exc}")
        return
    report.notes.append(npu_form_note(npu, output))


def format_report(report: dict[str, Any]) -> str:
    samples = report["samples"]
    lines = [
        f"samples: {samples['calibration']} calibration, {samples['evaluation']} "
        f"evaluation; ranges: {report['method']}; gate: drop <= {report['max_drop']}"
    ]
    for warning in report["warnings"]:
        lines.append(f"warning: {warning}")
    fp32 = ", ".join(f"{t} {ms:.3f} ms" for t, ms in report["fp32_ms"].items())
    lines.append(f"FP32 p50: {fp32 or '-'}")
    lines.append(
        f"{'target':<12} {'recipe':<24} {'score':>7} {'cosine':>8} {'min':>8} {'max-abs':>8} "
        f"{'top-1':>6} {'gate':>5} {'p50 ms':>8} {'speedup':>7}"
    )
    for a in report["attempts"]:
        acc = a["accuracy"] or {}
        gate = "pass" if a["passed"] else ("error" if a["error"] else "fail")
        lines.append(
            f"{a['target']:<12} {a['recipe']:<24} {or_dash(acc.get('score'), '.4f'):>7} "
            f"{or_dash(acc.get('cosine'), '.4f'):>8} "
            f"{or_dash(acc.get('cosine_min'), '.4f'):>8} "
            f"{or_dash(acc.get('max_abs'), '.3g'):>8} "
            f"{or_dash(acc.get('top1_agreement'), '.3f'):>6} {gate:>5} "
            f"{or_dash(a['p50_ms'], '.3f'):>8} {or_dash(a['speedup'], '.2f'):>7}"
        )
        if a["error"]:
            lines.append(f"  {a['error']}")
    if report["recipe"] == "fp32":
        lines.append(f"kept FP32: {report['reason']}")
    else:
        lines.append(
            f"picked: {report['recipe']} on {report['target']}, "
            f"{report['speedup']:.2f}x FP32, score {report['accuracy']['score']:.4f} "
            f"({report['accuracy']['rule']}), cosine {report['accuracy']['cosine']:.4f}"
            + (f", FP32 nodes: {', '.join(report['fp32_nodes'])}" if report["fp32_nodes"] else "")
        )
    for note in report.get("notes") or ():
        lines.append(f"note: {note}")
    lines.append(
        f"written: {report['output']}" + (f" (io {report['io']})" if report.get("io") else "")
    )
    compiled = report.get("compiled")
    if compiled:
        from edged.cli.compile import format_report as format_compiled

        lines.append(format_compiled(compiled))
    return "\n".join(lines)
