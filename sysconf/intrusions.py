"""Intrusion counters: what takes a core away from inference, as the kernel counts it.

Per CPU: interrupts (all rows of /proc/interrupts) and softirqs by kind (/proc/softirqs); per
thread: voluntary and involuntary context switches (/proc/<pid>/task/<tid>/status). All are
monotonic kernel counters; rates come from deltas (Prometheus' rate(), or `rates` here for
the jitter benchmark and telemetry windows).
"""

from __future__ import annotations

import itertools
import operator
import os
import time
from dataclasses import dataclass

from sysconf.irq import GLOBAL_COUNTERS
from sysconf.sysroot import SysRoot


def interrupts_per_cpu(root: SysRoot) -> dict[int, int]:
    """{cpu: interrupts so far}: the column sums of /proc/interrupts, without the system-wide
    ERR/MIS rows. Telemetry's sampler calls this 20 times a second, so it sums the count
    columns of each line directly instead of building sysconf.irq's full rows (chip, hwirq,
    trigger, actions): parsing went from ≈55 to ≈20 µs on the dev VM (the kernel takes
    ≈60 µs to produce the file); tests check both agree."""
    lines = (root.read_text("/proc/interrupts", "") or "").splitlines()
    if not lines:
        return {}
    cpus = [int(tok[3:]) for tok in lines[0].split() if tok.startswith("CPU") and tok[3:].isdigit()]
    totals = [0] * len(cpus)
    for line in lines[1:]:
        key, colon, rest = line.partition(":")
        key = key.strip()
        if not colon or not key or " " in key or key in GLOBAL_COUNTERS:
            continue
        for index, token in enumerate(rest.split(None, len(cpus))[: len(cpus)]):
            if not token.isdigit():
                break
            totals[index] += int(token)
    return dict(zip(cpus, totals, strict=True))


def softirqs_per_cpu(root: SysRoot) -> dict[int, dict[str, int]]:
    """{cpu: {"TIMER": n, "NET_RX": n, ...}} from /proc/softirqs."""
    text = root.read_text("/proc/softirqs", "") or ""
    lines = text.splitlines()
    if not lines:
        return {}
    cpus = [int(name[3:]) for name in lines[0].split() if name.startswith("CPU")]
    result: dict[int, dict[str, int]] = {cpu: {} for cpu in cpus}
    for line in lines[1:]:
        kind, _, counts = line.partition(":")
        for cpu, value in zip(cpus, counts.split(), strict=False):
            if value.isdigit():
                result[cpu][kind.strip()] = int(value)
    return result


@dataclass(frozen=True)
class Switches:
    voluntary: int
    involuntary: int  # preempted: something else wanted this core


def thread_switches(
    tid: int, pid: int | None = None, root: SysRoot | None = None
) -> Switches | None:
    """Context switches of one thread (None when it has ended)."""
    root = root or SysRoot()
    status = root.read_bytes(f"/proc/{pid or os.getpid()}/task/{tid}/status")
    if status is None:
        return None
    # The two lines only (they are the last ones): telemetry reads this every payload.
    _, found, rest = status.rpartition(b"\nvoluntary_ctxt_switches:")
    voluntary, _, rest = rest.partition(b"\n")
    _, found_too, rest = rest.partition(b"nonvoluntary_ctxt_switches:")
    involuntary = rest.split(b"\n", 1)[0]
    try:
        if found and found_too:
            return Switches(int(voluntary), int(involuntary))
    except ValueError:
        pass
    return None


def rates(before: dict[int, int], after: dict[int, int], seconds: float) -> dict[int, float]:
    """Per-second rates between two samples of a per-CPU counter."""
    return (
        {cpu: (after[cpu] - before.get(cpu, 0)) / seconds for cpu in after} if seconds > 0 else {}
    )


# -- read again and again: the attribution sampler ------------------------------------------


