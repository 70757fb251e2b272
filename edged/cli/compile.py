"""`edgectl compile`: a full-integer .tflite compiled for an Arm Ethos-U NPU by Vela
(`backends.vela`), with what stays on the CPU and why, and Vela's performance estimate.

Exit codes: 0 compiled, every operator on the NPU; 1 compiled, but some operators are left
on the CPU (each named, with Vela's reason), or Vela itself failed or timed out (its last
lines are shown, nothing is written); 2 bad input (usage, a float or an already
compiled model, an unknown accelerator or Vela configuration, Vela not installed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from edged.cli.common import EXIT_FAILED, EXIT_OK, Progress, UsageError, or_dash

ORDER = 105  # place in `edgectl --help`


def register(sub) -> None:
    c = sub.add_parser(
        "compile",
        help="full-integer .tflite -> Arm Ethos-U model (Vela), with the operators left "
        "on the CPU and Vela's estimate",
    )
    c.add_argument("model", type=Path, help="the full-integer (int8) .tflite model")
    c.add_argument(
        "--target",
        required=True,
        metavar="ACCEL",
        help="the Ethos-U configuration, e.g. ethos-u55-128, ethos-u65-256, ethos-u85-256",
    )
    c.add_argument(
        "--output",
        type=Path,
        default=None,
        help="where the Vela model goes (default: MODEL_vela.tflite beside the model)",
    )
    c.add_argument(
        "--system-config",
        default=None,
        metavar="NAME",
        help="the board's system configuration in the Vela config (default: Vela's for the target)",
    )
    c.add_argument(
        "--memory-mode",
        default=None,
        metavar="NAME",
        help="the memory mode in the Vela config (default: Vela's for the target)",
    )
    c.add_argument(
        "--vela-config",
        default=None,
        metavar="FILE",
        help="a Vela .ini with the board's configurations (default: Vela's Arm/vela.ini)",
    )
    c.add_argument("--json", action="store_true", help="machine-readable report")
    c.set_defaults(func=cmd_compile)


def cmd_compile(args) -> int:
    from backends.vela import VelaNotInstalled, compile_model

    output = args.output or args.model.with_name(f"{args.model.stem}_vela.tflite")
    if output.resolve() == args.model.resolve():
        raise UsageError(f"--output {output} is the input model; write elsewhere")
    if output.is_dir():
        raise UsageError(
            f"--output {output} is a folder; give the model file's path "
            f"(e.g. {output / (args.model.stem + '_vela.tflite')})"
        )
    if not output.parent.is_dir():
        raise UsageError(f"--output {output}: no folder {output.parent}")
    if not os.access(output.parent, os.W_OK):
        raise UsageError(f"--output {output}: cannot write in {output.parent}")
    progress = Progress(not args.json)
    progress(f"Vela: {args.model.name} for {args.target}", 0, 1)
    try:
        report = compile_model(
            args.model,
            args.target,
            output,
            system_config=args.system_config,
            memory_mode=args.memory_mode,
            config=args.vela_config,
        )
    except VelaNotInstalled as exc:
        raise UsageError(str(exc)) from None
    finally:
        progress.close()
    data = report.to_dict()
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return EXIT_OK if report.all_on_npu else EXIT_FAILED


def format_report(report: dict[str, Any]) -> str:
    est = report["estimate"]
    lines = [
        f"compiled {report['source'] or 'the model'} for {report['accelerator']} (Vela "
        f"{report['vela_version']}; system config {report['system_config']}, memory mode "
        f"{report['memory_mode']})"
    ]
    if {"system_config", "memory_mode"} & set(report["defaults"]):
        lines.append(
            "note: Vela's default configuration for this accelerator; give --system-config "
            "and --memory-mode (and --vela-config) for the board's own"
        )
    for warning in report["warnings"]:
        lines.append(f"warning: {warning}")
    cpu = report["cpu_ops"]
    lines.append(f"operators: {report['npu_ops']} on the NPU, {len(cpu)} on the CPU")
    for op in cpu:
        lines.append(f"  CPU: {op['op']} {op['name']!r}: {op['reason']}")
    lines.append(
        f"estimated {est['inference_ms']:.3f} ms per inference at {est['clock_mhz']:g} MHz "
        "(Vela's performance model, not a measurement)"
    )
    memory = [
        f"{label} {est[key]:.1f} KiB"
        for label, key, always in (
            ("SRAM", "sram_used_kib", True),
            ("DRAM", "dram_used_kib", True),
            ("on-chip flash", "on_chip_flash_used_kib", False),
            ("off-chip flash", "off_chip_flash_used_kib", False),
        )
        if est.get(key) is not None and (always or est[key])
    ]
    lines.append(f"memory: {', '.join(memory) or '-'}; MACs {or_dash(est.get('macs'), ',')}")
    lines.append(f"written: {report['output']}")
    return "\n".join(lines)
