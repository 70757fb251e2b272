"""Intrusion counters on this machine's real /proc and on board-like roots."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from roots import board_root, snapshot_live

from sysconf import SysRoot
from sysconf.intrusions import interrupts_per_cpu, rates, softirqs_per_cpu, thread_switches
from sysconf.irq import read_interrupts


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
        assert totals[cpu] == sum(r.counts[index] for r in rows
                                  if len(r.counts) == len(cpus))  # ERR:/MIS: are global


def test_board_root(tmp_path: Path) -> None:
    root = SysRoot(board_root(tmp_path / "board", cpus=6))
    totals = interrupts_per_cpu(root)
    assert sorted(totals) == list(range(6))
    cpus, rows = read_interrupts(root)  # the full parser's column sums
    assert totals == {cpu: sum(r.counts[i] for r in rows if r.irq not in ("ERR", "MIS")
                               and i < len(r.counts)) for i, cpu in enumerate(cpus)}
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
