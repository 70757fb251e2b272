"""The journal's one change that is not a file: a thread's CPU affinity, on threads this
test starts (never another process of the machine); and undoing only the last apply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sysconf.change_records import Change
from sysconf.changes import Journal
from sysconf.sysroot import SysRoot
from sysconf.task_affinity import task_path
from tests.support.roots import tree_state

CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; os.sched_setaffinity(0, {{{CPUS[-1]}}}); time.sleep(60)",
        ]
    )
    try:
        while os.sched_getaffinity(proc.pid) != {CPUS[-1]}:
            pass
        yield proc
    finally:
        proc.kill()
        proc.wait()


def journal(tmp_path: Path) -> Journal:
    return Journal(SysRoot.at(tmp_path), "/var/lib/edged")


@pytest.mark.needs_cpus(2, reason="a thread moves from one CPU to another")
def test_a_thread_is_moved_and_moved_back(tmp_path: Path, sleeper) -> None:
    path = task_path(sleeper.pid, sleeper.pid)
    j = journal(tmp_path)
    result = j.apply([Change("affinity", path, str(CPUS[-1]), str(CPUS[0]), "test")])
    assert [c.path for c in result.applied] == [path]
    assert os.sched_getaffinity(sleeper.pid) == {CPUS[0]}
    (record,) = [r for r in j.records() if r["op"] == "set"]
    assert record["old"] == str(CPUS[-1]) and record["kind"] == "affinity" and record["started"]
    again = j.apply([Change("affinity", path, str(CPUS[0]), str(CPUS[0]), "test")])
    assert again.unchanged and not again.applied
    assert j.revert() == [(path, "restored")]
    assert os.sched_getaffinity(sleeper.pid) == {CPUS[-1]}


@pytest.mark.needs_cpus(2, reason="a thread moves from one CPU to another")
def test_a_thread_gone_or_replaced_is_never_moved_back(tmp_path: Path, sleeper) -> None:
    path = task_path(sleeper.pid, sleeper.pid)
    j = journal(tmp_path)
    j.apply([Change("affinity", path, None, str(CPUS[0]), "test")])
    # Its id given to another thread: the start time differs, so revert leaves it alone.
    text = j.path.read_text().replace('"started": ', '"started": 1')
    j.path.write_text(text)
    assert j.revert() == [(path, "gone: the thread ended")]
    assert os.sched_getaffinity(sleeper.pid) == {CPUS[0]}
    sleeper.kill()
    sleeper.wait()
    j.apply([Change("affinity", path, None, str(CPUS[0]), "test")])
    skipped = j.apply([Change("affinity", "/proc/self/status", None, "0", "test")]).skipped
    assert "is not a thread's path" in skipped[0][1]


def test_undo_last_takes_back_one_apply_and_revert_the_rest(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / "etc").mkdir(exist_ok=True)
        (tmp_path / "etc" / name).write_text(f"{name} 0\n")
    before = tree_state(tmp_path)
    j = journal(tmp_path)
    j.apply([Change("sysctl", "/etc/a", None, "a 1\n", "first")])
    j.apply([Change("sysctl", "/etc/b", None, "b 1\n", "second")])
    j.apply([Change("sysctl", "/etc/new/c", None, "c\n", "third, in a new folder")])
    assert j.undo_last() == [("/etc/new/c", "removed"), ("/etc/new", "removed")]
    assert j.undo_last() == [("/etc/b", "restored")]
    assert (tmp_path / "etc/a").read_text() == "a 1\n" and (
        tmp_path / "etc/b"
    ).read_text() == "b 0\n"
    assert j.revert() == [("/etc/a", "restored")]  # the undone ones are not done twice
    assert tree_state(tmp_path) == before
    assert journal(tmp_path).undo_last() == []  # nothing left
