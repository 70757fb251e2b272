#!/usr/bin/env python3
"""Is the (variant, backend) `edged.selection.select.select` picks within 10 % of the best p99 here,
and how accurate is it against the FP32 original?

Per model family (the FP32 original and its INT8 variant from the test data; the face
TFLite alone): `select` runs `--rounds` times, each in a fresh temporary state dir (default
Policy with shapes), to show how stable the pick is; right after each, a second `select` on
the same state dir shows the cache hit (its wall time, and that it ran no benchmark). Then,
in the same process, every (variant, candidate) `select` tried -- the ones it rejected for
accuracy too, as `edgectl bench --backend all` would time them -- is loaded as `select`
loads it and timed with many more runs (`--runs`, interleaved in one
`edged.selection.bench.benchmark` call per confirmation round). The pick's p99 is compared with the
best p99 of all of them (and with the best that passed the accuracy gate) in the same round; the
median of the per-round ratios is reported, with the rejection reason beside each rejected one, and
the pick's accuracy score against the original. The detector runs at every `--det-size`.

Run from a checkout: `.venv/bin/python scripts/bench_selection.py [--json]`.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
from benchlib import log
from fetch_test_data import models_dir

import edged.selection.select as selection_mod
from backends import LoadOptions, get_backend, probe_hardware
from backends.errors import BackendError, ModelError
from backends.model_info import inspect_model
from edged.selection.bench import benchmark, pinned_thread
from edged.selection.candidates import all_candidates
from edged.selection.inputs import make_inputs
from edged.selection.policy import Policy
from edged.selection.select import SelectionError
from sysconf.hardware import HardwareFacts

WITHIN = 0.10  # the pick should be within 10 % of the best p99


def model_table(det_sizes: list[int]) -> dict[str, tuple[str, list[str], dict | None]]:
    """name -> (original in the test-data models folder, its variants, Policy shapes)."""
    table: dict[str, tuple[str, list[str], dict | None]] = {}
    for size in det_sizes:
        table[f"det{size}"] = (
            "ppocrv4_det.onnx",
            ["ppocrv4_det_int8.onnx"],
            {"x": (1, 3, size, size)},
        )
    table["cls"] = ("ppocr_cls.onnx", ["ppocr_cls_int8.onnx"], {"x": (1, 3, 48, 192)})
    table["face_tflite"] = ("face_detection_short_range.tflite", [], None)  # 1x128x128x3
    return table


def label(selection, ev) -> str:
    """variant:candidate, the variant as "fp32" (the original) or its file name."""
    original = selection.original or selection.model
    name = "fp32" if ev.variant in ("", str(original.path)) else Path(ev.variant).stem
    return f"{name}|{ev.candidate.key}"


class BenchmarkCounter:
    """Counts the benchmark calls `select` makes (wraps edged.selection.select.benchmark), so the
    cache hit is shown to skip measuring, not just assumed from its speed."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = selection_mod.benchmark

    def __enter__(self) -> BenchmarkCounter:
        def counted(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        selection_mod.benchmark = counted
        return self

    def __exit__(self, *exc) -> None:
        selection_mod.benchmark = self._original


def select_rounds(
    path: Path, variants: list[Path], hw: HardwareFacts, policy: Policy, rounds: int, log
) -> tuple[list[dict[str, Any]], list[Any]]:
    results, selections = [], []
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="edged-bench-sel-") as tmp:
            state = Path(tmp)
            with BenchmarkCounter() as first_count:
                t0 = time.perf_counter()
                first = selection_mod.select(path, hw, policy, state, variants=variants)
                first_s = time.perf_counter() - t0
            with BenchmarkCounter() as second_count:
                t0 = time.perf_counter()
                second = selection_mod.select(path, hw, policy, state, variants=variants)
                second_s = time.perf_counter() - t0
        sel = first.selected
        results.append(
            {
                "round": r + 1,
                "selected": label(first, sel),
                "ran_as": sel.precision,
                "accuracy": sel.accuracy.to_dict() if sel.accuracy else None,
                "why": first.why,
                "selection_p50_ms": sel.latency.p50_ms,
                "selection_p99_ms": sel.latency.p99_ms,
                "selection_runs": sel.latency.runs,
                "evidence": {
                    label(first, e): {
                        "status": e.status,
                        "cosine": e.cosine,
                        "score": e.accuracy.score if e.accuracy else None,
                        "reason": e.reason,
                        "p99_ms": e.latency.p99_ms if e.latency else None,
                    }
                    for e in first.evidence
                    if e.status != "unavailable"
                },
                "first_select_s": round(first_s, 4),
                "first_benchmark_calls": first_count.calls,
                "second_select_s": round(second_s, 4),
                "second_from_cache": second.from_cache,
                "second_benchmark_calls": second_count.calls,
                "second_same_pick": label(second, second.selected) == label(first, sel),
            }
        )
        selections.append(first)
        log(
            f"{path.name}: round {r + 1}: picked {label(first, sel)} in {first_s:.1f} s; "
            f"cached select {second_s * 1000:.0f} ms"
        )
    return results, selections


