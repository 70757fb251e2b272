"""`edgectl backends`: the hardware facts, every candidate backend, and with --model the
measured pick among the model's family (the original, --variant files, and the INT8 variants
made from --calibration), with the evidence for it.

Offline (`--root IMG` of another machine, or `--dtb BOARD.dtb`), nothing is loaded or timed:
with --model it is a plan for that board: LiteRT's NPU delegates its device tree and image have,
whether the model is in the form each runs, and a compiler's estimate where there is one.
Exit codes: 0 done (offline: the board has no NPU, or one of its NPUs takes the model as it
is); 1 no backend ran the model correctly (offline: the board has an NPU and none takes
the model, each reason given); 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from edged.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Progress,
    UsageError,
    add_preprocess_arguments,
    check_output_name,
    check_threads,
    default_state_dir,
    or_dash,
    policy_of,
    preprocess_of,
    quiet_runtime_logs,
    selection_options,
)
from edged.selection.policy import DEFAULT_MAX_DROP

ORDER = 10  # place in `edgectl --help`


def register(sub) -> None:
    backends = sub.add_parser(
        "backends",
        parents=[selection_options()],
        help="hardware facts, candidates, and the pick for a model",
    )
    backends.add_argument("--model", type=Path, help="select the backend for this model")
    backends.add_argument(
        "--backend", default="auto", help="auto, or pin NAME[:DEVICE[:PRECISION]] (still verified)"
    )
    backends.add_argument(
        "--root",
        type=Path,
        default=None,
        help="probe the hardware of an image/fixture root instead of /",
    )
    backends.add_argument(
        "--dtb",
        type=Path,
        default=None,
        metavar="BOARD.dtb",
        help="the board's device tree (with --root IMG, or alone): plan offline for it",
    )
    backends.add_argument(
        "--refresh", action="store_true", help="measure again even if a cached decision exists"
    )
    backends.add_argument(
        "--runs",
        type=int,
        default=None,
        metavar="N",
        help="timed runs per candidate at most (default 1000, within a 6 s budget, at least "
        "10 of them; fewer than 10 is a quick look, its p99 is the slowest run)",
    )
    backends.add_argument(
        "--warmup", type=int, default=None, metavar="N", help="untimed runs first (default 5)"
    )
    backends.add_argument(
        "--variant",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a prebuilt version of --model (INT8 QDQ "
        "ONNX, full-integer TFLite; repeatable): "
        "selection picks among the original and them",
    )
    backends.add_argument(
        "--calibration",
        type=Path,
        default=None,
        metavar="DATA",
        help="make INT8 variants of --model here first (as edgectl "
        "quantize, for every CPU backend present; cached), then "
        "select among all; its held-out part is the evaluation set",
    )
    backends.add_argument(
        "--eval",
        type=Path,
        default=None,
        metavar="DATA",
        help="evaluation data kept apart from --calibration",
    )
    backends.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "int8"),
        help="int8: choose among the INT8 variants only",
    )
    backends.add_argument(
        "--max-drop",
        type=float,
        default=None,
        metavar="X",
        help="accuracy budget against the original: 1 - mean cosine, or "
        f"1 - top-1 agreement for classifiers (default {DEFAULT_MAX_DROP})",
    )
    backends.add_argument(
        "--min-cosine", type=float, default=None, help="older spelling of 1 - --max-drop"
    )
    backends.add_argument("--max-abs", type=float, default=None)
    backends.add_argument(
        "--scores",
        default=None,
        metavar="OUTPUT",
        help="a detector's score output (logits): variants are judged on detections",
    )

    add_preprocess_arguments(backends)
    backends.set_defaults(func=cmd_backends)


def cmd_backends(args) -> int:
    from backends import probe_hardware
    from edged.selection.candidates import all_candidates, runtime_versions
    from edged.selection.select import SelectionError, select
    from sysconf import SysRoot
    from sysconf.fdt import FdtError

    check_threads(args)
    quiet_runtime_logs()
    root = SysRoot.at(args.root)
    try:
        hw = probe_hardware(root, args.dtb)
    except FdtError as exc:
        raise UsageError(f"--dtb: {exc}") from None
    if args.model is not None and (args.dtb is not None or not root.is_live):
        return _offline_plan(args, hw)
    model_info = None
    selection = None
    error = None
    failed_evidence = []
    made = None
    variants = []
    if args.model is not None:
        from backends.model_info import inspect_model

        model_info = inspect_model(args.model)
        check_output_name(args.model, args.scores, "--scores")
        state_dir = args.state_dir or default_state_dir()
        runs, warmup = args.runs, args.warmup
        if (runs is not None and runs < 1) or (warmup is not None and warmup < 0):
            raise UsageError("--runs must be at least 1 and --warmup at least 0")
        timing = {k: v for k, v in (("runs", runs), ("warmup", warmup)) if v is not None}
        policy = policy_of(
            args,
            **timing,
            backend=args.backend,
            max_drop=_max_drop(args),
            max_abs=args.max_abs,
            precision=args.precision,
            scores=args.scores,
        )
        progress = Progress(not args.json)
        variants, evaluation = list(args.variant), None
        try:
            if args.calibration is not None:
                made, evaluation = _made_variants(args, hw, policy, state_dir, progress)
                variants += made.variants
            elif args.eval is not None:
                raise UsageError("--eval goes with --calibration")
            selection = select(
                args.model,
                hw,
                policy,
                state_dir,
                progress,
                variants=variants,
                evaluation=evaluation,
                refresh=args.refresh,
            )
        except SelectionError as exc:
            error = str(exc)
            failed_evidence = exc.evidence
        finally:
            progress.close()
    candidates = all_candidates(hw, model_info)
    report: dict[str, Any] = {
        "hardware": hw.to_dict(),
        "runtimes": runtime_versions(),
        "candidates": [
            {
                "backend": c.backend,
                "device": c.device,
                "precision": c.precision,
                "available": c.available,
                "reason": c.reason or None,
                "note": c.note,
            }
            for c in candidates
        ],
        "selected": selection.summary() if selection else None,
    }
    if made is not None:
        report["made_variants"] = made.to_dict()
    if model_info is not None:
        report["model"] = model_info.to_dict()
        report["variants"] = [str(v) for v in variants]
        report["evidence"] = [
            e.to_dict() for e in (selection.evidence if selection else failed_evidence)
        ]
        if error:
            report["error"] = error
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_backends(report, selection))
    if error:
        print(f"edgectl: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _offline_plan(args, hw) -> int:
    """What the board of --root/--dtb would run --model on, without loading anything."""
    from backends import backend_names, get_backend
    from backends.model_info import inspect_model
    from edged.selection.candidates import all_candidates

    model = inspect_model(args.model)
    if not hw.soc_compatible:
        raise UsageError(
            f"{args.root or args.dtb}: no device tree to plan for; give the board's --dtb BOARD.dtb"
        )
    candidates = all_candidates(hw, model)
    # The board's NPUs, as each backend that has any tells (`board_devices`, optional).
    npus = {
        (name, device)
        for name in backend_names()
        for device in getattr(get_backend(name), "board_devices", lambda hw: [])(hw)
    }
    rows = [
        {
            "backend": c.backend,
            "device": c.device,
            "runs_model": c.available,
            "reason": c.reason or None,
            "note": c.note,
            "estimate": c.options.get("estimate"),
        }
        for c in candidates
        if (c.backend, c.device) in npus
    ]
    takes = [r for r in rows if r["runs_model"]]
    report = {
        "hardware": hw.to_dict(),
        "model": model.to_dict(),
        "offline": True,
        "npu": rows,
        "verdict": (
            "the board has no NPU edged knows"
            if not rows
            else f"runs on {', '.join(str(r['device']) for r in takes)}"
            if takes
            else "the board has an NPU, but the model is not in a form it runs"
        ),
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_plan(report))
    return EXIT_OK if takes or not rows else EXIT_FAILED


def format_plan(report: dict[str, Any]) -> str:
    hw, model = report["hardware"], report["model"]
    soc = ", ".join(hw["soc_compatible"]) or "no device tree"
    lines = [
        f"Board         {hw['board_model'] or '?'} ({soc}; offline: nothing loaded or timed)",
        f"Model         {model['path']} ({model['format']}, {model['precision']}: "
        f"{model['precision_detail']})",
        "NPU",
    ]
    for row in report["npu"]:
        mark = "yes" if row["runs_model"] else "no "
        where = f"{row['backend']}:{row['device']}"
        lines.append(f"  {mark}  {where:21} {row['reason'] or row['note']}")
    if not report["npu"]:
        lines.append("  none: only the CPU backends (not judged offline)")
    lines.append(f"Verdict       {report['verdict']}")
    return "\n".join(lines)


def _made_variants(args, hw, policy, state_dir: Path, progress):
    """INT8 variants of --model made from --calibration (cached), and the evaluation set."""
    import logging

    from edged.quantize.calibration_spec import CalibrationError, CalibrationSpec
    from edged.quantize.variants import evaluation_of, load_data, make_variants, settings_for

    try:
        spec = CalibrationSpec(args.calibration, args.eval, preprocess_of(args))
        calibration, evaluation, warnings = load_data(args.model, spec, dict(policy.shapes or {}))
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    if not args.json:
        for warning in warnings:
            print(f"edgectl: warning: {warning}", file=sys.stderr)
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's per-node noise
    settings = settings_for(policy, hw, policy.cpus)
    made = make_variants(
        args.model, calibration, evaluation, state_dir, hw, settings, warnings, progress
    )
    return made, evaluation_of(evaluation, spec)


def _max_drop(args) -> float:
    if args.min_cosine is not None and args.max_drop is not None:
        raise UsageError("give --max-drop or --min-cosine (1 - max drop), not both")
    value = (
        1.0 - args.min_cosine
        if args.min_cosine is not None
        else args.max_drop
        if args.max_drop is not None
        else DEFAULT_MAX_DROP
    )
    if not 0.0 <= value < 1.0:
        raise UsageError(f"--max-drop {value:g}: must be at least 0 and below 1")
    return round(value, 12)


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def format_backends(report: dict[str, Any], selection) -> str:
    from sysconf.cpulist import format_cpulist

    hw = report["hardware"]
    lines = ["Hardware"]
    lines.append(
        f"  arch        {hw['arch']}, {hw['cpu_count']} CPUs online "
        f"({format_cpulist(hw['cpus_online'])})"
    )
    lines.append(f"  cpu         {hw['cpu_model']}")
    cores = ", ".join(
        f"{name} x{len(cpus)} ({format_cpulist(cpus)})" for name, cpus in hw["core_types"].items()
    )
    lines.append(f"  cores       {cores or '?'}")
    lines.append(f"  int8 isa    {' '.join(hw['isa_int8']) or 'none found'}")
    lines.append(f"  board       {hw['board_model'] or '?'}")
    if hw["soc_compatible"]:
        lines.append(f"  compatible  {', '.join(hw['soc_compatible'])}")
    lines.append(f"  memory      {_gib(hw['memory_bytes'])}")
    accs = hw["accelerators"]
    lines.append(
        "  accel       "
        + (
            "; ".join(
                f"{a['name']} ({a['node'] or 'no node'}, driver {a['driver'] or '?'})" for a in accs
            )
            if accs
            else "none found"
        )
    )
    lines.append(
        "Runtimes      "
        + ", ".join(f"{k} {v or 'not installed'}" for k, v in report["runtimes"].items())
    )
    lines.append("Candidates")
    for c in report["candidates"]:
        mark = "yes" if c["available"] else "no "
        key = f"{c['backend']}:{c['device']}:{c['precision']}"
        lines.append(f"  {mark}  {key:32} {c['reason'] or c['note']}")
    model = report.get("model")
    if model:
        flag = (
            ""
            if model["int8"] or report.get("variants")
            else "   <- FP32 alone: give INT8 variants (--variant) or --calibration data"
        )
        lines.append(
            f"Model         {model['path']} ({model['format']}, {model['precision']}: "
            f"{model['precision_detail']}){flag}"
        )
        if selection is not None:
            lines.append(format_evidence(selection))
        elif report.get("evidence"):
            lines.append("Evidence      (selection failed)")
            for ev in report["evidence"]:
                if ev["status"] != "unavailable":
                    key = f"{ev['backend']}:{ev['device']}:{ev['requested_precision']}"
                    lines.append(f"  {key:28} {ev['status']:10} {ev['reason']}")
    return "\n".join(lines)


def format_evidence(selection) -> str:
    shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in selection.shapes.items())
    original = selection.original or selection.model
    against = "the original" if selection.against_original else "its own float arithmetic"
    lines = [
        f"Evidence      (inputs {shapes}; {selection.evaluation or 'generated inputs'}; "
        f"accuracy against {against}"
        f"{'; cached decision' if selection.from_cache else ''})"
    ]
    lines.append(
        f"  {'variant':28} {'candidate':24} {'status':9} {'ran as':10} {'score':>7} "
        f"{'cosine':>7} {'p50 ms':>8} {'p99 ms':>8} {'vs FP32':>7} {'mem MiB':>7}"
    )
    for ev in selection.evidence:
        if ev.status == "unavailable":
            continue
        lat = ev.latency
        name = "original" if ev.variant in ("", str(original.path)) else Path(ev.variant).name
        speed = f"{ev.speedup_vs_original:.2f}x" if ev.speedup_vs_original else "-"
        mem = None if ev.rss_growth_bytes is None else max(0, ev.rss_growth_bytes) / 2**20
        lines.append(
            f"  {name[:28]:28} {ev.candidate.key:24} {ev.status:9} {ev.precision or '-':10} "
            f"{or_dash(ev.accuracy.score if ev.accuracy else None, '.4f'):>7} "
            f"{or_dash(ev.cosine, '.4f'):>7} "
            f"{or_dash(lat.p50_ms if lat else None, '.3f'):>8} "
            f"{or_dash(lat.p99_ms if lat else None, '.3f'):>8}"
            f" {speed:>7} {or_dash(mem, '.1f'):>7}"
        )
        if ev.reason and ev.status != "selected":
            lines.append(f"      {ev.reason}")
    for warning in selection.warnings:
        lines.append(f"  warning: {warning}")
    sel = selection.selected
    lines.append(
        f"Selected      {selection.model.name} on {sel.candidate.backend}:"
        f"{sel.candidate.device} (requested {sel.candidate.precision}, ran as "
        f"{sel.precision}), p99 {sel.latency.p99_ms:.3f} ms"
    )
    if selection.why:
        lines.append(f"Why           {selection.why}")
    return "\n".join(lines)
