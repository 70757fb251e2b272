#!/usr/bin/env python3
"""The device-tree check (`sysconf.audit.checks.devicetree.check_tree`) over the whole fetched
.dtb corpus.

Corpora: Debian bookworm's linux-image-6.1.0-50-arm64 boards (always) and, when fetched, the
armhf (armmp) boards of the same release; the armhf ones are fetched here
(`fetch_test_data.py --only dtb --with-armhf`) when their folder is missing, unless
`--no-fetch`. Per tree: parse time (`load_fdt`, file read included) and check time, as median,
p99 and total (the p99 by edged.selection.bench's rule, linear interpolation between ranks;
this script used to take the nearest rank); per rule: findings with status warn/fail and the
number of trees hit.

For comparison the same files go through `dtc -I dtb -O dts -o /dev/null` with dtc's default
warnings; its stderr lines "Warning (class): ..." / "ERROR (class): ..." are counted per class
(and trees hit), with dtc's total wall time (one process per tree, serial, like edged here).

Run from a checkout: `.venv/bin/python scripts/bench_dtcheck.py [--limit N] [--json]`.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import benchlib
from benchlib import log
from fetch_test_data import KERNEL_DEB, KERNEL_DEB_ARMHF, cache_dir

from sysconf.audit.checks.devicetree import RULES, check_tree
from sysconf.fdt import FdtError, load_fdt

ROOT = Path(__file__).resolve().parent.parent

DTC_LINE = re.compile(r"\b(Warning|ERROR) \(([\w-]+)\)")

# How each edged rule relates to dtc's own checks.
DTC_RELATION: dict[str, str] = {
    "DT-DMA-DISABLED-CONTROLLER": "none (dtc ignores `status`)",
    "DT-DMA-NAMES-MISMATCH": "none (dtc's dmas_property checks cell counts, not dma-names)",
    "DT-PHANDLE-DANGLING": "overlap: dtc's *_property phandle checks (all nodes; edged: "
    "enabled nodes only)",
    "DT-DMA-SHARED-REQUEST": "none (cross-node)",
    "DT-CMA-MISSING": "none (cross-node: accelerators vs reserved-memory)",
    "DT-CMA-SMALL": "none (cross-node)",
    "DT-CMA-NOMAP-REUSABLE": "none (dtc checks reserved-memory only for unit names / reg)",
    "DT-DMA-PIO-FALLBACK": "none (cross-node: siblings)",
}


def corpora(fetch: bool) -> list[tuple[str, Path]]:
    base = cache_dir() / "dtb"
    out = []
    arm64 = base / KERNEL_DEB["dest"]
    armhf = base / KERNEL_DEB_ARMHF["dest"]
    need = [d for d in (arm64, armhf) if not (d / ".complete").exists()]
    if need and fetch:
        log("fetching the .dtb corpora (fetch_test_data.py --only dtb --with-armhf)")
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "fetch_test_data.py"),
                "--only",
                "dtb",
                "--with-armhf",
            ],
            check=True,
        )
    for arch, folder in (("arm64", arm64), ("armhf", armhf)):
        if (folder / ".complete").exists():
            out.append((arch, folder))
    return out


def timing(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median_ms": float("nan"), "p99_ms": float("nan"), "total_s": 0}
    stats = benchlib.latency_stats(values)
    return {"median_ms": stats.p50_ms, "p99_ms": stats.p99_ms, "total_s": sum(values)}


def run_edged(files: list[tuple[str, Path]]) -> dict[str, Any]:
    parse_t: list[float] = []
    check_t: list[float] = []
    hits: Counter[str] = Counter()
    trees_hit: dict[str, set[str]] = defaultdict(set)
    errors: list[str] = []
    t_all = time.perf_counter()
    for i, (name, path) in enumerate(files, 1):
        t0 = time.perf_counter()
        try:
            tree = load_fdt(path)
        except FdtError as exc:
            errors.append(str(exc))
            continue
        t1 = time.perf_counter()
        findings = check_tree(tree, name)
        t2 = time.perf_counter()
        parse_t.append(t1 - t0)
        check_t.append(t2 - t1)
        for f in findings:
            if f.status in ("warn", "fail"):
                hits[f.id] += 1
                trees_hit[f.id].add(name)
        if i % 200 == 0 or i == len(files):
            log(f"edged {i}/{len(files)} ({time.perf_counter() - t_all:.1f} s)")
    return {
        "parsed": len(parse_t),
        "parse_errors": errors,
        "parse": timing(parse_t),
        "check": timing(check_t),
        "parse_plus_check": timing([a + b for a, b in zip(parse_t, check_t, strict=True)]),
        "wall_s": time.perf_counter() - t_all,
        "rules": {
            rule: {
                "findings": hits[rule],
                "trees": len(trees_hit[rule]),
                "severity": RULES[rule][0],
                "dtc": DTC_RELATION.get(rule, ""),
            }
            for rule in RULES
        },
        "trees_with_any": len(set().union(*trees_hit.values())) if trees_hit else 0,
    }


def run_dtc(files: list[tuple[str, Path]], dtc: str) -> dict[str, Any]:
    hits: Counter[str] = Counter()
    trees_hit: dict[str, set[str]] = defaultdict(set)
    times: list[float] = []
    failed: list[str] = []
    t_all = time.perf_counter()
    for i, (name, path) in enumerate(files, 1):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [dtc, "-I", "dtb", "-O", "dts", "-o", "/dev/null", str(path)],
            capture_output=True,
            text=True,
        )
        times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            failed.append(name)
        for line in proc.stderr.splitlines():
            m = DTC_LINE.search(line)
            if m:
                key = f"{m.group(2)}" if m.group(1) == "Warning" else f"{m.group(2)} (ERROR)"
                hits[key] += 1
                trees_hit[key].add(name)
        if i % 200 == 0 or i == len(files):
            log(f"dtc {i}/{len(files)} ({time.perf_counter() - t_all:.1f} s)")
    return {
        "version": subprocess.run(
            [dtc, "--version"], capture_output=True, text=True
        ).stdout.strip(),
        "per_tree": timing(times),
        "wall_s": time.perf_counter() - t_all,
        "failed": failed,
        "classes": {
            k: {"warnings": hits[k], "trees": len(trees_hit[k])}
            for k in sorted(hits, key=lambda k: -hits[k])
        },
        "trees_with_any": len(set().union(*trees_hit.values())) if trees_hit else 0,
    }


def print_report(res: dict[str, Any]) -> None:
    print(
        f"corpora: {', '.join(f'{a} {n}' for a, n in res['corpora'].items())} "
        f"({res['files']} .dtb files)"
    )
    e = res["edged"]
    print(
        f"\nedged: {e['parsed']} parsed, {len(e['parse_errors'])} parse errors, "
        f"wall {e['wall_s']:.1f} s"
    )
    print("| step | median ms | p99 ms | total s |\n|---|---|---|---|")
    for key in ("parse", "check", "parse_plus_check"):
        t = e[key]
        print(f"| {key} | {t['median_ms']:.2f} | {t['p99_ms']:.2f} | {t['total_s']:.1f} |")
    print("\n| rule | severity | findings (warn/fail) | trees hit | dtc equivalent |")
    print("|---|---|---|---|---|")
    for rule, r in e["rules"].items():
        print(f"| {rule} | {r['severity']} | {r['findings']} | {r['trees']} | {r['dtc']} |")
    print(f"trees with any edged finding: {e['trees_with_any']}")
    d = res.get("dtc")
    if d:
        t = d["per_tree"]
        print(
            f"\n{d['version']}: wall {d['wall_s']:.1f} s, per tree median {t['median_ms']:.2f} "
            f"ms, p99 {t['p99_ms']:.2f} ms; {len(d['failed'])} failed; trees with any "
            f"warning: {d['trees_with_any']}"
        )
        print("| dtc class | warnings | trees |\n|---|---|---|")
        for k, v in d["classes"].items():
            print(f"| {k} | {v['warnings']} | {v['trees']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, help="only the first N files (sorted) per corpus")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--no-dtc", action="store_true", help="skip the dtc comparison")
    parser.add_argument(
        "--no-fetch", action="store_true", help="use what is fetched; do not fetch the armhf corpus"
    )
    args = parser.parse_args(argv)
    found = corpora(fetch=not args.no_fetch)
    if not found:
        parser.error("no .dtb corpus (run scripts/fetch_test_data.py --only dtb)")
    files: list[tuple[str, Path]] = []
    counts: dict[str, int] = {}
    for arch, folder in found:
        paths = sorted(folder.rglob("*.dtb"))
        if args.limit:
            paths = paths[: args.limit]
        counts[arch] = len(paths)
        files += [(f"{arch}/{p.relative_to(folder)}", p) for p in paths]
    log(f"{len(files)} files: {counts}")
    res: dict[str, Any] = {
        **benchlib.report_header("dtcheck"),
        "corpora": counts,
        "files": len(files),
        "edged": run_edged(files),
    }
    dtc = shutil.which("dtc")
    if not args.no_dtc:
        if dtc is None:
            log("dtc not found: no comparison")
        else:
            res["dtc"] = run_dtc(files, dtc)
    if args.json:
        benchlib.write_json(res)
    else:
        print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
