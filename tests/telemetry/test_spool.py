"""edged.telemetry.spool: order and ids, the size and age bounds and their drop counts, restarts,
kill -9 of a writing process, two threads at once, and files that are not a usable spool."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edged.telemetry.spool import Spool, SpoolError, SpoolItem

REPO = Path(__file__).resolve().parents[2]


class Clock:
    """A settable time.time() stand-in."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ids(spool: Spool) -> list[int]:
    return [item.id for item in spool.pending(limit=10_000)]


def test_append_pending_ack_in_order(tmp_path: Path) -> None:
    clock = Clock()
    with Spool(tmp_path / "spool.db", clock=clock) as spool:
        appended = []
        for i in range(10):
            clock.now += 1
            appended.append(spool.append(f"t/{i}", b"p%d" % i, qos=i % 2))
        assert appended == sorted(appended) and len(set(appended)) == 10
        items = spool.pending(limit=3)
        assert items == [
            SpoolItem(appended[i], f"t/{i}", b"p%d" % i, i % 2, 1_000_001.0 + i) for i in range(3)
        ]
        assert ids(spool) == appended
        # after_id pages on past items in flight, without acking them
        assert [i.id for i in spool.pending(limit=4, after_id=appended[2])] == appended[3:7]
        assert spool.pending(after_id=appended[-1]) == []
        for item_id in (appended[0], appended[5], appended[9]):
            spool.ack(item_id)
        spool.ack(appended[5])  # twice
        spool.ack(10**9)  # never existed
        left = [a for k, a in enumerate(appended) if k not in (0, 5, 9)]
        assert ids(spool) == left
        assert spool.stats() == {
            "count": 7,
            "bytes": sum(len(b"p%d" % k) for k in (1, 2, 3, 4, 6, 7, 8)),
            "oldest_created": 1_000_002.0,
            "dropped_total": 0,
        }


def test_ids_are_never_reused(tmp_path: Path) -> None:
    """Even when every item was acked and the file reopened: a publisher's after_id cursor
    must never skip a new item."""
    path = tmp_path / "spool.db"
    with Spool(path) as spool:
        last = [spool.append("t", b"x") for _ in range(5)][-1]
        for item_id in ids(spool):
            spool.ack(item_id)
        assert spool.stats()["count"] == 0 and spool.stats()["oldest_created"] is None
        assert spool.append("t", b"y") == last + 1
        spool.ack(last + 1)
    with Spool(path) as spool:
        assert spool.append("t", b"z") == last + 2


def test_size_bound_drops_oldest_first_and_counts(tmp_path: Path) -> None:
    with Spool(tmp_path / "spool.db", max_bytes=1000) as spool:
        a, b, c = (spool.append("t", bytes([k]) * 300) for k in range(3))
        assert spool.stats()["bytes"] == 900 and spool.take_dropped() == 0
        d = spool.append("t", b"d" * 100)  # exactly 1000: nothing dropped
        assert ids(spool) == [a, b, c, d] and spool.stats()["bytes"] == 1000
        e = spool.append("t", b"e" * 1)  # one byte over: the oldest goes
        assert ids(spool) == [b, c, d, e]
        f = spool.append("t", b"f" * 650)  # needs 551 more bytes: the two oldest go
        assert ids(spool) == [d, e, f]
        assert spool.stats() == {
            "count": 3,
            "bytes": 751,
            "oldest_created": spool.pending()[0].created,
            "dropped_total": 3,
        }
        g = spool.append("t", b"g" * 1000)  # a payload the size of the spool empties it
        assert ids(spool) == [g] and spool.stats()["bytes"] == 1000
        assert spool.take_dropped() == 6
        assert spool.take_dropped() == 0
        with pytest.raises(ValueError, match="larger than the whole spool"):
            spool.append("t", b"h" * 1001)
        assert ids(spool) == [g] and spool.stats()["dropped_total"] == 6


def test_age_bound_at_append_and_at_open(tmp_path: Path) -> None:
    clock = Clock(0.0)
    path = tmp_path / "spool.db"
    with Spool(path, max_age_s=100, clock=clock) as spool:
        a = spool.append("t", b"a")  # created 0
        clock.now = 10
        b = spool.append("t", b"b")
        clock.now = 20
        c = spool.append("t", b"c")
        clock.now = 100  # a is exactly max_age_s old: kept ("older than" drops)
        d = spool.append("t", b"d")
        assert ids(spool) == [a, b, c, d] and spool.take_dropped() == 0
        clock.now = 115  # a and b are older than 100 s now
        e = spool.append("t", b"e")
        assert ids(spool) == [c, d, e]
        assert spool.take_dropped() == 2
        assert spool.stats()["oldest_created"] == 20
        # pending and ack do not expire anything: only append and open do
        clock.now = 10_000
        assert ids(spool) == [c, d, e]
    clock.now = 1000  # reopened later: c, d, e (20, 100, 115) are all too old
    with Spool(path, max_age_s=100, clock=clock) as spool:
        assert ids(spool) == []
        assert spool.stats() == {"count": 0, "bytes": 0, "oldest_created": None, "dropped_total": 5}
        assert spool.take_dropped() == 3


