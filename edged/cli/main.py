"""edgectl: inspect and measure what edged would do on this device.

Exit codes (documented in the README; scripts rely on them):
  0  success
  1  the work could not be done (no backend ran the model correctly, a runtime failed)
  2  bad input: usage, a missing/corrupt/unsupported model, a wrong shape or input name
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.base import BackendError, InputError, ModelError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer its reader left
DEFAULT_STATE_DIR = Path("/var/lib/edged")


class UsageError(ValueError):
    pass


def default_state_dir() -> Path:
    """/var/lib/edged when writable (the daemon's), else a per-user cache folder."""
    env = os.environ.get("EDGED_STATE_DIR")
    if env:
        return Path(env)
    if os.access(DEFAULT_STATE_DIR, os.W_OK) or (
        not DEFAULT_STATE_DIR.exists() and os.access(DEFAULT_STATE_DIR.parent, os.W_OK)
    ):
        return DEFAULT_STATE_DIR
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edged"


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    from sysconf.cpulist import parse_cpulist

    try:
        cpus = parse_cpulist(text)
    except ValueError as exc:
        raise UsageError(f"--cpus: {exc}") from None
    allowed = os.sched_getaffinity(0)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise UsageError(f"--cpus {text}: CPU {outside[0]} is not available to this process "
                         f"(allowed: {sorted(allowed)})")
    return tuple(cpus)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgectl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--state-dir", type=Path, default=None,
                        help="selection cache and OpenVINO model cache (default: "
                             "/var/lib/edged if writable, else ~/.cache/edged)")
    common.add_argument("--threads", type=int, default=None, help="inference threads")
    common.add_argument("--cpus", default=None, help="CPU list to run on, e.g. 2-3")
    common.add_argument("--shape", action="append", metavar="NAME=DIMS",
                        help="static input shape, e.g. x=1x3x640x640 (repeatable)")

    backends = sub.add_parser("backends", parents=[common],
                              help="hardware facts, candidates, and the pick for a model")
    backends.add_argument("--model", type=Path, help="select the backend for this model")
    backends.add_argument("--backend", default="auto",
                          help="auto, or pin NAME[:DEVICE[:PRECISION]] (still verified)")
    backends.add_argument("--root", type=Path, default=None,
                          help="probe the hardware of an image/fixture root instead of /")
    backends.add_argument("--refresh", action="store_true",
                          help="measure again even if a cached decision exists")
    backends.add_argument("--variant", action="append", type=Path, default=[],
                          metavar="FILE", help="a prebuilt version of --model (INT8 QDQ "
                                               "ONNX, full-integer TFLite; repeatable): "
                                               "selection picks among the original and them")
    backends.add_argument("--calibration", type=Path, default=None, metavar="DATA",
                          help="make INT8 variants of --model here first (as edgectl "
                               "quantize, for every CPU backend present; cached), then "
                               "select among all; its held-out part is the evaluation set")
    backends.add_argument("--eval", type=Path, default=None, metavar="DATA",
                          help="evaluation data kept apart from --calibration")
    backends.add_argument("--precision", default="auto", choices=("auto", "int8"),
                          help="int8: choose among the INT8 variants only")
    backends.add_argument("--max-drop", type=float, default=None, metavar="X",
                          help="accuracy budget against the original: 1 - mean cosine, or "
                               "1 - top-1 agreement for classifiers (default 0.01)")
    backends.add_argument("--min-cosine", type=float, default=None,
                          help="older spelling of 1 - --max-drop")
    backends.add_argument("--max-abs", type=float, default=None)

    from edged.cli.quantize import add_preprocess_arguments

    add_preprocess_arguments(backends)

    bench = sub.add_parser("bench", parents=[common], help="latency of a model per candidate")
    bench.add_argument("model", type=Path)
    bench.add_argument("--backend", default="auto",
                       help="auto (the selected one), all, or NAME[:DEVICE[:PRECISION]]")
    bench.add_argument("--runs", type=int, default=200)
    bench.add_argument("--warmup", type=int, default=10)

    status = sub.add_parser("status", help="ask the running daemon: models, backends, "
                                           "queues, latency, threads")
    status.add_argument("--address", default=None,
                        help="unix:/run/edged/edged.sock (default, then http://127.0.0.1:8000)"
                             " or HOST:PORT")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    tuning = argparse.ArgumentParser(add_help=False)
    tuning.add_argument("--root", type=Path, default=None,
                        help="an image or fixture root instead of the live system")
    tuning.add_argument("--json", action="store_true", help="machine-readable output")
    placement = argparse.ArgumentParser(add_help=False)
    placement.add_argument("--config", type=Path, default=None,
                           help="edged.toml: the models' cpus are the inference cores")
    placement.add_argument("--inference-cpus", default=None,
                           help="inference cores, e.g. 2-3: overrides the rest (else: the "
                                "kernel's isolated set, the config's model cpus, or the "
                                "last core)")
    placement.add_argument("--dtb", type=Path, default=None,
                           help="the board's device tree: its CPUs, for an image root that "
                                "has no /sys")
    placement.add_argument("--boot", action="store_true",
                           help="on the live system, also edit the boot command line "
                                "(with --root it always is)")
    placement.add_argument("--trim", action="store_true",
                           help="also mask the services and timers that steal cores (with "
                                "--root: the mask symlinks; live: as systemctl mask --now, "
                                "and revert unmasks and restarts what ran); the config's "
                                "[audit] trim/keep adjust the list")
    sub.add_parser("plan", parents=[tuning, placement],
                   help="list every isolation change: path, old, new, reason")
    sub.add_parser("apply", parents=[tuning, placement],
                   help="apply the plan through the journal (live: root only, else exit 1; "
                        "journal in /var/lib/edged-tune, with --root in DIR/var/lib/edged)")
    revert = sub.add_parser("revert", parents=[tuning],
                            help="restore what apply changed, exactly: the tuning and the "
                                 "persistent journal (live: root only, else exit 1)")
    revert.add_argument("--runtime", action="store_true",
                        help="revert only the runtime tuning (the tuning journal, as "
                             "edged-tune.service does at stop); keep what is meant to "
                             "survive reboots: the boot command line, service masks and "
                             "provisioned files")
    provision = sub.add_parser("provision", parents=[placement],
                               help="write the whole tuned configuration into an image root "
                                    "(plan --trim, sysctl.d, CPUAffinity, edged enabled)")
    provision.add_argument("--root", type=Path, default=None,
                           help="the image root (required: never the live system)")
    provision.add_argument("--json", action="store_true", help="machine-readable output")

    from edged.cli.audit import add_audit_parser
    from edged.cli.quantize import add_quantize_parser
    from edged.fleet.monitor import add_fleet_parser

    add_audit_parser(sub)
    add_fleet_parser(sub)
    add_quantize_parser(sub)

    reload = sub.add_parser("reload", help="make the running daemon re-read its config "
                                           "(like systemctl reload; Unix socket only)")
    reload.add_argument("--address", default="unix:/run/edged/edged.sock",
                        help="the daemon's Unix socket (unix:PATH)")
    return parser


