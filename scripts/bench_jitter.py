#!/usr/bin/env python3
"""Does pinning inference to a core (and SCHED_FIFO) cut the latency tail under load?

The PP-OCR direction classifier (`ppocr_cls.onnx`, `x` 1×3×48×192 fp32, onnxruntime CPU, one
intra-op thread) is run through a real `edged.serving.engine.ModelWorker` at a fixed rate (200 Hz by
default). A scheduler thread submits each request at an absolute time (t0 + i × period,
`time.perf_counter`) and the latency of a request is its completion time minus its
*scheduled* time, so a late wake-up, a queue behind a slow run, or a skipped slot all count
(coordinated-omission aware: nothing is dropped or rescheduled when the loop falls behind).
Four configurations, interleaved in one run (the order rotates each round):

  (1) unpinned, idle: worker thread on any CPU, no load;
  (2) unpinned, loaded: `stress-ng --cpu 2 --io 1 --vm 1 --vm-bytes 256M` on all CPUs;
  (3) pinned: the worker on the inference CPU (`ModelWorker(cpus=[1])`), the same load
      confined to the housekeeping CPU (`stress-ng --taskset 0`);
  (4) pinned + SCHED_FIFO: as (3), with `BatchingConfig(rt_priority=50)` on the worker.

The pinning and SCHED_FIFO are edged's own code (`ModelWorker._loop`); the script checks what
the worker thread really got (Cpus_allowed_list, policy) from /proc. The scheduler thread runs
where the request would come from: by default on the inference CPU in (3)/(4) (a control loop
on the isolated core; `--submit-on housekeeping` puts it on the loaded CPU instead) and
unpinned in (1)/(2). Per configuration and round: p50, p99, p99.9, max and p99−p50 of the
scheduled-start latency, its parts (wake-up lateness of the scheduler, edged's queue and
compute `Timing`), and the intrusion counters of `sysconf.intrusions` over the segment:
interrupts/s and softirqs/s on the inference CPU and the worker thread's involuntary context
switches/s. Figures are medians over rounds of per-round figures; ratios are taken per round.

Then cyclictest (rt-tests) on the inference CPU as the OS floor: idle at SCHED_FIFO 80, and
with the load on the housekeeping CPU at SCHED_OTHER and at SCHED_FIFO 80 (`-m -q --laptop
-i 1000 -a 1 -t 1 -h`; `--laptop` keeps it from holding /dev/cpu_dma_latency at 0, which the
inference runs do not do either). Its percentiles are read off cyclictest's own histogram (the
first 1 µs bin that reaches the rank); all others follow edged.selection.bench's rule.

Target (issue 4): pinned p99.9 <= 1.5 × its p50, and >= 3 × lower than unpinned under load;
checked for (3) and (4). Nothing is written to /proc, /sys or systemd; stress-ng's files go
to a temporary folder and every stress-ng run is bounded by --timeout and stopped in
`finally`.

    .venv/bin/python scripts/bench_jitter.py [--seconds 10] [--rounds 3] [--hz 200] [--json]
        [--cyclic-seconds S] [--submit-on inference|housekeeping] [--stress "STRESSORS"]

Exit status 1 when the target is missed, 2 when stress-ng is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from benchlib import log
from fetch_test_data import models_dir

from backends import Candidate, LoadOptions, get_backend
from backends.model_info import inspect_model
from edged.config import BatchingConfig
from edged.selection.inputs import make_inputs, parse_shape_args, resolve_shapes
from edged.serving.engine import ModelWorker
from edged.serving.requests import EngineError, Timing
from sysconf.intrusions import (
    interrupts_per_cpu,
    rates,
    softirqs_per_cpu,
    thread_switches,
)
from sysconf.irq import read_interrupts, read_irq_report
from sysconf.sysroot import SysRoot

MODEL = "ppocr_cls.onnx"
SHAPE = "x=1x3x48x192"
INFERENCE_CPU = 1
HOUSEKEEPING_CPU = 0
RT_PRIORITY = 50  # the worker's SCHED_FIFO priority in (4); below cyclictest's 80, never both
CYCLICTEST_PRIORITY = 80
STRESS = "--cpu 2 --io 1 --vm 1 --vm-bytes 256M"  # CPU + I/O (sync) + memory
LOAD_RAMP_S = 1.0  # stress-ng up and its vm worker's memory touched before measuring
SETTLE_S = 0.5  # after stopping the load (its dirty pages, its exit)
WARMUP_S = 0.5  # per worker, untimed, before the first round
HIST_US = 20000  # cyclictest histogram range; beyond it only the overflow count is known
TARGET_SPREAD = 1.5  # pinned p99.9 <= 1.5 x its p50
TARGET_GAIN = 3.0  # pinned p99.9 >= 3 x lower than unpinned under load


@dataclass(frozen=True)
class Setup:
    label: str
    pinned: bool
    fifo: bool
    load: str | None  # None, "all" (every CPU), "housekeeping" (--taskset)


SETUPS = {
    "unpinned_idle": Setup("(1) unpinned, idle", False, False, None),
    "unpinned_load": Setup("(2) unpinned, stress-ng on all CPUs", False, False, "all"),
    "pinned_load": Setup("(3) pinned to CPU 1, load on CPU 0", True, False, "housekeeping"),
    "pinned_fifo_load": Setup("(4) pinned + SCHED_FIFO, load on CPU 0", True, True, "housekeeping"),
}


def load_session(path: Path, pinned: bool):
    """onnxruntime CPU with one intra-op thread: the run happens on the calling (worker)
    thread, so the worker's affinity and policy are the run's."""
    return get_backend("onnxruntime").load(
        inspect_model(path),
        Candidate("onnxruntime", "CPU", "model", options={"provider": "CPUExecutionProvider"}),
        LoadOptions(threads=1, cpus=[INFERENCE_CPU] if pinned else None),
    )


# -- the load -----------------------------------------------------------------------------------


class Load:
    """One stress-ng run, bounded by its own --timeout and stopped by `stop` (always called)."""

    def __init__(self, where: str, seconds: float, tmp: Path, stressors: str) -> None:
        self.where = where
        work = Path(tempfile.mkdtemp(prefix="stress-", dir=tmp))
        cmd = [
            "stress-ng",
            *shlex.split(stressors),
            "--temp-path",
            str(work),
            "--timeout",
            f"{int(seconds + LOAD_RAMP_S) + 10}s",
        ]
        if where == "housekeeping":
            cmd[1:1] = ["--taskset", str(HOUSEKEEPING_CPU)]
        self.cmd = cmd
        self._err = open(work / "stderr.txt", "w+b")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            start_new_session=True,
        )

    def check(self) -> dict[str, Any]:
        """stress-ng still running, and where its workers may run (Cpus_allowed_list)."""
        if self.proc.poll() is not None:
            self._err.seek(0)
            raise RuntimeError(
                f"stress-ng exited early ({self.proc.returncode}): "
                f"{self._err.read().decode(errors='replace')[-500:]}"
            )
        allowed = {}
        for pid in _descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{pid}/status").read_text()
                fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
                allowed[pid] = fields.get("Cpus_allowed_list", "?").strip()
        return {"workers": len(allowed), "cpus_allowed": sorted(set(allowed.values()))}

    def stop(self) -> None:
        """SIGTERM to the stress-ng we started (it stops its own workers), then SIGKILL to
        its process group if it lingers."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)  # its own session only
                    self.proc.wait(timeout=5)
        finally:
            self._err.close()


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in _listdir(f"/proc/{current}/task"):
            with contextlib.suppress(OSError):
                for child in Path(f"/proc/{current}/task/{task}/children").read_text().split():
                    found.append(int(child))
                    todo.append(int(child))
    return found


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@contextlib.contextmanager
def load_running(where: str | None, seconds: float, tmp: Path, stressors: str):
    if where is None:
        yield None
        return
    load = Load(where, seconds, tmp, stressors)
    try:
        time.sleep(LOAD_RAMP_S)
        info = load.check()
        yield info
        load.check()  # still alive at the end of the segment
    finally:
        load.stop()
        time.sleep(SETTLE_S)