def confirm(
    selection,
    hw: HardwareFacts,
    policy: Policy,
    runs: int,
    warmup: int,
    rounds: int,
    passed: list[str],
    log,
) -> list[dict[str, Any]]:
    """Every (variant, candidate) in `passed` (all `select` tried), loaded as `select` loads
    it, timed interleaved."""
    wanted = {label(selection, e): e for e in selection.evidence}
    per_round = []
    with (
        tempfile.TemporaryDirectory(prefix="edged-bench-confirm-") as tmp,
        pinned_thread(policy.cpus),
    ):
        options = LoadOptions(
            threads=policy.threads,
            cpus=policy.cpus,
            shapes=selection.shapes,
            cache_root=Path(tmp),
        )
        sessions = {}
        for key in passed:
            ev = wanted.get(key)
            if ev is None:
                continue
            model = selection.model_of(ev)
            by_key = {c.key: c for c in all_candidates(hw, model)}
            try:
                sessions[key] = get_backend(ev.candidate.backend).load(
                    model, by_key[ev.candidate.key], options
                )
            except (BackendError, ModelError, KeyError) as exc:
                log(f"{model.name}: {key} did not load for confirmation: {exc}")
        if not sessions:
            return []
        feeds = make_inputs(next(iter(sessions.values())).inputs, selection.shapes)
        keys = list(sessions)
        for r in range(rounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            t0 = time.perf_counter()
            stats = benchmark(
                {k: (lambda s=sessions[k]: s.run(feeds)) for k in order}, runs, warmup
            )
            per_round.append({k: stats[k] for k in keys})
            log(
                f"{selection.model.name}: confirmation round {r + 1}/{rounds} "
                f"({len(keys)} candidates x {runs} runs) in {time.perf_counter() - t0:.1f} s"
            )
        for s in sessions.values():
            s.close()
    return per_round


def run_model(
    name: str, path: Path, variants: list[Path], shapes, hw: HardwareFacts, args, log
) -> dict[str, Any]:
    policy = Policy(shapes=shapes)
    rounds, selections = select_rounds(path, variants, hw, policy, args.rounds, log)
    picks = collections.Counter(r["selected"] for r in rounds)
    passed = [k for k, e in rounds[0]["evidence"].items() if e["status"] in ("passed", "selected")]
    for r in rounds[1:]:  # a candidate that passed in any round
        passed += [
            k
            for k, e in r["evidence"].items()
            if e["status"] in ("passed", "selected") and k not in passed
        ]
    # Why each other tried candidate did not pass (first round that says so).
    why_not: dict[str, str] = {}
    for r in rounds:
        for k, e in r["evidence"].items():
            if e["status"] in ("rejected", "failed") and k not in passed:
                why_not.setdefault(k, f"{e['status']}: {e['reason']}")
    tried = passed + list(why_not)
    block: dict[str, Any] = {
        "model": name,
        "path": str(path),
        "variants": [str(v) for v in variants],
        "precision": selections[0].model.precision,
        "pick_accuracy": [r["accuracy"] for r in rounds],
        "why": rounds[0]["why"],
        "shapes": {k: list(v) for k, v in selections[0].shapes.items()},
        "policy": {
            "runs": policy.runs,
            "warmup": policy.warmup,
            "time_budget_s": policy.time_budget_s,
            "max_drop": policy.max_drop,
        },
        "rounds": rounds,
        "picks": dict(picks),
        "passed": passed,
        "rejected": sorted(
            {
                k
                for r in rounds
                for k, e in r["evidence"].items()
                if e["status"] in ("rejected", "failed")
            }
        ),
        "first_select_s_median": round(benchlib.median([r["first_select_s"] for r in rounds]), 3),
        "second_select_s_median": round(benchlib.median([r["second_select_s"] for r in rounds]), 4),
        "cache_hits": sum(
            r["second_from_cache"] and r["second_benchmark_calls"] == 0 and r["second_same_pick"]
            for r in rounds
        ),
    }
    block["cache_speedup"] = round(
        block["first_select_s_median"] / max(block["second_select_s_median"], 1e-9), 1
    )
    per_round = confirm(
        selections[0], hw, policy, args.runs, args.warmup, args.confirm_rounds, tried, log
    )
    if not per_round:
        block["confirmation"] = None
        block["within_10pct"] = False
        block["verdict"] = "no candidate loaded for the confirmation benchmark"
        return block
    table = {}
    timed_passed = [k for k in passed if k in per_round[0]]
    for key in tried:
        if key not in per_round[0]:
            continue
        table[key] = {
            "status": "passed" if key in passed else "rejected",
            "why_not": why_not.get(key),
            "p50_ms": round(benchlib.median([rs[key].p50_ms for rs in per_round]), 3),
            "p99_ms": round(benchlib.median([rs[key].p99_ms for rs in per_round]), 3),
            # against the best of everything timed, as `bench --backend all` shows it
            "p99_over_best": round(
                benchlib.median(
                    [rs[key].p99_ms / min(v.p99_ms for v in rs.values()) for rs in per_round]
                ),
                3,
            ),
            # against the best candidate that gives the right answers
            "p99_over_best_passed": round(
                benchlib.median(
                    [rs[key].p99_ms / min(rs[k].p99_ms for k in timed_passed) for rs in per_round]
                ),
                3,
            )
            if timed_passed
            else None,
            "picked_in_rounds": picks.get(key, 0),
        }
    block["not_timed"] = {k: why_not.get(k, "did not load") for k in tried if k not in table}
    best = min(table, key=lambda k: table[k]["p99_over_best"])
    # Each round's pick against the best of the confirmation; the headline is the worst.
    ratios = [table[r["selected"]]["p99_over_best"] for r in rounds if r["selected"] in table]
    ratios_passed = [
        table[r["selected"]]["p99_over_best_passed"] for r in rounds if r["selected"] in table
    ]
    worst = max(ratios) if ratios else float("inf")
    worst_passed = max(ratios_passed) if ratios_passed else float("inf")
    block["confirmation"] = {
        "runs": args.runs,
        "rounds": args.confirm_rounds,
        "warmup": args.warmup,
        "candidates": table,
        "best": best,
        "per_round": [{k: v.to_dict() for k, v in rs.items()} for rs in per_round],
    }
    block["selected_over_best_p99"] = [round(x, 3) for x in ratios]
    block["selected_over_best_passed_p99"] = [round(x, 3) for x in ratios_passed]
    # Against everything `bench --backend all` times, and against the best that gives the
    # right answers (the pick can only be one of those).
    block["within_10pct_of_all"] = worst <= 1 + WITHIN
    block["within_10pct"] = worst_passed <= 1 + WITHIN
    faster_rejected = [
        k for k in table if table[k]["status"] == "rejected" and table[k]["p99_over_best"] < worst
    ]
    block["verdict"] = (
        f"pick(s) {', '.join(f'{k} x{n}' for k, n in picks.items())}; "
        f"selected/best p99 of all {', '.join(f'{x:.2f}' for x in ratios)} (best {best}: "
        f"{'within' if block['within_10pct_of_all'] else 'NOT within'} 10 %); "
        f"selected/best passing p99 {', '.join(f'{x:.2f}' for x in ratios_passed)} -> "
        f"{'within' if block['within_10pct'] else 'NOT within'} 10 %"
        + (f"; faster but rejected: {', '.join(faster_rejected)}" if faster_rejected else "")
    )
    return block


def format_block(b: dict[str, Any]) -> str:
    shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in b["shapes"].items())
    family = ", ".join(Path(v).name for v in [b["path"], *b["variants"]])
    lines = [f"{b['model']} ({family}; {shapes})"]
    for r in b["rounds"]:
        acc = r["accuracy"] or {}
        lines.append(
            f"  select round {r['round']}: {r['selected']} (ran as {r['ran_as']}; "
            f"{acc.get('rule')} {acc.get('score', float('nan')):.4f} against the "
            f"original), "
            f"its p99 {r['selection_p99_ms']:.3f} ms over {r['selection_runs']} runs; "
            f"{r['first_select_s']:.2f} s, cached {r['second_select_s'] * 1000:.1f} ms "
            f"(from_cache={r['second_from_cache']}, "
            f"benchmark calls {r['second_benchmark_calls']})"
        )
    if b["rejected"]:
        lines.append(f"  rejected/failed: {', '.join(b['rejected'])}")
    conf = b.get("confirmation")
    if conf:
        lines.append(
            f"  confirmation: {len(conf['candidates'])} candidates x {conf['runs']} runs "
            f"x {conf['rounds']} rounds, interleaved (medians of per-round figures)"
        )
        lines.append(
            f"    {'variant|candidate':44} {'p50 ms':>8} {'p99 ms':>8} {'p99/best':>9} "
            f"{'picked':>7}  why not"
        )
        for key, row in sorted(conf["candidates"].items(), key=lambda kv: kv[1]["p99_ms"]):
            lines.append(
                f"    {key:44} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} "
                f"{row['p99_over_best']:9.3f} {row['picked_in_rounds']:>4}/"
                f"{len(b['rounds'])}  {row['why_not'] or ''}"
            )
    for key, why in (b.get("not_timed") or {}).items():
        lines.append(f"    {key:44} not timed: {why}")
    lines.append(
        f"  cache: first select {b['first_select_s_median']:.2f} s, second "
        f"{b['second_select_s_median'] * 1000:.1f} ms (median; x{b['cache_speedup']}), "
        f"cache hits without benchmark {b['cache_hits']}/{len(b['rounds'])}"
    )
    lines.append(f"  why (round 1): {b['why']}")
    lines.append(f"  => {b['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="selections per model, each in a fresh state dir"
    )
    parser.add_argument(
        "--runs", type=int, default=300, help="timed runs per candidate per confirmation round"
    )
    parser.add_argument(
        "--confirm-rounds", type=int, default=2, help="confirmation benchmark rounds (medians)"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--det-size",
        type=int,
        action="append",
        default=None,
        help="det input size (square; repeatable; default 640 and 320)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="only these families (repeatable; default all): det<SIZE>, cls, face_tflite",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if min(args.rounds, args.runs, args.confirm_rounds) < 1 or args.warmup < 0:
        parser.error("--rounds, --runs and --confirm-rounds must be at least 1")

    table = model_table(args.det_size or [640, 320])
    names = args.model or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"--model {unknown[0]}: one of {', '.join(table)}")
    folder = models_dir([f for n in names for f in (table[n][0], *table[n][1])])
    hw = probe_hardware()
    report: dict[str, Any] = {
        **benchlib.report_header("selection_vs_best", hw, runtimes=True),
        "loadavg_1min_start": benchlib.loadavg(),
        "models": [],
    }
    status = 0
    if not args.json:
        print(benchlib.machine_line(report["machine"]), flush=True)
    for name in names:
        file, variant_files, shapes = table[name]
        try:
            inspect_model(folder / file)
            block = run_model(
                name, folder / file, [folder / v for v in variant_files], shapes, hw, args, log
            )
        except (ModelError, SelectionError) as exc:
            log(f"{name}: {exc}")
            block = {"model": name, "error": str(exc)}
            status = 1
        report["models"].append(block)
        if not args.json:
            print(
                format_block(block) if "error" not in block else f"{name}: {block['error']}",
                flush=True,
            )
    report["loadavg_1min_end"] = benchlib.loadavg()
    if args.json:
        benchlib.write_json(report)
    else:
        ok = [b for b in report["models"] if b.get("within_10pct")]
        ok_all = [b for b in report["models"] if b.get("within_10pct_of_all")]
        print(
            f"summary: pick within 10 % of the best passing p99 for {len(ok)}/"
            f"{len(report['models'])} models, of the best p99 of all (rejected ones too) for "
            f"{len(ok_all)}/{len(report['models'])}; loadavg "
            f"{report['loadavg_1min_start']} -> {report['loadavg_1min_end']}"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
