"""What every benchmark script (scripts/bench_*.py) shares: the percentile rule, the report
header, progress lines and the JSON report.

Percentiles: every one goes through `edged.selection.bench.LatencyStats` (numpy's linear
interpolation between the closest ranks, the rule `edgectl bench` and the backend selection
use), so a p99 of one script compares with another's and with what the daemon picked on.
Medians over rounds stay plain medians (the same rule at 50 %).

Only the standard library is imported up front: bench_fleet's monitor child measures its own
RSS and CPU time and never needs numpy, so the functions import what they use.

The tests' harness (tests/support: the real daemon, a real Mosquitto, fixture roots) is not
part of the installed package; the scripts that drive a daemon or a broker import it as
`tests.support.*`, so the checkout's root is put on sys.path here, once for all of them (the
project itself comes from the editable install).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.selection.bench import LatencyStats
    from sysconf.hardware import HardwareFacts

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

PROG = Path(sys.argv[0]).stem  # the script run, whichever module calls log


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the report), named after the script."""
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def latency_stats(seconds: Iterable[float]) -> LatencyStats:
    """Samples in seconds (at least one) summarised by the project's one percentile rule;
    the figures come back in ms, as `LatencyStats` gives them."""
    import numpy as np

    from edged.selection.bench import LatencyStats

    return LatencyStats.from_ns(np.fromiter(seconds, dtype=np.float64) * 1e9)


def median(values: Iterable[float]) -> float:
    """The plain median of rounds (medians over rounds, as every benchmark reports them)."""
    import statistics

    return float(statistics.median(values))


def loadavg() -> float:
    """The 1-minute load average: the best hint of a run disturbed by other work."""
    return round(os.getloadavg()[0], 2)


def machine(hw: HardwareFacts | None = None, runtimes: bool = False) -> dict[str, Any]:
    """The machine block of every report: CPU model and count, architecture, INT8 ISA flags
    and their summary, kernel and Python; with `runtimes`, the inference runtimes' versions
    (that asks each backend, so only the scripts that time runtimes ask)."""
    if hw is None:
        from backends import probe_hardware

        hw = probe_hardware()
    facts: dict[str, Any] = {
        "cpu_model": hw.cpu_model,
        "cpus": hw.cpu_count,
        "arch": hw.arch,
        "isa_int8": hw.isa_int8,
        "isa": hw.isa_summary(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    if runtimes:
        from edged.selection.candidates import runtime_versions

        facts["runtimes"] = runtime_versions()
    return facts


def machine_line(facts: Mapping[str, Any]) -> str:
    """The header line of a text report."""
    return (
        f"machine: {facts['cpu_model']}, {facts['cpus']} CPUs, {facts['arch']}, ISA {facts['isa']}"
    )


def report_header(
    benchmark: str, hw: HardwareFacts | None = None, runtimes: bool = False
) -> dict[str, Any]:
    """The first keys of a JSON report: which benchmark, when, on what."""
    return {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(hw, runtimes),
    }


def stop_child(proc) -> None:
    """A server this script started (a subprocess.Popen): SIGTERM, 15 s, then SIGKILL; its
    stdout pipe closed."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
    if proc.stdout:
        proc.stdout.close()


def write_json(report: Mapping[str, Any]) -> None:
    """The --json report, on stdout."""
    print(json.dumps(report, indent=2))


def finish(report: dict[str, Any], started: float, as_json: bool) -> int:
    """The end of a run: its wall time (from `started`, a perf_counter reading) and the load
    at the end go into `report`; then the JSON report, or the line that says both. Exit 0."""
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["loadavg_1min_end"] = loadavg()
    if as_json:
        write_json(report)
    else:
        print(
            f"total wall {report['wall_s']:.1f} s; loadavg {report['loadavg_1min_start']} -> "
            f"{report['loadavg_1min_end']}"
        )
    return 0