# -- intrusion counters -------------------------------------------------------------------------


@dataclass
class Counters:
    at: float
    interrupts: dict[int, int]
    irq_rows: dict[str, int]  # per /proc/interrupts row, on the inference CPU
    softirqs: dict[int, dict[str, int]]
    worker: tuple[int, int] | None  # (voluntary, involuntary)
    submitter: tuple[int, int] | None
    stat: dict[int, tuple[int, int, int]]  # /proc/stat per CPU: task, irq+softirq, steal ticks

    @classmethod
    def read(cls, root: SysRoot, worker_tid: int | None, submitter_tid: int | None) -> Counters:
        cpus, lines = read_interrupts(root)
        column = cpus.index(INFERENCE_CPU) if INFERENCE_CPU in cpus else None
        rows = {
            f"{line.irq} {line.actions}" if line.numeric else line.irq: line.counts[column]
            for line in lines
            if column is not None and column < len(line.counts)
        }
        return cls(
            time.perf_counter(),
            interrupts_per_cpu(root),
            rows,
            softirqs_per_cpu(root),
            _switches(worker_tid),
            _switches(submitter_tid),
            _cpu_stat(root),
        )


def _cpu_stat(root: SysRoot) -> dict[int, tuple[int, int, int]]:
    """Per CPU from /proc/stat: user+nice+system, irq+softirq, steal (USER_HZ ticks)."""
    found = {}
    for line in (root.read_text("/proc/stat", "") or "").splitlines():
        f = line.split()
        if len(f) > 8 and f[0].startswith("cpu") and f[0][3:].isdigit():
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f[1:9])
            found[int(f[0][3:])] = (user + nice + system, irq + softirq, steal)
    return found


