"""`edgectl bench`: the latency of a model on the selected backend, on one named candidate,
or on all of them, measured interleaved in one pinned thread."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

from edged.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Progress,
    UsageError,
    check_threads,
    default_state_dir,
    policy_of,
    quiet_runtime_logs,
    selection_options,
)

ORDER = 20  # place in `edgectl --help`


def register(sub) -> None:
    bench = sub.add_parser(
        "bench", parents=[selection_options()], help="latency of a model per candidate"
    )
    bench.add_argument("model", type=Path)
    bench.add_argument(
        "--backend",
        default="auto",
        help="auto (the selected one), all, or NAME[:DEVICE[:PRECISION]]",
    )
    bench.add_argument("--runs", type=int, default=200)
    bench.add_argument("--warmup", type=int, default=10)
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from backends import BackendError, LoadOptions, get_backend, probe_hardware
    from backends.model_info import inspect_model
    from edged.selection.bench import LatencyStats, benchmark, pinned_thread
    from edged.selection.candidates import backend_candidates
    from edged.selection.inputs import make_inputs, resolve_shapes
    from edged.selection.select import SelectionError, select

    check_threads(args)
    if args.runs < 1 or args.warmup < 0:
        raise UsageError("--runs must be at least 1 and --warmup at least 0")
    quiet_runtime_logs()
    model = inspect_model(args.model)
    hw = probe_hardware()
    policy = policy_of(args)
    state_dir = args.state_dir or default_state_dir()
    progress = Progress(not args.json)
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
            raise UsageError(
                f"--backend {args.backend}: nothing available to run {model.name} ({why})"
            )
    options = LoadOptions(threads=args.threads, cpus=policy.cpus, cache_root=state_dir)
    results: list[dict[str, Any]] = []
    sessions = {}
    with pinned_thread(policy.cpus):
        feeds = None
        for candidate in chosen:
            try:
                session = get_backend(candidate.backend).load(model, candidate, options)
                if feeds is None:
                    shapes = resolve_shapes(session.inputs, policy.shapes, model.name)
                    options = LoadOptions(
                        threads=args.threads,
                        cpus=policy.cpus,
                        shapes=shapes,
                        cache_root=options.cache_root,
                    )
                    feeds = make_inputs(session.inputs, shapes)
                    session.close()
                    session = get_backend(candidate.backend).load(model, candidate, options)
                session.run(feeds)
            except BackendError as exc:
                # Same keys as a measured result (stats null), so scripts need no special case.
                results.append(
                    {
                        "backend": candidate.backend,
                        "device": candidate.device,
                        "requested_precision": candidate.precision,
                        "precision": None,
                        **dict.fromkeys(f.name for f in dataclasses.fields(LatencyStats)),
                        "error": str(exc),
                    }
                )
                continue
            sessions[candidate] = session
        total = args.runs * len(sessions)
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            progress("bench", done[0], total)

        stats = benchmark(
            {c.key: functools.partial(s.run, feeds or {}) for c, s in sessions.items()},
            args.runs,
            args.warmup,
            progress=tick,
        )
        progress.close()
    for candidate, session in sessions.items():
        results.append(
            {
                "backend": candidate.backend,
                "device": candidate.device,
                "requested_precision": candidate.precision,
                "precision": session.info().get("precision"),
                **stats[candidate.key].to_dict(),
            }
        )
        session.close()
    report = {
        "model": str(args.model),
        "model_precision": model.precision,
        "threads": args.threads,
        "cpus": list(policy.cpus) if policy.cpus else None,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_bench(report))
    return EXIT_OK if any("error" not in r for r in results) else EXIT_FAILED


def format_bench(report: dict[str, Any]) -> str:
    cols = ["p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms", "stdev_ms"]
    head = (
        f"{'candidate':26} {'ran as':10} {'runs':>5} "
        + " ".join(f"{c.removesuffix('_ms'):>8}" for c in cols)
        + f" {'inf/s':>8}"
    )
    lines = [
        f"{report['model']} (model precision {report['model_precision']}); latency in ms",
        head,
    ]
    for r in report["results"]:
        name = f"{r['backend']}:{r['device']}:{r['requested_precision']}"
        if "error" in r:
            lines.append(f"{name:26} failed: {r['error']}")
            continue
        lines.append(
            f"{name:26} {r['precision'] or '-':10} {r['runs']:>5} "
            + " ".join(f"{r[c]:>8.3f}" for c in cols)
            + f" {r['throughput_ips']:>8.1f}"
        )
    return "\n".join(lines)
