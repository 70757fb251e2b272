"""Intrusion counters on this machine's real /proc and on board-like roots."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sysconf import SysRoot
from sysconf.intrusions import (
    TaskScan,
    TaskTime,
    interrupt_table,
    interrupts_per_cpu,
    intruders,
    rates,
    scan_tasks,
    softirq_table,
    softirqs_per_cpu,
    thread_switches,
)
from sysconf.irq import read_interrupts
from tests.support.roots import (
    board,
    board_root,
    format_interrupts,
    grown_board,
    snapshot_live,
)


def test_live_counters_grow() -> None:
    root = SysRoot()
    before = interrupts_per_cpu(root)
    soft_before = softirqs_per_cpu(root)
    time.sleep(0.3)
    after = interrupts_per_cpu(root)
    assert set(after) == set(before) and len(after) >= 1
    assert sum(after.values()) > sum(before.values())  # the timer alone ticks
    assert all(after[cpu] >= before[cpu] for cpu in after)
    soft = softirqs_per_cpu(root)
    assert "TIMER" in soft[0] and soft[0]["TIMER"] >= soft_before[0]["TIMER"]
    per_second = rates(before, after, 0.3)
    assert all(value >= 0 for value in per_second.values())


def test_totals_are_the_column_sums(tmp_path: Path) -> None:
    root = SysRoot(snapshot_live(tmp_path / "live"))
    cpus, rows = read_interrupts(root)
    totals = interrupts_per_cpu(root)
    for index, cpu in enumerate(cpus):
        assert totals[cpu] == sum(
            r.counts[index] for r in rows if len(r.counts) == len(cpus)
        )  # ERR:/MIS: are global


def test_board_root(tmp_path: Path) -> None:
    root = SysRoot(board_root(tmp_path / "board", cpus=6))
    totals = interrupts_per_cpu(root)
    assert sorted(totals) == list(range(6))
    cpus, rows = read_interrupts(root)  # the full parser's column sums
    assert totals == {
        cpu: sum(r.counts[i] for r in rows if r.irq not in ("ERR", "MIS") and i < len(r.counts))
        for i, cpu in enumerate(cpus)
    }
    assert sum(totals.values()) > 0
    soft = softirqs_per_cpu(root)
    assert sorted(soft) == list(range(6)) and "NET_RX" in soft[0]


def test_thread_switches_of_a_busy_thread() -> None:
    ids: list[int] = []
    stop = threading.Event()

    def spin() -> None:
        ids.append(threading.get_native_id())
        while not stop.is_set():
            time.sleep(0.001)  # each sleep is a voluntary switch

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.2)
    counts = thread_switches(ids[0])
    stop.set()
    thread.join()
    assert counts is not None and counts.voluntary > 10
    assert thread_switches(2**30) is None


# -- the sampler's incremental readers ---------------------------------------------------------


def test_counter_tables_agree_with_the_full_parsers_live() -> None:
    root = SysRoot()
    irqs, soft = interrupt_table(root), softirq_table(root)
    try:
        for _ in range(5):  # between a full parse just before and one just after
            low, soft_low = interrupts_per_cpu(root), softirqs_per_cpu(root)
            assert irqs.read() and soft.read()
            high, soft_high = interrupts_per_cpu(root), softirqs_per_cpu(root)
            assert set(irqs.totals()) == set(low)
            assert all(low[cpu] <= n <= high[cpu] for cpu, n in irqs.totals().items())
            for cpu, kinds in soft.by_key().items():
                assert set(kinds) == set(soft_low[cpu])
                assert all(soft_low[cpu][k] <= n <= soft_high[cpu][k] for k, n in kinds.items())
            time.sleep(0.02)
        assert irqs.full_parses == 1 and soft.full_parses == 1  # then only changed rows
        assert set(soft.by_key({0})) == {0}
    finally:
        irqs.close()
        soft.close()


def test_counter_table_follows_changed_rows_and_layouts(tmp_path: Path) -> None:
    b = board(6)
    root = SysRoot(board_root(tmp_path / "board", cpus=6))
    path = root.path("/proc/interrupts")
    path.chmod(0o644)
    table = interrupt_table(root)
    assert table.read() and table.totals() == interrupts_per_cpu(root)
    for step in range(3):  # one device row and the timer move, as between two samples
        b.irqs[0].counts[2] += 7 + step
        b.irqs[5].counts[0] += 1
        path.write_text(format_interrupts(b))
        assert table.read() and table.totals() == interrupts_per_cpu(root)
    assert table.full_parses == 1
    b.irqs.pop(3)  # an IRQ freed: the rows shift
    path.write_text(format_interrupts(b))
    assert table.read() and table.totals() == interrupts_per_cpu(root)
    assert table.full_parses == 2
    last = table.totals()
    path.unlink()
    assert not table.read()  # unreadable: False, the last totals stay
    assert table.totals() == last


def test_sampler_read_cost_on_a_board_sized_table(tmp_path: Path) -> None:
    """The RK3588-like fixture (8 CPUs, 39 rows) and the same board with 300 rows, the size
    of a real board's /proc/interrupts: a full parse, and a re-read where 3 rows changed."""
    for rows in (0, 300):
        b = grown_board(8, rows)
        root = SysRoot(board_root(tmp_path / f"b{rows}", cpus=8))
        path = root.path("/proc/interrupts")
        path.chmod(0o644)
        path.write_text(format_interrupts(b))
        lines = len(path.read_text().splitlines())
        full, changed = [], []
        for _ in range(30):
            table = interrupt_table(root)
            t0 = time.perf_counter()
            table.read()
            full.append(time.perf_counter() - t0)
            for irq in (b.irqs[0], b.irqs[7], b.irqs[-1]):
                irq.counts[3] += 1
            path.write_text(format_interrupts(b))
            t0 = time.perf_counter()
            table.read()
            changed.append(time.perf_counter() - t0)
            assert table.totals() == interrupts_per_cpu(root)
            assert table.full_parses == 1
        print(
            f"\n/proc/interrupts of {lines} lines, 8 CPUs: full parse "
            f"{statistics.median(full) * 1e6:.0f} µs, 3 rows changed "
            f"{statistics.median(changed) * 1e6:.0f} µs (file read included)"
        )
        # The speed itself is scripts/bench_telemetry_cpu.py's (figures in BENCHMARKS.md).