def _switches(tid: int | None) -> tuple[int, int] | None:
    if tid is None:
        return None
    found = thread_switches(tid)
    return (found.voluntary, found.involuntary) if found else None


def intrusions(before: Counters, after: Counters) -> dict[str, Any]:
    seconds = after.at - before.at
    cpu = INFERENCE_CPU
    irq = rates(before.interrupts, after.interrupts, seconds)
    soft_before = {k: sum(v.values()) for k, v in before.softirqs.items()}
    soft_after = {k: sum(v.values()) for k, v in after.softirqs.items()}
    soft = rates(soft_before, soft_after, seconds)
    kinds = {
        kind: (n - before.softirqs.get(cpu, {}).get(kind, 0)) / seconds
        for kind, n in after.softirqs.get(cpu, {}).items()
    }
    rows = {
        name: (n - before.irq_rows.get(name, n)) / seconds for name, n in after.irq_rows.items()
    }

    def tick_ms(a, b, index):
        return (
            (a.get(cpu, (0, 0, 0))[index] - b.get(cpu, (0, 0, 0))[index])
            * 1000
            / os.sysconf("SC_CLK_TCK")
            / seconds
        )

    def per_s(a, b, index):
        return (b[index] - a[index]) / seconds if a and b else None

    return {
        "seconds": round(seconds, 3),
        "irq_per_s": round(irq.get(cpu, 0.0), 1),
        "irq_per_s_other_cpu": round(irq.get(HOUSEKEEPING_CPU, 0.0), 1),
        "softirq_per_s": round(soft.get(cpu, 0.0), 1),
        # USER_HZ ticks -> ms per second of wall time. Without IRQ_TIME_ACCOUNTING the
        # kernel samples irq time at its tick, so this is an estimate; steal is 0 where the
        # hypervisor does not report it.
        "busy_ms_per_s": round(tick_ms(after.stat, before.stat, 0), 1),
        "irq_time_ms_per_s": round(tick_ms(after.stat, before.stat, 1), 1),
        "steal_ms_per_s": round(tick_ms(after.stat, before.stat, 2), 1),
        "worker_invol_per_s": per_s(before.worker, after.worker, 1),
        "worker_vol_per_s": per_s(before.worker, after.worker, 0),
        "submitter_invol_per_s": per_s(before.submitter, after.submitter, 1),
        "top_irqs": {
            k: round(v, 1) for k, v in sorted(rows.items(), key=lambda kv: -kv[1])[:4] if v > 0
        },
        "top_softirqs": {
            k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:3] if v > 0
        },
    }


