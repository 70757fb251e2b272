"""A thread's CPU affinity as a journal change: the one change that is not a file's content.

No file under /proc takes a thread's affinity; sched_setaffinity(2) does. So a change of kind
AFFINITY names the thread by its /proc path (`/proc/<pid>/task/<tid>`), holds its affinity as
a CPU list ("0-2") in `old` and `new`, and the journal records the thread's start time with
it: a thread id the kernel gave to a new thread since (the intruder ended) is never moved back
by a revert, and neither is one moved by a recorded plan it no longer matches.

Threads are live things: whatever root the journal acts in (a test's temporary root, where
the files are fixtures), a task change acts on this machine's threads through the live /proc.
A journal from an older boot drops it (its threads are gone) as it drops every /proc value.
Moving another user's thread needs CAP_SYS_NICE (edged.service grants it)."""

from __future__ import annotations

import os
import re

from sysconf.cpulist import format_cpulist, parse_cpulist

KIND = "affinity"
_PATH = re.compile(r"/proc/(\d+)/task/(\d+)")


class TaskGone(LookupError):
    """The thread ended, or its id now names another thread."""


def task_path(pid: int, tid: int) -> str:
    return f"/proc/{pid}/task/{tid}"


def parse_task_path(path: str) -> tuple[int, int]:
    """(pid, tid) of a task change's path; ValueError naming the path otherwise."""
    match = _PATH.fullmatch(path)
    if match is None:
        raise ValueError(f"{path!r} is not a thread's path (/proc/PID/task/TID)")
    return int(match.group(1)), int(match.group(2))


def start_time(pid: int, tid: int) -> int | None:
    """The thread's start time (field 22 of its stat, clock ticks after boot), None if gone.
    Read here, not through sysconf.intrusions' stat reader: that module reaches the journal
    (through sysconf.irq), which imports this one."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(b")")[2].split()  # comm may hold spaces and ')'
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def is_kernel_thread(pid: int) -> bool:
    """A kernel thread (kthreadd's children): many are per-CPU (ksoftirqd/N, kworker/N:M) and
    refuse a move; the rest belong to the workqueue mask, not to sched_setaffinity."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[1]) == 2 or pid == 2  # ppid kthreadd
    except (OSError, IndexError, ValueError):
        return False


def current(pid: int, tid: int) -> tuple[str, int]:
    """(affinity as a CPU list, start time) of the thread; TaskGone if it is not there."""
    started = start_time(pid, tid)
    if started is None:
        raise TaskGone(f"thread {tid} of process {pid} is gone")
    try:
        cpus = os.sched_getaffinity(tid)
    except ProcessLookupError:
        raise TaskGone(f"thread {tid} of process {pid} is gone") from None
    return format_cpulist(cpus), started


def move(pid: int, tid: int, cpus: str, started: int | None) -> None:
    """Set the thread's affinity to `cpus` if it is still the thread started at `started`
    (TaskGone otherwise); OSError as sched_setaffinity raises it (EPERM, EINVAL)."""
    if started is not None and start_time(pid, tid) != started:
        raise TaskGone(f"thread {tid} of process {pid} is gone (its id names another thread)")
    try:
        os.sched_setaffinity(tid, parse_cpulist(cpus))
    except ProcessLookupError:
        raise TaskGone(f"thread {tid} of process {pid} is gone") from None


def is_task(path: str) -> bool:
    return _PATH.fullmatch(path) is not None


def same_cpus(a: str, b: str) -> bool:
    try:
        return parse_cpulist(a) == parse_cpulist(b)
    except ValueError:
        return False


def revert_record(record: dict) -> str:
    """Put a journal record's thread back on its old CPUs: "restored", or why not."""
    try:
        pid, tid = parse_task_path(record["path"])
        move(pid, tid, record["old"], record.get("started"))
    except TaskGone:
        return "gone: the thread ended"
    except (ValueError, OSError) as exc:
        return f"failed: {getattr(exc, 'strerror', None) or exc}"
    return "restored"