# -- who ran on a core ----------------------------------------------------------------------------


def _task(tid: int, cpu: int, ticks: int, started: int = 100, comm: str = "t") -> TaskTime:
    return TaskTime(tid, tid, comm, cpu, ticks, started)


def test_intruders_between_two_scans() -> None:
    before = TaskScan(
        0.0,
        1000,
        {
            1: _task(1, 3, 50),
            2: _task(2, 3, 10),
            3: _task(3, 0, 5),
            4: _task(4, 3, 7, started=100),
            9: _task(9, 3, 0),
        },
    )
    after = TaskScan(
        1.0,
        1100,
        {
            1: _task(1, 3, 150, comm="hog"),  # 100 ticks on CPU 3
            2: _task(2, 3, 10),  # idle
            3: _task(3, 0, 400),  # busy, elsewhere
            4: _task(4, 3, 9, started=1050, comm="reused"),  # a new thread with an old tid
            5: _task(5, 3, 4, started=1010, comm="new"),  # started after the first scan
            6: _task(6, 3, 80, started=900, comm="missed"),  # existed, not in the first scan
            9: _task(9, 3, 30, comm="worker"),
        },
    )
    found = intruders(before, after, {3}, exclude={9})
    from sysconf.intrusions import CLOCK_TICKS

    assert [(t["comm"], t["cpu_ms"]) for t in found] == [
        ("hog", 100 * 1000 / CLOCK_TICKS),
        ("new", 4 * 1000 / CLOCK_TICKS),
    ]
    assert found[0] == {
        "comm": "hog",
        "pid": 1,
        "tid": 1,
        "cpu": 3,
        "cpu_ms": 100 * 1000 / CLOCK_TICKS,
    }
    assert intruders(before, after, {3}, top=1)[0]["comm"] == "hog"
    assert intruders(before, after, {7}) == []


@pytest.mark.needs_cpus(2, reason="to pin a hog")
def test_a_pinned_busy_process_is_found_on_its_core() -> None:
    cpu = max(os.sched_getaffinity(0))
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, time
os.sched_setaffinity(0, {{{cpu}}})
end = time.monotonic() + 30
while time.monotonic() < end:
    pass
""",
        ]
    )
    try:
        time.sleep(0.2)
        t0 = time.perf_counter()
        before = scan_tasks()
        scan_s = time.perf_counter() - t0
        time.sleep(0.5)
        after = scan_tasks()
    finally:
        hog.kill()
        hog.wait()
    print(f"\nscan of {len(before.tasks)} threads: {scan_s * 1e3:.1f} ms")
    assert not before.truncated and len(before.tasks) > 1
    assert before.tasks[threading.get_native_id()].pid == os.getpid()
    found = intruders(before, after, {cpu}, top=100)
    # The hog is among them, on its core; on a shared machine another busy process may rank
    # above it (the list is every intruder, busiest first).
    hogs = [f for f in found if f["pid"] == hog.pid]
    assert hogs and hogs[0]["cpu"] == cpu, found
    assert hogs[0]["cpu_ms"] >= 100  # of 500 ms, even when sharing the core
    assert [f["cpu_ms"] for f in found] == sorted((f["cpu_ms"] for f in found), reverse=True)
    assert scan_tasks(limit=3).truncated