# -- one timed segment ----------------------------------------------------------------------------


def segment(
    worker: ModelWorker,
    feeds,
    hz: float,
    seconds: float,
    submit_cpus: set[int] | None,
    root: SysRoot,
    record: bool = True,
) -> dict[str, Any]:
    """Submit at t0 + i/hz for `seconds`; latency = done - scheduled. A request whose slot has
    passed is submitted at once (never skipped), so lateness accumulates as it would for a
    real periodic producer."""
    n = max(1, round(hz * seconds))
    period = 1.0 / hz
    scheduled = np.zeros(n)
    submitted = np.zeros(n)
    done_at = np.full(n, np.nan)
    failed = np.zeros(n, dtype=bool)
    queue_s = np.full(n, np.nan)
    compute_s = np.full(n, np.nan)
    finished = [0]
    errors: list[str] = []
    submitter_tid: list[int] = []
    started = threading.Event()
    go = threading.Event()

    def on_done(i: int, outputs, error: BaseException | None, timing: Timing | None) -> None:
        done_at[i] = time.perf_counter()
        if timing is not None:
            queue_s[i] = timing.queue_s
            compute_s[i] = timing.compute_s
        if error is not None:
            failed[i] = True
            if len(errors) < 5:
                errors.append(repr(error))
        finished[0] += 1

    def scheduler() -> None:
        if submit_cpus:
            os.sched_setaffinity(0, submit_cpus)
        submitter_tid.append(threading.get_native_id())
        started.set()
        go.wait()
        t0 = time.perf_counter() + 0.02
        for i in range(n):
            target = t0 + i * period
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            scheduled[i] = target
            submitted[i] = time.perf_counter()
            try:
                worker.submit(feeds, functools.partial(on_done, i))
            except EngineError as exc:  # counted as lost
                failed[i] = True
                if len(errors) < 5:
                    errors.append(repr(exc))
                finished[0] += 1

    thread = threading.Thread(target=scheduler, name="jitter-sched", daemon=True)
    thread.start()
    started.wait()
    before = Counters.read(root, worker.native_id, submitter_tid[0])
    go.set()
    thread.join(seconds + 60)
    deadline = time.perf_counter() + 30
    while finished[0] < n and time.perf_counter() < deadline:
        time.sleep(0.005)
    after = Counters.read(root, worker.native_id, submitter_tid[0])
    if not record:
        return {}
    ok = ~failed & ~np.isnan(done_at)
    lat = (done_at[ok] - scheduled[ok]) * 1e3  # s -> ms for reporting
    wake = (submitted - scheduled) * 1e3
    stats = percentiles(lat)
    return {
        **stats,
        "requests": n,
        "completed": int(ok.sum()),
        "errors": int(n - ok.sum()),
        "error_samples": errors,
        "over_period": int((lat > period * 1e3).sum()),  # missed the next tick
        "wake": percentiles(wake),
        "queue": percentiles(queue_s[ok] * 1e3),
        "compute": percentiles(compute_s[ok] * 1e3),
        "intrusions": intrusions(before, after),
        "latencies_ms": lat,  # dropped before JSON; pooled over rounds in the summary
    }


def percentiles(ms: np.ndarray) -> dict[str, float]:
    if not len(ms):
        return {
            "p50_ms": float("nan"),
            "p99_ms": float("nan"),
            "p999_ms": float("nan"),
            "max_ms": float("nan"),
            "spread_ms": float("nan"),
        }
    stats = benchlib.latency_stats(ms / 1e3)
    return {
        "p50_ms": stats.p50_ms,
        "p99_ms": stats.p99_ms,
        "p999_ms": stats.p999_ms,
        "max_ms": stats.max_ms,
        "spread_ms": round(stats.p99_ms - stats.p50_ms, 4),
    }


def worker_thread_facts(worker: ModelWorker) -> dict[str, Any]:
    """What the kernel says the worker thread got (edged's own per-thread view)."""
    from edged.placement import thread_affinities

    for row in thread_affinities():
        if row["tid"] == worker.native_id:
            return {"cpus": row["cpus"], "policy": row["policy"], "engine_says": worker.scheduling}
    return {"cpus": "?", "policy": "?", "engine_says": worker.scheduling}


