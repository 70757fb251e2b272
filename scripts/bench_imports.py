#!/usr/bin/env python3
"""Import time and peak RSS of edged's lazy imports, each case in a fresh interpreter.

Cases (each `sys.executable -c ...`, repeated `--reps` times round-robin, medians):
  0 baseline   the bare interpreter (`pass`), for reference
  a cli        `import edged.cli.main, backends`: no inference runtime may be imported
  b litert     load the .tflite model with the LiteRT backend and run it once; openvino and
               onnxruntime must not be in sys.modules afterwards
  c ort        load an ONNX model with onnxruntime and run it once; openvino not imported
  d openvino   `import openvino` alone, the cost the lazy imports avoid
  h ov_run     load + run the same ONNX model with OpenVINO (what (c) would cost with it)
  i cli_pinned `edgectl bench TFLITE --backend litert:XNNPACK --runs 1` in-process (the CLI's
               pinned-backend path: lists LiteRT's candidates only); no openvino/onnxruntime
  j cached     `select` on a cached decision (made beforehand, Policy backend "litert") +
               `Selection.load_candidate` + load + one run: what a restart does
  e, f, g      `import numpy`, `import onnx`, `import onnxruntime` alone (what (a)-(c) pay for)
Reported: the child's own time from its first statement to the end of the case (ms), the
subprocess wall time including interpreter start-up (ms), and peak RSS (ru_maxrss, MiB);
ratios against case d.

Run from a checkout: `.venv/bin/python scripts/bench_imports.py [--reps 7] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
from fetch_test_data import models_dir

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("openvino", "onnxruntime", "ai_edge_litert", "tflite_runtime", "onnx", "numpy")

PRELUDE = "import time as _t; _t0 = _t.perf_counter()\n"
EPILOGUE = f"""
import json as _j, resource as _r, sys as _s
print("@@" + _j.dumps({{
    "ms": (_t.perf_counter() - _t0) * 1000,
    "maxrss_kib": _r.getrusage(_r.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
    "modules": {{m: m in _s.modules for m in {HEAVY!r}}},
}}))
"""

CASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # name -> (description, code, modules that must NOT be imported afterwards)
    "baseline": ("bare interpreter (pass)", "pass", ()),
    "cli": (
        "import edged.cli.main, backends",
        "import edged.cli.main, backends",
        ("openvino", "onnxruntime", "ai_edge_litert", "tflite_runtime"),
    ),
    "litert": (
        "load + run .tflite with litert",
        """
from backends import Candidate, LoadOptions, get_backend
from backends.model_info import inspect_model
from edged.selection.inputs import make_inputs, resolve_shapes
info = inspect_model({tflite!r})
s = get_backend("litert").load(info, Candidate("litert", "XNNPACK", "model"),
                               LoadOptions(threads={threads}))
s.run(make_inputs(s.inputs, resolve_shapes(s.inputs, None, info.name)))
""",
        ("openvino", "onnxruntime"),
    ),
    "ort": (
        "load + run .onnx with onnxruntime",
        """
from backends import Candidate, LoadOptions, get_backend
from backends.model_info import inspect_model
from edged.selection.inputs import make_inputs, resolve_shapes
info = inspect_model({onnx!r})
c = Candidate("onnxruntime", "CPU", "model", options={{"provider": "CPUExecutionProvider"}})
s = get_backend("onnxruntime").load(info, c, LoadOptions(threads={threads}))
s.run(make_inputs(s.inputs, resolve_shapes(s.inputs, {shapes!r}, info.name)))
""",
        ("openvino",),
    ),
    "openvino": ("import openvino", "import openvino", ()),
    "ov_run": (
        "load + run .onnx with openvino",
        """
from backends import Candidate, LoadOptions, get_backend
from backends.model_info import inspect_model
from edged.selection.inputs import make_inputs, resolve_shapes
info = inspect_model({onnx!r})
s = get_backend("openvino").load(info, Candidate("openvino", "CPU", "fp32"),
                                 LoadOptions(threads={threads}, shapes={shapes!r}))
s.run(make_inputs(s.inputs, resolve_shapes(s.inputs, {shapes!r}, info.name)))
""",
        ("onnxruntime",),
    ),
    "cli_pinned": (
        "edgectl bench --backend litert:XNNPACK",
        """
import contextlib, io, os, shutil, tempfile
os.environ["EDGED_STATE_DIR"] = _state = tempfile.mkdtemp(prefix="edged-bench-imports-")
from edged.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["bench", {tflite!r}, "--backend", "litert:XNNPACK", "--runs", "1",
                 "--warmup", "0", "--threads", "{threads}"]) == 0
shutil.rmtree(_state)
""",
        ("openvino", "onnxruntime"),
    ),
    "cached": (
        "cached select + load_candidate + run",
        """