def test_age_bound_follows_created_not_insertion_order(tmp_path: Path) -> None:
    """The wall clock may step back (NTP); an item stamped earlier still expires on time."""
    clock = Clock(500.0)
    with Spool(tmp_path / "spool.db", max_age_s=100, clock=clock) as spool:
        first = spool.append("t", b"a")
        clock.now = 300.0  # stepped back
        spool.append("t", b"b")
        clock.now = 450.0  # b is 150 s old, a is not yet
        last = spool.append("t", b"c")
        assert ids(spool) == [first, last] and spool.take_dropped() == 1


def test_take_dropped_resets_and_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    with Spool(path, max_bytes=10) as spool:
        for _ in range(4):
            spool.append("t", b"12345")  # keeps two; drops two
    with Spool(path, max_bytes=10) as spool:
        assert spool.stats()["dropped_total"] == 2
        assert spool.take_dropped() == 2
        spool.append("t", b"12345")  # drops one more
    with Spool(path, max_bytes=10) as spool:
        assert spool.take_dropped() == 1
        assert spool.take_dropped() == 0
    with Spool(path, max_bytes=10) as spool:
        assert spool.take_dropped() == 0
        assert spool.stats()["dropped_total"] == 3


def test_smaller_bound_at_reopen_applies_at_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    with Spool(path) as spool:
        first = [spool.append("t", b"x" * 100) for _ in range(10)]
    with Spool(path, max_bytes=300) as spool:
        assert spool.stats()["bytes"] == 1000  # nothing is dropped until there is news
        last = spool.append("t", b"y" * 100)
        assert ids(spool) == [*first[-2:], last] and spool.take_dropped() == 8


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        Spool(tmp_path / "a.db", max_bytes=0)
    with pytest.raises(ValueError, match="max_age_s"):
        Spool(tmp_path / "a.db", max_age_s=0)
    with Spool(tmp_path / "spool.db") as spool:
        with pytest.raises(ValueError, match="topic"):
            spool.append("", b"x")
        with pytest.raises(TypeError, match="bytes"):
            spool.append("t", "text")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="bytes"):
            spool.append("t", 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="qos"):
            spool.append("t", b"x", qos=3)
        with pytest.raises(ValueError, match="limit"):
            spool.pending(limit=0)
        assert spool.append("t", bytearray(b"ab")) > 0
        assert spool.pending()[0].payload == b"ab"
        assert spool.stats()["count"] == 1