# -- cyclictest -----------------------------------------------------------------------------------

CYCLIC_RUNS = {
    "idle_fifo": ("idle, SCHED_FIFO 80", None, True),
    "load_other": ("load on CPU 0, SCHED_OTHER", "housekeeping", False),
    "load_fifo": ("load on CPU 0, SCHED_FIFO 80", "housekeeping", True),
}


def cyclictest(seconds: float, fifo: bool) -> dict[str, Any]:
    cmd = [
        "cyclictest",
        "-m",
        "-q",
        "--laptop",
        f"-D{max(1, round(seconds))}s",
        "-i1000",
        f"-a{INFERENCE_CPU}",
        "-t1",
        f"-h{HIST_US}",
    ]
    cmd += [f"-p{CYCLICTEST_PRIORITY}"] if fifo else ["--policy=other"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    result = parse_cyclictest(out.stdout)
    result["command"] = " ".join(cmd)
    if out.returncode != 0 or result.get("total") is None:
        result["error"] = (out.stderr or out.stdout)[-300:]
    return result


def parse_cyclictest(text: str) -> dict[str, Any]:
    """Histogram rows `000012 000345` (µs, count) and the `# Min/Avg/Max Latencies` lines."""
    counts: dict[int, int] = {}
    summary: dict[str, int] = {}
    for line in text.splitlines():
        row = re.fullmatch(r"(\d+)\s+(\d+)", line.strip())
        if row:
            counts[int(row[1])] = int(row[2])
            continue
        head = re.match(
            r"#\s*(Total|Min Latencies|Avg Latencies|Max Latencies|"
            r"Histogram Overflows):\s*(\d+)",
            line,
        )
        if head:
            summary[head[1]] = int(head[2])
    total = summary.get("Total")
    overflows = summary.get("Histogram Overflows", 0)
    result: dict[str, Any] = {
        "total": total,
        "overflows": overflows,
        "min_us": summary.get("Min Latencies"),
        "avg_us": summary.get("Avg Latencies"),
        "max_us": summary.get("Max Latencies"),
    }
    if counts and total:
        edges = np.array(sorted(counts))
        cumulative = np.cumsum([counts[k] for k in edges])
        for name, q in (("p50_us", 0.5), ("p99_us", 0.99), ("p999_us", 0.999)):
            index = int(np.searchsorted(cumulative, q * total))
            result[name] = int(edges[index]) if index < len(edges) else None  # in overflow
    return result


# -- summary ------------------------------------------------------------------------------------

METRICS = ("p50_ms", "p99_ms", "p999_ms", "max_ms", "spread_ms")


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for key, setup in SETUPS.items():
        runs = [r[key] for r in rounds]
        pooled = np.concatenate([run["latencies_ms"] for run in runs])
        row: dict[str, Any] = {"label": setup.label}
        for metric in METRICS:
            row[metric] = round(benchlib.median([run[metric] for run in runs]), 4)
            row[f"{metric}_rounds"] = [run[metric] for run in runs]
        row["max_ms_worst"] = max(run["max_ms"] for run in runs)
        row["pooled"] = percentiles(pooled)
        row["over_period"] = sum(run["over_period"] for run in runs)
        row["requests"] = sum(run["requests"] for run in runs)
        row["errors"] = sum(run["errors"] for run in runs)
        for part in ("wake", "queue", "compute"):
            row[part] = {
                m: round(benchlib.median([run[part][m] for run in runs]), 4)
                for m in ("p50_ms", "p999_ms", "max_ms")
            }
        intr = [run["intrusions"] for run in runs]
        for name in (
            "irq_per_s",
            "irq_per_s_other_cpu",
            "softirq_per_s",
            "steal_ms_per_s",
            "busy_ms_per_s",
            "irq_time_ms_per_s",
            "worker_invol_per_s",
            "worker_vol_per_s",
            "submitter_invol_per_s",
        ):
            values = [i[name] for i in intr if i[name] is not None]
            row[name] = round(benchlib.median(values), 2) if values else None
        row["top_irqs_rounds"] = [i["top_irqs"] for i in intr]
        row["top_softirqs_rounds"] = [i["top_softirqs"] for i in intr]
        configs[key] = row

    targets = []
    for key in ("pinned_load", "pinned_fifo_load"):
        spread = [r[key]["p999_ms"] / r[key]["p50_ms"] for r in rounds]
        gain = [r["unpinned_load"]["p999_ms"] / r[key]["p999_ms"] for r in rounds]
        row = configs[key]
        targets.append(
            {
                "target": f"{SETUPS[key].label}: p99.9 <= {TARGET_SPREAD}x its p50",
                "value": round(benchlib.median(spread), 3),
                "rounds": [round(v, 3) for v in spread],
                "figures": f"p99.9 {row['p999_ms']:.3f} ms / p50 {row['p50_ms']:.3f} ms = "
                f"{benchlib.median(spread):.2f}x (rounds {min(spread):.2f}-{max(spread):.2f}x)",
                "pass": benchlib.median(spread) <= TARGET_SPREAD,
            }
        )
        targets.append(
            {
                "target": f"{SETUPS[key].label}: p99.9 >= {TARGET_GAIN}x lower than (2)",
                "value": round(benchlib.median(gain), 3),
                "rounds": [round(v, 3) for v in gain],
                "figures": f"(2) p99.9 {configs['unpinned_load']['p999_ms']:.3f} ms / "
                f"{row['p999_ms']:.3f} ms = {benchlib.median(gain):.2f}x (rounds "
                f"{min(gain):.2f}-{max(gain):.2f}x)",
                "pass": benchlib.median(gain) >= TARGET_GAIN,
            }
        )
    return {"configs": configs, "targets": targets}


def machine_facts(root: SysRoot) -> dict[str, Any]:
    from backends import probe_hardware
    from sysconf.cpusets import read_cpusets

    hw = probe_hardware(root)
    sets = read_cpusets(root)
    report = read_irq_report(root)
    on_core = [
        line
        for line in report.lines
        if line.numeric
        and INFERENCE_CPU in report.effective.get(line.irq, report.affinity.get(line.irq, []))
    ]
    return {
        **benchlib.machine(hw),
        "isolated": sets.isolated,
        "isolcpus": sets.isolcpus,
        "nohz_full": sets.nohz_full,
        "irqs_effective_on_inference_cpu": [f"{line.irq} {line.actions}" for line in on_core],
    }


# -- report -------------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    a = report["args"]
    m = report["machine"]
    print(
        f"model {report['model']} x 1x3x48x192, onnxruntime CPU, 1 thread, through "
        f"edged's ModelWorker; {a['hz']:g} Hz for {a['seconds']:g} s per config x "
        f"{a['rounds']} rounds (medians of per-round figures); scheduler thread: "
        f"{report['submitter']}"
    )
    print(f"load: stress-ng {a['stress']} (--taskset {HOUSEKEEPING_CPU} in (3)/(4))")
    print(
        f"machine: {m['cpu_model']}, {m['cpus']} CPUs, kernel {m['kernel']}; isolated "
        f"CPUs: {m['isolated'] or 'none'}; IRQs with effective affinity on CPU "
        f"{INFERENCE_CPU}: {len(m['irqs_effective_on_inference_cpu'])}; loadavg "
        f"{report['loadavg_1min_start']} -> {report['loadavg_1min_end']}"
    )
    print()
    print("latency from the scheduled start, ms:")
    print(
        f"{'config':42} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'worst':>7} "
        f"{'p99-p50':>7} {'>period':>7}"
    )
    for row in report["summary"]["configs"].values():
        print(
            f"{row['label']:42} {row['p50_ms']:7.3f} {row['p99_ms']:7.3f} "
            f"{row['p999_ms']:7.3f} {row['max_ms']:7.3f} {row['max_ms_worst']:7.3f} "
            f"{row['spread_ms']:7.3f} {row['over_period']:>7}"
        )
    print(
        "(worst: the largest max of any round; >period: requests, all rounds, that finished "
        "after the next tick was due)"
    )
    print()
    print("parts (p50 / p99.9, ms) and intrusions on CPU 1 (per second):")
    print(
        f"{'config':42} {'wake-up':>13} {'queue':>13} {'compute':>13} {'irq/s':>7} "
        f"{'softirq/s':>9} {'invol cs/s':>10} {'irq ms/s':>8}"
    )
    for row in report["summary"]["configs"].values():
        pairs = [
            f"{row[part]['p50_ms']:.3f}/{row[part]['p999_ms']:.3f}"
            for part in ("wake", "queue", "compute")
        ]
        invol = row["worker_invol_per_s"]
        print(
            f"{row['label']:42} {pairs[0]:>13} {pairs[1]:>13} {pairs[2]:>13} "
            f"{row['irq_per_s']:7.1f} {row['softirq_per_s']:9.1f} "
            f"{'?' if invol is None else f'{invol:.2f}':>10} {row['irq_time_ms_per_s']:8.1f}"
        )
    print(
        "(wake-up: scheduler thread's lateness past the slot; queue/compute: edged's Timing; "
        "invol cs/s: the worker thread's involuntary context switches; irq ms/s: CPU 1 time "
        "in hard and soft interrupts, /proc/stat, sampled at the tick)"
    )
    for key, row in report["summary"]["configs"].items():
        top = row["top_irqs_rounds"][0]
        soft = row["top_softirqs_rounds"][0]
        print(
            f"  {key}: worker thread {report['workers'][key]}; CPU 1 top IRQs (round 1) "
            f"{top}; softirqs {soft}"
        )
    print()
    cyc = report.get("cyclictest")
    if cyc:
        print(f"cyclictest on CPU {INFERENCE_CPU} (µs; {a['cyclic_seconds']:g} s each, 1 kHz):")
        print(f"{'run':32} {'min':>6} {'avg':>6} {'p50':>6} {'p99':>6} {'p99.9':>6} {'max':>6}")
        for key, row in cyc.items():
            if "error" in row:
                print(f"{CYCLIC_RUNS[key][0]:32} failed: {row['error']}")
                continue
            print(
                f"{CYCLIC_RUNS[key][0]:32} "
                + " ".join(
                    f"{row.get(k) if row.get(k) is not None else '>' + str(HIST_US):>6}"
                    for k in ("min_us", "avg_us", "p50_us", "p99_us", "p999_us", "max_us")
                )
            )
        print()
    for target in report["summary"]["targets"]:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {target['figures']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="timed seconds per configuration per round"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hz", type=float, default=200.0, help="request rate (fixed period)")
    parser.add_argument(
        "--cyclic-seconds",
        type=float,
        help="seconds per cyclictest run (default: --seconds; 0 skips it)",
    )
    parser.add_argument(
        "--submit-on",
        choices=("inference", "housekeeping"),
        default="inference",
        help="CPU of the scheduler thread in the pinned configurations",
    )
    parser.add_argument(
        "--stress", default=STRESS, help=f"stress-ng stressors of the load (default: {STRESS!r})"
    )
    parser.add_argument(
        "--model", type=Path, help=f"model file (default {MODEL} from the test data)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not 0 < args.seconds <= 600 or not 1 <= args.hz <= 5000:
        parser.error("--rounds >= 1, --seconds in (0, 600], --hz in [1, 5000]")
    if args.cyclic_seconds is None:
        args.cyclic_seconds = args.seconds
    if shutil.which("stress-ng") is None:
        log("stress-ng is not installed (apt-get install stress-ng)")
        return 2
    if not {INFERENCE_CPU, HOUSEKEEPING_CPU} <= os.sched_getaffinity(0):
        parser.error(
            f"needs CPUs {HOUSEKEEPING_CPU} and {INFERENCE_CPU} in this process's affinity"
        )
    model = (args.model or models_dir() / MODEL).resolve()
    if not model.is_file():
        parser.error(f"no model at {model} (run scripts/fetch_test_data.py)")

    root = SysRoot()
    report: dict[str, Any] = {
        "benchmark": "jitter",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine_facts(root),
        "model": model.name,
        "loadavg_1min_start": benchlib.loadavg(),
        "submitter": (
            f"CPU {INFERENCE_CPU if args.submit_on == 'inference' else HOUSEKEEPING_CPU}"
            f" in (3)/(4), unpinned in (1)/(2)"
        ),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    submit_cpu = INFERENCE_CPU if args.submit_on == "inference" else HOUSEKEEPING_CPU
    workers: dict[str, ModelWorker] = {}
    try:
        feeds = None
        for key, setup in SETUPS.items():
            session = load_session(model, setup.pinned)
            if feeds is None:
                shapes = resolve_shapes(session.inputs, parse_shape_args([SHAPE]), model.name)
                feeds = make_inputs(session.inputs, shapes)
            batching = BatchingConfig(
                max_batch_size=1,
                max_queue_size=100_000,
                timeout_ms=600_000,
                rt_priority=RT_PRIORITY if setup.fifo else 0,
            )
            worker = ModelWorker(
                f"jit-{key[:8]}", session, batching, cpus=[INFERENCE_CPU] if setup.pinned else None
            )
            worker.start()
            workers[key] = worker
        log(f"warm-up: {WARMUP_S} s per worker")
        for key, worker in workers.items():
            segment(
                worker,
                feeds,
                args.hz,
                WARMUP_S,
                {submit_cpu} if SETUPS[key].pinned else None,
                root,
                record=False,
            )
        report["workers"] = {k: worker_thread_facts(w) for k, w in workers.items()}
        for key, facts in report["workers"].items():
            want = "fifo" if SETUPS[key].fifo else "other"
            if not facts["policy"].startswith(want):
                log(f"warning: {key}: worker thread runs {facts['policy']}, expected {want}")

        keys = list(SETUPS)
        rounds: list[dict[str, dict[str, Any]]] = []
        with tempfile.TemporaryDirectory(prefix="edged-bench-jitter-") as tmpname:
            tmp = Path(tmpname)
            for r in range(args.rounds):
                order = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate who goes first
                results: dict[str, dict[str, Any]] = {}
                for key in order:
                    setup = SETUPS[key]
                    with load_running(setup.load, args.seconds, tmp, args.stress) as load_info:
                        result = segment(
                            workers[key],
                            feeds,
                            args.hz,
                            args.seconds,
                            {submit_cpu} if setup.pinned else None,
                            root,
                        )
                    result["load"] = load_info
                    results[key] = result
                    intr = result["intrusions"]
                    log(
                        f"round {r + 1}/{args.rounds} {key}: p50 {result['p50_ms']:.3f} "
                        f"p99 {result['p99_ms']:.3f} p99.9 {result['p999_ms']:.3f} max "
                        f"{result['max_ms']:.3f} ms; CPU1 irq/s {intr['irq_per_s']:.0f}, "
                        f"softirq/s {intr['softirq_per_s']:.0f}, worker invol/s "
                        f"{intr['worker_invol_per_s'] or 0:.2f}; load {load_info}"
                    )
                rounds.append(results)
            report["summary"] = summarize(rounds)
            report["rounds"] = [
                {
                    k: {kk: vv for kk, vv in v.items() if kk != "latencies_ms"}
                    for k, v in rnd.items()
                }
                for rnd in rounds
            ]
            if args.cyclic_seconds > 0 and shutil.which("cyclictest"):
                report["cyclictest"] = {}
                for key, (label, where, fifo) in CYCLIC_RUNS.items():
                    log(f"cyclictest: {label}, {args.cyclic_seconds:g} s")
                    with load_running(where, args.cyclic_seconds, tmp, args.stress):
                        report["cyclictest"][key] = cyclictest(args.cyclic_seconds, fifo)
            elif args.cyclic_seconds > 0:
                log("cyclictest is not installed (apt-get install rt-tests); skipped")
    finally:
        for worker in workers.values():
            worker.stop(drain_s=1.0)
    report["loadavg_1min_end"] = benchlib.loadavg()
    if args.json:
        benchlib.write_json(report)
    else:
        print_report(report)
    return 1 if any(not t["pass"] for t in report["summary"]["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