class CounterTable:
    """A per-CPU counter table (/proc/interrupts, /proc/softirqs) read many times a second.

    The file stays open on a live root (a pread from offset 0 makes procfs generate it anew:
    no open/close per read), and only the lines that changed since the last read are parsed;
    the per-CPU totals are updated from those. Between two reads 50 ms apart most rows do not
    move (the timer, a few IPIs and a device or two do), so the parsing cost follows what
    changed, not the size of the table: on a board with hundreds of IRQ rows the kernel's own
    formatting of the file is what is left. Rows are "KEY: n n n ... [text]"; the leading
    numeric columns up to the CPU count are counted (as `interrupts_per_cpu` does), rows
    named in `skip` (ERR, MIS: system-wide, not per CPU) are not."""

    def __init__(
        self, root: SysRoot, path: str, skip: frozenset[str] | set[str] = frozenset()
    ) -> None:
        self._file = root.path(path)
        self._keep_open = root.is_live  # a fixture file may be replaced: open it each time
        self._skip = {s.encode() for s in skip}
        self._fd: int | None = None
        self._size = 1 << 16
        self.cpus: list[int] = []
        self._lines: list[bytes] = []
        self._rows: list[tuple[str, list[int]] | None] = []
        self._totals: list[int] = []
        self.full_parses = 0  # for tests: how often the whole table was parsed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _read(self) -> bytes | None:
        try:
            if self._fd is None:
                self._fd = os.open(self._file, os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(self._fd, self._size, 0)
            while len(data) >= self._size:  # did not fit: read it whole with a larger buffer
                self._size *= 2
                data = os.pread(self._fd, self._size, 0)
        except OSError:
            self.close()
            return None
        if not self._keep_open:
            self.close()
        return data

    def read(self) -> bool:
        """Read the table again; False when it cannot be read (the last values stay)."""
        data = self._read()
        if data is None:
            return False
        lines = data.split(b"\n")
        old = self._lines
        if len(lines) != len(old) or not old or lines[0] != old[0]:
            self._parse_all(lines)
            return True
        rows, totals = self._rows, self._totals
        for index in itertools.compress(range(len(lines)), map(operator.ne, lines, old)):
            row = self._parse(lines[index])
            before = rows[index]
            if row is None and before is None:
                continue
            if (
                row is None
                or before is None
                or row[0] != before[0]
                or len(row[1]) != len(before[1])
            ):
                self._parse_all(lines)  # a row came or went: the layout moved
                return True
            for cpu_index, (n, was) in enumerate(zip(row[1], before[1], strict=True)):
                totals[cpu_index] += n - was
            rows[index] = row
        self._lines = lines
        return True

    def _parse_all(self, lines: list[bytes]) -> None:
        self.full_parses += 1
        header = lines[0].split() if lines else []
        self.cpus = [int(tok[3:]) for tok in header if tok.startswith(b"CPU") and tok[3:].isdigit()]
        self._rows = [None, *(self._parse(line) for line in lines[1:])]
        self._totals = [0] * len(self.cpus)
        for row in self._rows:
            if row is not None:
                for cpu_index, n in enumerate(row[1]):
                    self._totals[cpu_index] += n
        self._lines = lines

    def _parse(self, line: bytes) -> tuple[str, list[int]] | None:
        key, colon, rest = line.partition(b":")
        key = key.strip()
        if not colon or not key or b" " in key or key in self._skip or not self.cpus:
            return None
        counts = []
        for token in rest.split(None, len(self.cpus))[: len(self.cpus)]:
            if not token.isdigit():
                break
            counts.append(int(token))
        return key.decode(), counts

    def totals(self) -> dict[int, int]:
        """{cpu: sum of its column} (the last successful read)."""
        return dict(zip(self.cpus, self._totals, strict=True))

    def by_key(self, cpus: frozenset[int] | set[int] | None = None) -> dict[int, dict[str, int]]:
        """{cpu: {row key: count}} for `cpus` (None: all)."""
        result: dict[int, dict[str, int]] = {}
        for index, cpu in enumerate(self.cpus):
            if cpus is not None and cpu not in cpus:
                continue
            result[cpu] = {
                row[0]: row[1][index]
                for row in self._rows
                if row is not None and index < len(row[1])
            }
        return result


def interrupt_table(root: SysRoot) -> CounterTable:
    return CounterTable(root, "/proc/interrupts", GLOBAL_COUNTERS)


def softirq_table(root: SysRoot) -> CounterTable:
    return CounterTable(root, "/proc/softirqs")


# -- who ran on a core ------------------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MAX_TASKS = 20_000  # a scan reads at most this many threads' stat files


@dataclass(frozen=True)
class TaskTime:
    """One thread as /proc/<pid>/task/<tid>/stat shows it."""

    pid: int
    tid: int
    comm: str
    cpu: int  # field 39 `processor`: the CPU it last ran on
    ticks: int  # utime + stime (fields 14, 15), clock ticks
    started: int  # starttime (field 22), clock ticks after boot: tells a reused tid apart


@dataclass(frozen=True)
class TaskScan:
    t: float  # time.monotonic() when the scan began
    boot_ticks: int  # clock ticks since boot then (a thread started after it is new)
    tasks: dict[int, TaskTime]  # tid -> times
    truncated: bool = False  # MAX_TASKS reached: some threads were not read


def scan_tasks(root: SysRoot | None = None, limit: int = MAX_TASKS) -> TaskScan:
    """Every thread's CPU time, last CPU and name: one small read per thread (about 10 µs of
    Python each; a few hundred threads on a board). For telemetry, never the request path."""
    root = root or SysRoot()
    proc = root.path("/proc")
    t = time.monotonic()
    boot = int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLOCK_TICKS) if root.is_live else 0
    tasks: dict[int, TaskTime] = {}
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return TaskScan(t, boot, tasks)
    for pid in pids:
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue  # ended meanwhile, or not ours to look at
        for tid in tids:
            if len(tasks) >= limit:
                return TaskScan(t, boot, tasks, truncated=True)
            task = _task_time(f"{proc}/{pid}/task/{tid}/stat", int(pid))
            if task is not None:
                tasks[task.tid] = task
    return TaskScan(t, boot, tasks)