def test_closed_spool_refuses_use(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    spool.close()
    spool.close()  # idempotent
    with pytest.raises(SpoolError, match=r"spool\.db: append on a closed spool"):
        spool.append("t", b"x")


def test_file_is_wal_with_our_application_id(tmp_path: Path) -> None:
    path = tmp_path / "state" / "spool.db"  # the folder is created
    with Spool(path) as spool:
        spool.append("t", b"x")
        other = sqlite3.connect(path)  # another process may read it meanwhile
        try:
            assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert other.execute("PRAGMA application_id").fetchone()[0] == 0x65646764
            assert other.execute("SELECT count(*) FROM items").fetchone()[0] == 1
        finally:
            other.close()


# -- files that are not a usable spool: refused, named, left as they were ----------------------


def refused(path: Path, match: str) -> str:
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(SpoolError) as info:
        Spool(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message
    assert match in message, message
    if before is not None:
        assert path.read_bytes() == before  # not deleted, not rewritten
    assert not Path(f"{path}-wal").exists()
    return message


def test_garbage_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    path.write_bytes(b"this is not sqlite\n" * 500)
    message = refused(path, "not a usable spool")
    assert "file is not a database" in message
    assert "-wal and -shm" in message and ".recover" in message  # what the operator does


def test_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    path.mkdir()
    refused(path, "is a directory")


def test_someone_elses_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE invoices (n INTEGER)")
    db.execute("INSERT INTO invoices VALUES (42)")
    db.commit()
    db.close()
    refused(path, "not an edged spool")
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    db.close()


def test_newer_spool_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    Spool(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=2")
    db.close()
    refused(path, "newer than this edged")


@pytest.mark.slow
def test_corrupt_spool_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    with Spool(path) as spool:
        for i in range(2000):
            spool.append("edged/v1/g/d/telemetry", b"%06d" % i * 50)
    size = path.stat().st_size
    assert size > 20 * 4096
    with path.open("r+b") as f:  # scribble over pages in the middle, not the header
        f.seek(10 * 4096)
        f.write(os.urandom(4 * 4096))
    refused(path, "not a usable spool")


# -- kill -9 and threads -------------------------------------------------------------------------

CHILD = """
import sys
from pathlib import Path
from edged.telemetry.spool import Spool

spool = Spool(Path(sys.argv[1]))
i = 0
while True:
    item_id = spool.append("edged/v1/g/d/telemetry", b"%08d" % i * 25)
    print("a", item_id, flush=True)  # only after append returned
    if item_id % 3 == 0:
        spool.ack(item_id)
        print("k", item_id, flush=True)
    i += 1
"""


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [150, 700, 1600])
@pytest.mark.integration
def test_kill_9_loses_no_appended_item(tmp_path: Path, kill_after: int) -> None:
    """A process appends (and acks a third) as fast as it can and is SIGKILLed mid-way:
    every id it printed after `append` returned is there, every id it acked is gone."""
    path = tmp_path / "spool.db"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while sum(line.startswith("a") for line in lines) < kill_after:
            line = child.stdout.readline()
            assert line, child.stderr.read() if child.stderr else "child exited"
            lines.append(line)
            assert time.monotonic() < deadline
        os.kill(child.pid, signal.SIGKILL)
        # What it printed before it died; read through the same buffered reader (communicate()
        # would read the pipe directly and miss what readline() has buffered already).
        lines += child.stdout.read().splitlines(keepends=True)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    # a line cut short by the kill was not printed (its number may be cut short too)
    parsed = [line.split() for line in lines if line.endswith("\n")]
    appended = [int(n) for tag, n in parsed if tag == "a"]
    acked = {int(n) for tag, n in parsed if tag == "k"}
    assert appended == sorted(appended) and len(appended) >= kill_after
    # it acks every id divisible by 3; the kill may have come between "a" and "k" of the last
    assert acked - {appended[-1]} == {n for n in appended[:-1] if n % 3 == 0}
    with Spool(path) as spool:
        present = ids(spool)
        # no acknowledged-then-lost item: every append that returned and was not acked is
        # there (the last one may have been acked when the kill came, before it said so)
        assert {n for n in appended if n % 3} <= set(present)
        assert not acked & set(present)  # a kill keeps acks too (committed, not fsync'd)
        # at most the one append that committed before the kill but was not printed yet
        extra = set(present) - set(appended)
        assert len(extra) <= 1 and all(n > appended[-1] for n in extra)
        assert spool.stats()["count"] == len(present)
        next_id = spool.append("t", b"after")
        assert next_id > max(present, default=0) and next_id > appended[-1]


@pytest.mark.slow
def test_one_thread_appends_while_another_drains(tmp_path: Path) -> None:
    total = 2000
    spool = Spool(tmp_path / "spool.db")
    appended: list[int] = []
    drained: list[SpoolItem] = []
    errors: list[BaseException] = []
    producer_done = threading.Event()

    def produce() -> None:
        try:
            for i in range(total):
                appended.append(spool.append("t", b"%d" % i))
        except BaseException as exc:
            errors.append(exc)
        finally:
            producer_done.set()

    def drain() -> None:
        # like the MQTT thread: pages on past the items in flight, acks each one
        last = 0
        deadline = time.monotonic() + 60
        try:
            while len(drained) < total and time.monotonic() < deadline and not errors:
                batch = spool.pending(limit=37, after_id=last)
                if not batch:
                    time.sleep(0.0005)
                    continue
                for item in batch:
                    drained.append(item)
                    spool.ack(item.id)
                    last = item.id
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce), threading.Thread(target=drain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    try:
        assert not errors, errors
        assert producer_done.is_set()
        got = [item.id for item in drained]
        assert got == appended  # nothing lost, nothing twice, in order
        assert [item.payload for item in drained] == [b"%d" % i for i in range(total)]
        assert spool.stats() == {"count": 0, "bytes": 0, "oldest_created": None, "dropped_total": 0}
    finally:
        spool.close()