from pathlib import Path
from backends import LoadOptions, get_backend
from edged.selection.inputs import make_inputs
from edged.selection.policy import Policy
from edged.selection.select import select
from backends import probe_hardware
hw = probe_hardware()
sel = select({tflite!r}, hw, Policy(backend="litert", threads={threads}), Path({state!r}))
assert sel.from_cache
c = sel.load_candidate(hw)
s = get_backend(c.backend).load(sel.model, c, LoadOptions(threads={threads}))
s.run(make_inputs(s.inputs, sel.shapes))
""",
        ("openvino", "onnxruntime"),
    ),
    # Attribution of (a)-(c): what the pieces cost on their own.
    "numpy": ("import numpy", "import numpy", ()),
    "onnx": ("import onnx (inspect_model, .onnx)", "import onnx", ()),
    "onnxruntime": ("import onnxruntime", "import onnxruntime", ()),
}
LABELS = {
    "baseline": "0",
    "cli": "a",
    "litert": "b",
    "ort": "c",
    "openvino": "d",
    "ov_run": "h",
    "cli_pinned": "i",
    "cached": "j",
    "numpy": "e",
    "onnx": "f",
    "onnxruntime": "g",
}


def run_case(code: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + code + EPILOGUE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    wall_ms = (time.perf_counter() - start) * 1000
    if proc.returncode != 0:
        raise RuntimeError(f"case failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@"))
    data = json.loads(line[2:])
    data["wall_ms"] = wall_ms
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="fresh processes per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tflite", type=Path, help="default: face_detection_short_range.tflite")
    parser.add_argument("--onnx", type=Path, help="default: ppocr_cls_int8.onnx")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    folder = None if (args.tflite and args.onnx) else models_dir()
    tflite = args.tflite or folder / "face_detection_short_range.tflite"
    onnx = args.onnx or folder / "ppocr_cls_int8.onnx"
    for path in (tflite, onnx):
        if not path.exists():
            subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "fetch_test_data.py"), "--only", "models"],
                check=True,
            )
    shapes = {"x": (1, 3, 48, 192)} if onnx.name.startswith("ppocr_cls") else None
    state = Path(tempfile.mkdtemp(prefix="edged-bench-imports-state-"))
    # The decision case (j) reads: made once here, in its own process (that one measures,
    # so it imports whatever the selection needs for its reference).
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path\n"
            "from edged.selection.policy import Policy\n"
            "from edged.selection.select import select\n"
            "from backends import probe_hardware\n"
            f"select({str(tflite)!r}, probe_hardware(), Policy(backend='litert', "
            f"threads={args.threads}), Path({str(state)!r}))",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    fmt = {
        "tflite": str(tflite),
        "onnx": str(onnx),
        "threads": args.threads,
        "shapes": shapes,
        "state": str(state),
    }
    codes = {
        name: code.format(**fmt) if "{" in code else code for name, (_, code, _) in CASES.items()
    }
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    load_before = benchlib.loadavg()
    for _ in range(args.reps):  # round-robin: a noisy moment hits every case once
        for name in CASES:
            samples[name].append(run_case(codes[name]))
    load_after = benchlib.loadavg()
    shutil.rmtree(state)
    rows = {}
    failures = []
    for name, (desc, _, forbidden) in CASES.items():
        runs = samples[name]
        imported = {m: any(r["modules"][m] for r in runs) for m in HEAVY}
        leaked = [m for m in forbidden if imported[m]]
        if leaked:
            failures.append(f"{name}: imported {', '.join(leaked)}")
        rows[name] = {
            "case": LABELS[name],
            "what": desc,
            "self_ms": round(benchlib.median([r["ms"] for r in runs]), 1),
            "wall_ms": round(benchlib.median([r["wall_ms"] for r in runs]), 1),
            "peak_rss_mib": round(benchlib.median([r["maxrss_kib"] / 1024 for r in runs]), 1),
            "imported": [m for m in HEAVY if imported[m]],
            "must_not_import": list(forbidden),
            "lazy_ok": not leaked,
        }
    ref = rows["openvino"]
    for row in rows.values():
        for q in ("self_ms", "wall_ms", "peak_rss_mib"):
            row[f"{q}_vs_openvino"] = round(row[q] / ref[q], 2) if ref[q] else None
    report = {
        **benchlib.report_header("lazy_imports"),
        "reps": args.reps,
        "models": {"tflite": str(tflite), "onnx": str(onnx)},
        "loadavg_1min": [load_before, load_after],
        "cases": rows,
        "failures": failures,
    }
    if args.json:
        benchlib.write_json(report)
    else:
        print(
            f"fresh `python -c` per case, median of {args.reps}; self = from the child's first "
            f"statement to the end of the case; wall includes interpreter start-up; ratios vs "
            f"(d) import openvino; loadavg {load_before:.2f} -> {load_after:.2f}"
        )
        print(
            f"  {'case':38} {'self ms':>8} {'wall ms':>8} {'RSS MiB':>8} {'self/d':>7} "
            f"{'wall/d':>7} {'RSS/d':>6}  heavy modules imported"
        )
        for r in rows.values():
            mark = "" if r["lazy_ok"] else "  <- LEAK"
            lines = (
                f"  ({r['case']}) {r['what']:34} {r['self_ms']:8.1f} {r['wall_ms']:8.1f} "
                f"{r['peak_rss_mib']:8.1f} {r['self_ms_vs_openvino']:7.2f} "
                f"{r['wall_ms_vs_openvino']:7.2f} {r['peak_rss_mib_vs_openvino']:6.2f}  "
                f"{', '.join(r['imported']) or '-'}{mark}"
            )
            print(lines)
        for name in ("cli", "litert", "ort", "ov_run", "cli_pinned", "cached"):
            r = rows[name]
            print(
                f"  => ({r['case']}) {', '.join(r['must_not_import'])} not in sys.modules: "
                f"{'yes' if r['lazy_ok'] else 'NO'}"
            )
    for failure in failures:
        print(f"bench_imports: lazy import broken: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