def _task_time(path: str, pid: int) -> TaskTime | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    head, _, tail = stat.rpartition(b")")  # comm may hold spaces and ')'
    tid, _, comm = head.partition(b" (")
    fields = tail.split()
    if len(fields) < 37 or not tid.isdigit():
        return None
    try:
        return TaskTime(
            pid,
            int(tid),
            comm.decode(errors="replace"),
            int(fields[36]),
            int(fields[11]) + int(fields[12]),
            int(fields[19]),
        )
    except ValueError:
        return None


def intruders(
    before: TaskScan,
    after: TaskScan,
    cpus: set[int] | frozenset[int],
    exclude: set[int] | frozenset[int] = frozenset(),
    top: int = 5,
) -> list[dict[str, object]]:
    """The threads that used CPU time between two scans and were last seen on one of `cpus`
    (most CPU first): {"comm", "pid", "tid", "cpu", "cpu_ms"}. `exclude`: tids not to name
    (the model's own worker). A thread that moved off those CPUs before the second scan, or
    ran and ended between the scans, is not seen; CPU times have the clock tick's
    resolution (10 ms at USER_HZ 100)."""
    found = []
    for tid, task in after.tasks.items():
        if task.cpu not in cpus or tid in exclude:
            continue
        old = before.tasks.get(tid)
        if old is not None and old.started == task.started:
            used = task.ticks - old.ticks
        elif old is None and task.started >= before.boot_ticks:
            used = task.ticks  # started after the first scan: all of it is in the span
        else:
            continue  # a reused tid or a thread the first scan missed: not comparable
        if used > 0:
            found.append((used, task))
    found.sort(key=lambda item: (-item[0], item[1].tid))
    return [
        {
            "comm": task.comm,
            "pid": task.pid,
            "tid": task.tid,
            "cpu": task.cpu,
            "cpu_ms": round(used * 1000 / CLOCK_TICKS, 1),
        }
        for used, task in found[:top]
    ]