def _version() -> str:
    from edged import __version__

    return f"edgectl {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _dispatch(build_parser().parse_args(argv))
        sys.stdout.flush()  # here, so that a closed pipe is seen inside the try
        return code
    except BrokenPipeError:
        # The reader went away (`edgectl status | head`): stop quietly, as other CLI tools
        # do. stdout is pointed at /dev/null so the interpreter's last flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _dispatch(args) -> int:
    try:
        if args.command == "status":
            return cmd_status(args)
        if args.command == "audit":
            from edged.cli.audit import cmd_audit

            return cmd_audit(args)
        if args.command == "fleet":
            from edged.fleet.monitor import cmd_fleet

            return cmd_fleet(args)
        if args.command == "quantize":
            from edged.cli.quantize import cmd_quantize

            return cmd_quantize(args)
        if args.command == "reload":
            return cmd_reload(args)
        if args.command in ("plan", "apply"):
            return cmd_plan_apply(args)
        if args.command == "revert":
            return cmd_revert(args)
        if args.command == "provision":
            return cmd_provision(args)
        if args.threads is not None and args.threads < 1:
            raise UsageError("--threads must be at least 1")
        if args.command == "backends":
            return cmd_backends(args)
        return cmd_bench(args)
    except (UsageError, InputError, ModelError) as exc:
        print(f"edgectl: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BackendError as exc:
        print(f"edgectl: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _policy(args, **extra):
    from edged.selection.inputs import parse_shape_args
    from edged.selection.select import Policy

    return Policy(threads=args.threads, cpus=parse_cpus(args.cpus),
                  shapes=parse_shape_args(args.shape) or None, **extra)


class _Progress:
    """A tqdm bar on stderr for long phases; silent when stderr is not a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None or self.bar.desc != phase:
            self.close()
            self.bar = tqdm(total=total, desc=phase, file=sys.stderr, leave=False)
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _quiet_runtime_logs() -> None:
    """stderr is for edgectl's one-line errors: drop LiteRT's native INFO lines (the module
    is plain Python; this imports no runtime)."""
    from backends.litert_backend import quiet_native_info

    quiet_native_info()


def cmd_backends(args) -> int:
    from edged.selection.select import SelectionError, all_candidates, runtime_versions, select
    from sysconf import SysRoot
    from sysconf.hardware import probe

    _quiet_runtime_logs()
    hw = probe(SysRoot.at(args.root))
    model_info = None
    selection = None
    error = None
    failed_evidence = []
    made = None
    variants = []
    if args.model is not None:
        from backends.model_info import inspect_model

        model_info = inspect_model(args.model)
        state_dir = args.state_dir or default_state_dir()
        policy = _policy(args, backend=args.backend, max_drop=_max_drop(args),
                         max_abs=args.max_abs, precision=args.precision)
        progress = _Progress(not args.json)
        variants, evaluation = list(args.variant), None
        try:
            if args.calibration is not None:
                made, evaluation = _made_variants(args, hw, policy, state_dir, progress)
                variants += made.variants
            elif args.eval is not None:
                raise UsageError("--eval goes with --calibration")
            selection = select(args.model, hw, policy, state_dir, progress,
                               variants=variants, evaluation=evaluation,
                               refresh=args.refresh)
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
            {"backend": c.backend, "device": c.device, "precision": c.precision,
             "available": c.available, "reason": c.reason or None, "note": c.note}
            for c in candidates
        ],
        "selected": selection.summary() if selection else None,
    }
    if made is not None:
        report["made_variants"] = made.to_dict()
    if model_info is not None:
        report["model"] = model_info.to_dict()
        report["variants"] = [str(v) for v in variants]
        report["evidence"] = [e.to_dict() for e in
                              (selection.evidence if selection else failed_evidence)]
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


def _made_variants(args, hw, policy, state_dir: Path, progress):
    """INT8 variants of --model made from --calibration (cached), and the evaluation set."""
    import logging

    from edged.cli.quantize import preprocess_of
    from edged.quantize.calibration import CalibrationError
    from edged.quantize.quantizer import Settings
    from edged.quantize.variants import (
        CalibrationSpec,
        evaluation_of,
        load_data,
        make_variants,
        present_targets,
    )

    try:
        spec = CalibrationSpec(args.calibration, args.eval, preprocess_of(args))
        calibration, evaluation, warnings = load_data(args.model, spec,
                                                      dict(policy.shapes or {}))
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    if not args.json:
        for warning in warnings:
            print(f"edgectl: warning: {warning}", file=sys.stderr)
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's per-node noise
    settings = Settings(targets=present_targets(hw), max_drop=policy.max_drop,
                        threads=policy.threads, cpus=policy.cpus)
    made = make_variants(args.model, calibration, evaluation, state_dir, hw, settings,
                         warnings, progress)
    return made, evaluation_of(evaluation, spec)


def _max_drop(args) -> float:
    from edged.selection.accuracy import DEFAULT_MAX_DROP

    if args.min_cosine is not None and args.max_drop is not None:
        raise UsageError("give --max-drop or --min-cosine (1 - max drop), not both")
    value = (1.0 - args.min_cosine if args.min_cosine is not None else
             args.max_drop if args.max_drop is not None else DEFAULT_MAX_DROP)
    if not 0.0 <= value < 1.0:
        raise UsageError(f"--max-drop {value:g}: must be at least 0 and below 1")
    return round(value, 12)


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def format_backends(report: dict[str, Any], selection) -> str:
    from sysconf.cpulist import format_cpulist

    hw = report["hardware"]
    lines = ["Hardware"]
    lines.append(f"  arch        {hw['arch']}, {hw['cpu_count']} CPUs online "
                 f"({format_cpulist(hw['cpus_online'])})")
    lines.append(f"  cpu         {hw['cpu_model']}")
    cores = ", ".join(f"{name} x{len(cpus)} ({format_cpulist(cpus)})"
                      for name, cpus in hw["core_types"].items())
    lines.append(f"  cores       {cores or '?'}")
    lines.append(f"  int8 isa    {' '.join(hw['isa_int8']) or 'none found'}")
    lines.append(f"  board       {hw['board_model'] or '?'}")
    if hw["soc_compatible"]:
        lines.append(f"  compatible  {', '.join(hw['soc_compatible'])}")
    lines.append(f"  memory      {_gib(hw['memory_bytes'])}")
    accs = hw["accelerators"]
    lines.append("  accel       " + ("; ".join(
        f"{a['name']} ({a['node'] or 'no node'}, driver {a['driver'] or '?'})" for a in accs)
        if accs else "none found"))
    lines.append("Runtimes      " + ", ".join(f"{k} {v or 'not installed'}"
                                             for k, v in report["runtimes"].items()))
    lines.append("Candidates")
    for c in report["candidates"]:
        mark = "yes" if c["available"] else "no "
        key = f"{c['backend']}:{c['device']}:{c['precision']}"
        lines.append(f"  {mark}  {key:32} {c['reason'] or c['note']}")
    model = report.get("model")
    if model:
        flag = "" if model["int8"] or report.get("variants") else \
            "   <- FP32 alone: give INT8 variants (--variant) or --calibration data"
        lines.append(f"Model         {model['path']} ({model['format']}, {model['precision']}: "
                     f"{model['precision_detail']}){flag}")
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
    lines = [f"Evidence      (inputs {shapes}; {selection.evaluation or 'generated inputs'}; "
             f"accuracy against {against}"
             f"{'; cached decision' if selection.from_cache else ''})"]
    lines.append(f"  {'variant':28} {'candidate':24} {'status':9} {'ran as':10} {'score':>7} "
                 f"{'cosine':>7} {'p50 ms':>8} {'p99 ms':>8} {'vs FP32':>7} {'mem MiB':>7}")
    for ev in selection.evidence:
        if ev.status == "unavailable":
            continue
        lat = ev.latency
        name = "original" if ev.variant in ("", str(original.path)) else Path(ev.variant).name
        speed = f"{ev.speedup_vs_original:.2f}x" if ev.speedup_vs_original else "-"
        mem = None if ev.rss_growth_bytes is None else max(0, ev.rss_growth_bytes) / 2**20
        lines.append(
            f"  {name[:28]:28} {ev.candidate.key:24} {ev.status:9} {ev.precision or '-':10} "
            f"{_num(ev.accuracy.score if ev.accuracy else None, 4):>7} "
            f"{_num(ev.cosine, 4):>7} "
            f"{_num(lat.p50_ms if lat else None, 3):>8} {_num(lat.p99_ms if lat else None, 3):>8}"
            f" {speed:>7} {_num(mem, 1):>7}"
        )
        if ev.reason and ev.status != "selected":
            lines.append(f"      {ev.reason}")
    for warning in selection.warnings:
        lines.append(f"  warning: {warning}")
    sel = selection.selected
    lines.append(f"Selected      {selection.model.name} on {sel.candidate.backend}:"
                 f"{sel.candidate.device} (requested {sel.candidate.precision}, ran as "
                 f"{sel.precision}), p99 {sel.latency.p99_ms:.3f} ms")
    if selection.why:
        lines.append(f"Why           {selection.why}")
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cmd_bench(args) -> int:
    from backends import LoadOptions, get_backend
    from backends.model_info import inspect_model
    from edged.selection.bench import benchmark, pinned_thread
    from edged.selection.inputs import make_inputs, resolve_shapes
    from edged.selection.select import SelectionError, backend_candidates, select
    from sysconf.hardware import probe

    if args.runs < 1 or args.warmup < 0:
        raise UsageError("--runs must be at least 1 and --warmup at least 0")
    _quiet_runtime_logs()
    model = inspect_model(args.model)
    hw = probe()
    policy = _policy(args)
    state_dir = args.state_dir or default_state_dir()
    progress = _Progress(not args.json)
    if args.backend == "auto":
        try:
            selection = select(args.model, hw, policy, state_dir, progress)
        except SelectionError as exc:
            print(f"edgectl: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        finally:
            progress.close()
        chosen = [selection.load_candidate(hw)]
    else:
        # A named backend lists (and so imports) only its own runtime.
        matching = backend_candidates(hw, model, args.backend)
        chosen = [c for c in matching if c.available]
        if not chosen:
            why = "; ".join(f"{c.key}: {c.reason}" for c in matching) or "no such backend"
            raise UsageError(f"--backend {args.backend}: nothing available to run "
                             f"{model.name} ({why})")
    options = LoadOptions(threads=args.threads, cpus=policy.cpus,
                          cache_dir=state_dir / "openvino-cache")
    results: list[dict[str, Any]] = []
    sessions = {}
    with pinned_thread(policy.cpus):
        feeds = None
        for candidate in chosen:
            try:
                session = get_backend(candidate.backend).load(model, candidate, options)
                if feeds is None:
                    shapes = resolve_shapes(session.inputs, policy.shapes, model.name)
                    options = LoadOptions(threads=args.threads, cpus=policy.cpus,
                                          shapes=shapes, cache_dir=options.cache_dir)
                    feeds = make_inputs(session.inputs, shapes)
                    session.close()
                    session = get_backend(candidate.backend).load(model, candidate, options)
                session.run(feeds)
            except BackendError as exc:
                # Same keys as a measured result (stats null), so scripts need no special case.
                results.append({"backend": candidate.backend, "device": candidate.device,
                                "requested_precision": candidate.precision,
                                "precision": None, **dict.fromkeys(_STAT_KEYS),
                                "error": str(exc)})
                continue
            sessions[candidate] = session
        total = args.runs * len(sessions)
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            progress("bench", done[0], total)

        stats = benchmark({c.key: (lambda s=s: s.run(feeds)) for c, s in sessions.items()},
                          args.runs, args.warmup, progress=tick)
        progress.close()
    for candidate, session in sessions.items():
        results.append({"backend": candidate.backend, "device": candidate.device,
                        "requested_precision": candidate.precision,
                        "precision": session.info().get("precision"),
                        **stats[candidate.key].to_dict()})
        session.close()
    report = {"model": str(args.model), "model_precision": model.precision,
              "threads": args.threads, "cpus": list(policy.cpus) if policy.cpus else None,
              "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_bench(report))
    return EXIT_OK if any("error" not in r for r in results) else EXIT_FAILED


_STAT_KEYS = ("runs", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms",
              "stdev_ms", "throughput_ips")


def format_bench(report: dict[str, Any]) -> str:
    cols = ["p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms", "stdev_ms"]
    head = f"{'candidate':26} {'ran as':10} {'runs':>5} " + " ".join(
        f"{c.removesuffix('_ms'):>8}" for c in cols) + f" {'inf/s':>8}"
    lines = [f"{report['model']} (model precision {report['model_precision']}); "
             f"latency in ms", head]
    for r in report["results"]:
        name = f"{r['backend']}:{r['device']}:{r['requested_precision']}"
        if "error" in r:
            lines.append(f"{name:26} failed: {r['error']}")
            continue
        lines.append(f"{name:26} {r['precision'] or '-':10} {r['runs']:>5} " + " ".join(
            f"{r[c]:>8.3f}" for c in cols) + f" {r['throughput_ips']:>8.1f}")
    return "\n".join(lines)


def check_address(text: str, unix_only: bool = False) -> str:
    """`unix:PATH`, `HOST:PORT` or `http://HOST:PORT` ([v6]:PORT too); anything else is a
    usage error (exit 2), not a connection attempt that fails with exit 1."""
    import re

    if text.startswith("unix:") and len(text) > 5:
        return text
    match = re.fullmatch(r"(?:http://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})/?", text)
    if not unix_only and match and 0 < int(match.group(2)) <= 65535:
        return text
    forms = "unix:PATH" if unix_only else "unix:PATH, HOST:PORT or http://HOST:PORT"
    raise UsageError(f"--address {text!r}: expected {forms}")


def cmd_status(args) -> int:
    from edged.client import Client, EdgedError

    if args.address:
        check_address(args.address)
    addresses = [args.address] if args.address else [
        "unix:/run/edged/edged.sock", "127.0.0.1:8000"]
    errors = []
    for address in addresses:
        try:
            with Client(address, timeout=10) as client:
                status = client.status()
                metrics = client.get_text("/metrics")
        except (OSError, EdgedError) as exc:
            errors.append(f"{address}: {exc}")
            continue
        status["address"] = address
        status["latency_ms"] = latency_from_metrics(metrics)
        print(json.dumps(status, indent=2) if args.json else format_status(status))
        return EXIT_OK
    print(f"edgectl: error: no edged answers ({'; '.join(errors)})", file=sys.stderr)
    return EXIT_FAILED


def _isolation_plan(args, placed=None):
    """The plan for `placed` (from `_placement`; computed here when None)."""
    from sysconf.isolation import plan

    root, cpus, keep, extra = placed or _placement(args)
    return root, plan(root, cpus, boot_on_live=args.boot, trim=getattr(args, "trim", False),
                      keep=keep, extra=extra, realtime=_uses_rt_priority(args))


def _uses_rt_priority(args) -> bool:
    """Whether a model of --config runs its worker SCHED_FIFO (`rt_priority`): only then does
    the plan turn RT throttling off (kernel.sched_rt_runtime_us=-1). `_placement` has already
    loaded and validated the config, so this second load cannot fail differently."""
    if getattr(args, "config", None) is None:
        return False
    from edged.config import load_config

    return any(mc.rt_priority for mc in load_config(args.config, online_cpus=None).models)


def _placement(args):
    """The root, its CPU plan and the [audit] keep/trim lists, from --root, --config and
    --inference-cpus. Precedence (sysconf.cpusets.decide): --inference-cpus (an explicit
    override), else the kernel's isolated set, else the config's model cpus, else the last
    core."""
    from sysconf import SysRoot
    from sysconf.cpusets import decide, read_cpusets

    root = SysRoot.at(args.root)
    configured = override = None
    config = None
    if args.config is not None:
        from edged.config import ConfigError, load_config

        try:
            config = load_config(args.config, online_cpus=None)  # checked against the root
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    if args.inference_cpus:
        override = parse_cpus_text(args.inference_cpus, "--inference-cpus")
    if config is not None:
        pinned = sorted({cpu for mc in config.models for cpu in (mc.cpus or ())})
        configured = pinned or None
    cpusets = read_cpusets(root)
    if not cpusets.online and getattr(args, "dtb", None) is not None:
        cpusets = replace(cpusets, online=dtb_cpus(args.dtb))
    if not cpusets.online:
        raise UsageError(f"{root.root}: no CPU information (no /sys/devices/system/cpu/online, "
                         f"as in an image root); give the board's --dtb")
    try:
        cpus = decide(cpusets, configured, override=override)
    except ValueError as exc:
        msg = str(exc)
        if "override" in msg:
            msg = "--inference-cpus: " + msg.replace("the override ", "").replace(
                "override inference CPUs", "inference CPUs").replace(" (override)", "")
        elif "configured" in msg and args.config is not None:
            msg = f"{args.config}: models.cpus: {msg}"
        raise UsageError(msg) from None
    keep, extra = (config.audit.keep, config.audit.trim) if config is not None else ((), ())
    return root, cpus, keep, extra


def dtb_cpus(path: Path) -> list[int]:
    """CPU numbers 0..n-1 for the board's /cpus/cpu@* nodes (what the kernel will bring up)."""
    from sysconf.cpusets import dt_cpu_count
    from sysconf.fdt import FdtError, load_fdt

    try:
        count = dt_cpu_count(load_fdt(path))
    except FdtError as exc:
        raise UsageError(str(exc)) from None
    if not count:
        raise UsageError(f"{path}: no /cpus/cpu@* nodes with device_type \"cpu\"")
    return list(range(count))


def parse_cpus_text(text: str, flag: str) -> list[int]:
    from sysconf.cpulist import parse_cpulist

    try:
        cpus = parse_cpulist(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if not cpus:
        raise UsageError(f"{flag}: empty CPU list")
    return cpus


def _journal(root):
    """Both journals (sysconf.changes.Journals: tuning and persistent) in one state dir."""
    from sysconf.changes import Journals

    # With --root the journals live inside that root (an image carries its own journals).
    return Journals(root, "/var/lib/edged" if not root.is_live else str(_live_state_dir()))


LIVE_TUNE_STATE_DIR = Path("/var/lib/edged-tune")


def _live_state_dir() -> Path:
    """The live journals' folder: root-only (StateDirectory=edged-tune in
    edged-tune.service), never the daemon's /var/lib/edged, which the unprivileged edged user
    owns: root's revert writes whatever the journal says, so the daemon must not be able to
    rewrite it. $EDGED_TUNE_STATE_DIR overrides it (not $EDGED_STATE_DIR, the daemon's)."""
    return Path(os.environ.get("EDGED_TUNE_STATE_DIR") or LIVE_TUNE_STATE_DIR)


def _refuse_live_without_root(root, what: str) -> bool:
    """apply/revert on the live system without root would be refused write by write (EPERM),
    which looks like success; say so up front instead (exit 1)."""
    if not root.is_live or os.geteuid() == 0:
        return False
    print(f"edgectl: error: {what} on the live system needs root (it writes /proc, /sys, "
          f"/etc and the journal in {_live_state_dir()}); nothing was changed. Run it as "
          f"root, or give --root DIR for an image", file=sys.stderr)
    return True


# A refusal for lack of permission, as sysconf.changes names it ("EACCES: ...").
_DENIED = ("EPERM:", "EACCES:", "EROFS:")


def cmd_plan_apply(args) -> int:
    """plan: print the changes. apply: refuse the live system without root (exit 1); retire a
    journal from an older boot (before planning, so the plan sees the restored files), apply
    through the journal, and exit 1 when every change was refused for lack of permission."""
    from sysconf import SysRoot

    applying = args.command == "apply"
    if applying and _refuse_live_without_root(SysRoot.at(args.root), "apply"):
        return EXIT_FAILED
    placed = _placement(args)  # bad input fails before anything is written
    root = placed[0]
    notes = list(placed[1].notes)
    stale: list[tuple[str, str]] = []
    journal = _journal(root)
    if applying:
        try:
            stale = journal.retire_stale()
        except ValueError as exc:  # untrusted or corrupt journal: name it, change nothing
            raise UsageError(str(exc)) from None
        if stale:
            notes.append(f"the journal was from an older boot: its file changes were reverted "
                         f"and its /proc and /sys values dropped ({len(stale)} records)")
    root, isolation = _isolation_plan(args, placed)
    report: dict[str, Any] = isolation.to_dict()
    code = EXIT_OK
    if applying:
        try:
            result = journal.apply(isolation.changes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        result.stale = stale + result.stale
        report.update(result.to_dict())
        report["journal"] = str(journal.path)
        report["persistent_journal"] = str(journal.persistent.path)
        if root.is_live and any(c.kind == "irqbalance" for c in result.applied):
            notes.append("irqbalance reads its defaults file only at start: edged-tune.service "
                         "restarts it; by hand: systemctl try-restart irqbalance")
        if result.skipped and not result.applied and all(
                any(name in why for name in _DENIED) for _, why in result.skipped):
            print("edgectl: error: every change was refused for lack of permission "
                  "(EPERM/EACCES/EROFS); nothing was applied", file=sys.stderr)
            code = EXIT_FAILED
    report["notes"] = notes
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_plan(report, applied=applying))
        for note in notes:
            print(f"note: {note}")
    return code


def format_plan(report: dict[str, Any], applied: bool) -> str:
    cpus = report["cpus"]
    lines = [f"inference CPUs {cpus['inference_list']}, housekeeping {cpus['housekeeping_list']}"
             f" (from {cpus['source']})"]
    if applied:
        lines.append(f"applied {len(report['applied'])}, already so {len(report['unchanged'])}, "
                     f"refused {len(report['skipped'])} (journal {report['journal']})")
        rows = [(c, "applied") for c in report["applied"]] + [
            (c, f"REFUSED: {c['why']}") for c in report["skipped"]]
    else:
        rows = [(c, "") for c in report["changes"]]
        if not rows:
            lines.append("nothing to change")
    for change, outcome in rows:
        old = (change["old"] or "(absent)").strip().replace("\n", " ")[:40]
        new = change["new"].strip().replace("\n", " ")[:40]
        lines.append(f"  {change['kind']:11} {change['path']}: {old!r} -> {new!r}"
                     f"{'  ' + outcome if outcome else ''}")
        lines.append(f"              {change['reason']}")
    for item in report["unmovable"]:
        lines.append(f"  cannot move IRQ {item['irq']} ({item['name']}): {item['why']}; "
                     f"remedy: {item['remedy']}")
    return "\n".join(lines)


def cmd_provision(args) -> int:
    """plan --trim plus the persistent configuration, applied through the root's journal."""
    from sysconf.provision import provision_plan

    if args.root is None:
        raise UsageError("provision needs --root DIR (an image root; it never writes the live "
                         "system: use edgectl apply there)")
    root, cpus, keep, extra = _placement(args)
    try:
        provisioned = provision_plan(root, cpus, keep, extra,
                                     realtime=_uses_rt_priority(args))
    except ValueError as exc:  # the root is the live system
        raise UsageError(str(exc)) from None
    journal = _journal(root)
    report: dict[str, Any] = provisioned.to_dict()
    try:
        applied = journal.apply(provisioned.changes)
    except ValueError as exc:  # untrusted or corrupt journal: name it, change nothing
        raise UsageError(str(exc)) from None
    report.update(applied.to_dict())
    report["journal"] = str(journal.path)
    report["persistent_journal"] = str(journal.persistent.path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_plan(report, applied=True))
    return EXIT_OK


def cmd_revert(args) -> int:
    """Both journals, or with --runtime only the tuning journal (edged-tune.service's stop:
    the boot command line and masks must survive the reboot that follows)."""
    from sysconf import SysRoot

    root = SysRoot.at(args.root)
    if _refuse_live_without_root(root, "revert"):
        return EXIT_FAILED
    journal = _journal(root)
    runtime_only = getattr(args, "runtime", False)
    try:
        restored = journal.revert(runtime_only=runtime_only)
        kept = runtime_only and journal.persistent.pending()
    except ValueError as exc:  # corrupt or untrusted journal: say where, change nothing
        raise UsageError(str(exc)) from None
    failed = [(path, what) for path, what in restored if what.startswith("failed")]
    if args.json:
        print(json.dumps({"reverted": [{"path": p, "action": a} for p, a in restored],
                          "kept_persistent": bool(kept)}, indent=2))
    else:
        if not restored:
            print("nothing to revert")
        for path, action in restored:
            print(f"  {action:9} {path}")
        if kept:
            print(f"note: kept the persistent changes (boot command line, masks) in "
                  f"{journal.persistent.path}; `edgectl revert` without --runtime restores "
                  f"them")
    return EXIT_FAILED if failed else EXIT_OK


def cmd_reload(args) -> int:
    from edged.client import Client, EdgedError

    check_address(args.address, unix_only=True)
    try:
        with Client(args.address, timeout=10) as client:
            client.reload()
    except (OSError, EdgedError) as exc:
        print(f"edgectl: error: {args.address}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"edgectl: reload started ({args.address}); `edgectl status` shows the outcome")
    return EXIT_OK


def latency_from_metrics(text: str) -> dict[str, dict[str, float]]:
    """p50/p99 of total request time per model, estimated from the Prometheus histogram
    buckets (upper bound of the bucket the quantile falls in)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "edged_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("phase") == "total":
                buckets.setdefault(sample.labels["model"], []).append(
                    (float(sample.labels["le"]), sample.value))
    result = {}
    for model, rows in buckets.items():
        rows.sort()
        total = rows[-1][1] if rows else 0
        if not total:
            continue
        result[model] = {"requests": total}
        for q in (0.5, 0.99):
            bound = next(le for le, count in rows if count >= q * total)
            result[model][f"p{int(q * 100)}_ms_le"] = bound * 1000  # s -> ms for people
    return result


def format_status(status: dict[str, Any]) -> str:
    lines = [f"edged {status['version']} (pid {status['pid']}) at {status['address']}, up "
             f"{status['uptime_s']} s, config {status['config']}, reloads {status['reloads']}"]
    if status.get("last_reload_error"):
        lines.append(f"  last reload: {status['last_reload_error']}")
    if status.get("restart_needed"):
        lines.append(f"  changed by a reload, takes a restart: "
                     f"{', '.join(status['restart_needed'])}")
    lines.append(f"  {'model':14} {'backend':24} {'ran as':10} {'ready':6} {'queue':>5} "
                 f"{'requests':>8} {'p50 ms<=':>9} {'p99 ms<=':>9} failovers")
    for m in status["models"]:
        lat = status["latency_ms"].get(m["name"], {})
        backend = f"{m['backend']}:{m['device']}"
        lines.append(
            f"  {m['name']:14} {backend:24} {m['precision'] or '-':10} "
            f"{'yes' if m['ready'] else 'NO':6} {m['queue_depth']:>5} "
            f"{int(lat.get('requests', 0)):>8} {_num(lat.get('p50_ms_le'), 3):>9} "
            f"{_num(lat.get('p99_ms_le'), 3):>9} {m['failovers']}")
    for m in status["models"]:  # which file of the family is served, why, and the job
        if m.get("variants"):
            lines.append(f"  {m['name']:14} serves {Path(m['path']).name} (original "
                         f"{Path(m['original']).name}, {len(m['variants'])} variant(s))")
        if m.get("why"):
            lines.append(f"  {'':14} why: {m['why']}")
        job = m.get("variants_job")
        if job:
            peak = job.get("peak_rss_bytes")
            lines.append(f"  {'':14} variants job: {job['state']}"
                         + (f" {job['progress']}" if job["state"] == "running"
                            and job.get("progress") else "")
                         + (f", {job['duration_s']} s" if job.get("duration_s") else "")
                         + (f", peak {peak / 2**20:.0f} MiB" if peak else "")
                         + (f": {job['error']}" if job.get("error") else "")
                         + (f": {job['result']}" if job.get("result") else ""))
    for name, reason in status.get("failed", {}).items():
        lines.append(f"  {name:14} NOT LOADED: {reason}")
    if status.get("housekeeping_cpus"):
        lines.append(f"  housekeeping CPUs {status['housekeeping_cpus']}; memory locked: "
                     f"{status.get('memory_locked')}")
    lines.append("  threads: " + ", ".join(
        f"{t['name']}[{t['tid']}]={t['cpus']}"
        + (f" {t['policy']}" if t.get("policy", "other") != "other" else "")
        for t in status.get("threads", [])))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
