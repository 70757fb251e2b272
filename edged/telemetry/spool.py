"""Store-and-forward spool: telemetry and events wait here, on disk, until the broker has them.

Every payload is committed to a sqlite file in the state dir before it is published and is
deleted only when the broker acknowledges it (PUBACK), so nothing is lost while the broker is
away or when the daemon is killed. The spool is bounded, because a device's disk is small:

- size: the sum of the payload bytes (only the payloads: topics, ids, timestamps and sqlite's
  own page and index overhead come on top; `scripts/bench_spool.py` measures the file size).
  An append that would go over drops the oldest items (insertion order) first, the
  expendable ones before all others. An expendable item (an answer to a fleet command:
  anyone with publish rights to `cmd/#` can cause any number of them) only ever displaces
  older expendable items: when there is no room without dropping anything else, its append
  raises `SpoolFull` and nothing is dropped. So answers never cost telemetry a byte of the
  bound.
- age: items whose `created` is more than `max_age_s` before now are dropped, at open and at
  every append. Ages are kept on the spool's own clock, not the wall clock: CLOCK_BOOTTIME
  within a boot, continued across restarts from the value the file last recorded (meta
  `clock_us`). A board without a real-time clock boots in 1970 and jumps to today when NTP
  answers; on the wall clock that jump made everything spooled offline "decades old" and
  dropped it. On this clock the device's time powered off does not count, and only the
  time it ran does.

Dropped items are counted in the file itself (table `meta`), so the daemon can publish how
many were lost even when the drop happened before a restart.

Durability. The file is in WAL mode. An append commits with `synchronous=FULL`: the WAL is
fsync'd before `append` returns, so an appended item survives kill -9 and also a power cut
(on storage that honours flushes). Acks and the dropped-count reset commit with
`synchronous=NORMAL`: the WAL frames are written to the OS but not fsync'd. That survives
kill -9 of the process too (the kernel keeps what was written; nothing is lost unless the
machine itself goes down), and a power cut can only undo the acks made since the last
append (the next append's fsync covers every earlier frame of the WAL), so those items are
sent again: a duplicate, which QoS 1 allows anyway (subscribers drop it by `seq`), never a
loss. Fsync'ing every PUBACK would cap replay at one message per fsync: about 0.12 ms on the
benchmark VM, but commonly milliseconds on the SD cards and eMMC of edge boards, which is
below the 1,000 msg/s replay target (docs/BENCHMARKS.md, "Telemetry spool").

Threads: one connection shared under a lock (the telemetry producer appends, the MQTT thread
reads and acks; sqlite serialises writers anyway). One `Spool` per file per process: the
in-memory size totals assume no one else writes the file. Other processes may read it.

An unusable file (not a database, corrupt, someone else's database, a directory) raises
`SpoolError` naming the file; it is never deleted or rewritten. The operator's remedy, which
the message repeats: stop edged, move the file aside together with its `-wal` and `-shm`
companions (a stale WAL next to a new file would be replayed into it), start edged again
(it creates a new, empty spool), and salvage what is left of the old one if it matters with
`sqlite3 OLD.db .recover`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APPLICATION_ID = 0x65646764  # "edgd": `PRAGMA application_id`, so `file` and we can tell ours
SCHEMA_VERSION = 1  # `PRAGMA user_version`
# The bounds unless told otherwise; also the defaults of [telemetry.mqtt] spool_max_mb and
# spool_max_age_days (edged.config.schema.MqttSettings).
DEFAULT_MAX_BYTES = 50 * 2**20
DEFAULT_MAX_AGE_S = 7 * 86400.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- AUTOINCREMENT: ids are never reused, not even
    topic TEXT NOT NULL,                   -- after every item was acked and the table emptied
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    created REAL NOT NULL,
    expendable INTEGER NOT NULL DEFAULT 0  -- dropped first; see the module doc
);
-- the age bound by an index rather than by id order, so it holds whatever the clock did
CREATE INDEX IF NOT EXISTS items_created ON items (created);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('dropped_total', 0), ('dropped_unreported', 0);
"""
_OUR_TABLES = {"items", "meta", "sqlite_sequence"}
_REMEDY = (
    "stop edged, move the file and its -wal and -shm files aside, and start edged "
    "again (it creates a new, empty spool); `sqlite3 FILE .recover` salvages items"
)


@dataclass(frozen=True)
class SpoolItem:
    id: int  # monotonic insertion order
    topic: str
    payload: bytes
    qos: int
    created: float  # the spool's clock at append (Spool.now(): seconds, not wall time)


class SpoolError(RuntimeError):
    """The spool file cannot be used (corrupt, not a database, not ours, unwritable)."""


class SpoolFull(SpoolError):
    """An expendable item found no room that only expendable items held (module doc)."""


class Spool:
    """A bounded, durable FIFO of MQTT messages in one sqlite file."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`clock`: seconds for ages (tests); default the spool's own clock (module doc)."""
        if max_bytes <= 0:
            raise ValueError(f"spool max_bytes must be positive, got {max_bytes}")
        if not max_age_s > 0:
            raise ValueError(f"spool max_age_s must be positive, got {max_age_s}")
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.max_age_s = float(max_age_s)
        self._given_clock = clock
        self._clock_base = 0.0  # the spool clock's value at _clock_start (read at open)
        self._clock_start = _boottime()
        self._lock = threading.Lock()
        self._sync = ""  # the connection's current `synchronous` setting
        self._count = 0  # items in the file, and the sum of their payload sizes
        self._bytes = 0
        self._dropped_total = 0
        self._db: sqlite3.Connection | None = self._open()

    # -- opening ------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        if self.path.is_dir():
            raise SpoolError(
                f"{self.path}: is a directory, not a spool file; move it aside "
                "or point the state dir elsewhere"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"{self.path}: cannot create its folder: {exc}") from exc
        created = not self.path.exists() or self.path.stat().st_size == 0
        try:
            db = sqlite3.connect(
                self.path, timeout=5.0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise SpoolError(f"{self.path}: cannot open: {exc}") from exc
        try:
            self._init(db)
        except sqlite3.Error as exc:
            db.close()
            name = getattr(exc, "sqlite_errorname", None)
            if name is None or name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")):
                raise SpoolError(f"{self.path}: not a usable spool ({exc}): {_REMEDY}") from exc
            # permissions, read-only or full file system, locked: the file itself may be fine
            raise SpoolError(f"{self.path}: cannot open the spool: {exc} ({name})") from exc
        except BaseException:
            db.close()
            raise
        if created:  # the new file's directory entry, so a power cut cannot take the file
            _fsync_dir(self.path.parent)
        return db

    def _init(self, db: sqlite3.Connection) -> None:
        # Read before writing anything: a garbage file fails here ("file is not a database"),
        # and someone else's database is refused before we switch it to WAL.
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if app_id not in (0, APPLICATION_ID) or (tables and not tables <= _OUR_TABLES):
            raise SpoolError(
                f"{self.path}: a sqlite database but not an edged spool "
                f"(application_id {app_id:#x}, tables {sorted(tables)}); "
                "point the state dir elsewhere or move the file aside"
            )
        if version > SCHEMA_VERSION:
            raise SpoolError(
                f"{self.path}: spool format {version} is newer than this edged "
                f"understands ({SCHEMA_VERSION}); upgrade edged or move it aside"
            )
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise SpoolError(f"{self.path}: the file system refused WAL mode (got {mode!r})")
        db.execute("PRAGMA journal_size_limit=8388608")  # shrink a grown WAL after checkpoints
        if version == 0:
            # One transaction (idempotent, should two processes create the file at once).
            self._set_sync(db, "FULL")
            db.executescript(
                f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA application_id={APPLICATION_ID};"
                f"PRAGMA user_version={SCHEMA_VERSION};COMMIT;"
            )
        if "expendable" not in {r[1] for r in db.execute("PRAGMA table_info(items)")}:
            # A file from before expendable items. A column with a default is all it needs
            # (an older edged names the columns it writes, so it can still use the file).
            db.executescript(
                "BEGIN IMMEDIATE;"
                "ALTER TABLE items ADD COLUMN expendable INTEGER NOT NULL DEFAULT 0;COMMIT;"
            )
        db.execute("CREATE INDEX IF NOT EXISTS items_expendable ON items (id) WHERE expendable")
        # A corrupt page would otherwise surface mid-run, in some later append; quick_check
        # reads every page once (the benchmark measures what that costs at open).
        problems = [r[0] for r in db.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(problems))
        self._count, self._bytes = db.execute(
            "SELECT count(*), coalesce(sum(length(payload)), 0) FROM items"
        ).fetchone()
        self._dropped_total = self._meta(db, "dropped_total")
        row = db.execute("SELECT value FROM meta WHERE key = 'clock_us'").fetchone()
        if row is not None:
            self._clock_base = row[0] / 1e6
        else:  # a new file, or one from before this clock: continue from its newest item
            newest = db.execute("SELECT max(created) FROM items").fetchone()[0]
            self._clock_base = float(newest or 0.0)
        self._clock_start = _boottime()
        self._write(db, durable=True, body=lambda: self._drop_expired(db, self._clock()))

    def now(self) -> float:
        """The spool's clock: what `created` is measured in."""
        return self._clock()

    def _clock(self) -> float:
        if self._given_clock is not None:
            return self._given_clock()
        return self._clock_base + (_boottime() - self._clock_start)

    # -- the API ------------------------------------------------------------------------------

    def append(self, topic: str, payload: bytes, qos: int = 1, *, expendable: bool = False) -> int:
        """Commit one message durably (fsync'd) and return its id; the caller publishes after.

        Makes room by dropping the oldest items first (expendable ones before the others),
        and drops expired ones. An `expendable` item displaces only older expendable items:
        SpoolFull (nothing dropped, nothing added) when that leaves no room."""
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"spool topic must be a non-empty string, got {topic!r}")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"spool payload must be bytes, got {type(payload).__name__}")
        if qos not in (0, 1, 2):
            raise ValueError(f"spool qos must be 0, 1 or 2, got {qos!r}")
        payload = bytes(payload)
        if len(payload) > self.max_bytes:
            raise ValueError(
                f"payload of {len(payload)} bytes is larger than the whole spool "
                f"({self.max_bytes} bytes)"
            )
        with self._guard("append") as db:
            now = self._clock()

            def body() -> int:
                self._drop_expired(db, now)
                excess = self._bytes + len(payload) - self.max_bytes
                if expendable and excess > self._expendable_bytes(db):
                    raise SpoolFull(
                        f"{self.path}: no room for an expendable item of {len(payload)} bytes "
                        "without dropping telemetry or events"
                    )
                self._drop_oldest(db, excess)
                cur = db.execute(
                    "INSERT INTO items (topic, payload, qos, created, expendable) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (topic, payload, qos, now, int(expendable)),
                )
                db.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('clock_us', ?)",
                    (int(now * 1e6),),
                )
                self._count += 1
                self._bytes += len(payload)
                rowid = cur.lastrowid
                assert rowid is not None  # an INSERT sets it
                return rowid

            return self._write(db, durable=True, body=body)

    def pending(self, limit: int = 100, after_id: int = 0) -> list[SpoolItem]:
        """Up to `limit` items with an id above `after_id`, oldest first."""
        if limit < 1:
            raise ValueError(f"pending limit must be at least 1, got {limit}")
        with self._guard("pending") as db:
            rows = db.execute(
                "SELECT id, topic, payload, qos, created FROM items WHERE id > ? "
                "ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
        return [SpoolItem(*row) for row in rows]

    def ack(self, item_id: int) -> None:
        """Delete an item the broker has (PUBACK); an unknown or already acked id is a no-op."""
        with self._guard("ack") as db:
            row = db.execute(
                "SELECT length(payload) FROM items WHERE id = ?", (item_id,)
            ).fetchone()
            if row is None:
                return

            def body() -> None:
                db.execute("DELETE FROM items WHERE id = ?", (item_id,))
                self._count -= 1
                self._bytes -= row[0]

            # Not fsync'd: see the module docstring (a lost ack only means a re-send).
            self._write(db, durable=False, body=body)

    def take_dropped(self) -> int:
        """How many items the bounds dropped since the last call (persisted across restarts)."""
        with self._guard("take_dropped") as db:
            count = self._meta(db, "dropped_unreported")
            if count:
                # Not fsync'd: the caller reports the count in an event it appends, and that
                # append's fsync makes this reset durable too; if power goes before it, the
                # event is gone as well and the count is rightly reported again.
                self._write(
                    db,
                    durable=False,
                    body=lambda: db.execute(
                        "UPDATE meta SET value = 0 WHERE key = 'dropped_unreported'"
                    ),
                )
            return count

    def stats(self) -> dict[str, Any]:
        """{"count", "bytes" (payload bytes), "oldest_created" (None when empty),
        "dropped_total" (ever, across restarts)}."""
        with self._guard("stats") as db:
            oldest = db.execute("SELECT min(created) FROM items").fetchone()[0]
            return {
                "count": self._count,
                "bytes": self._bytes,
                "oldest_created": oldest,
                "dropped_total": self._dropped_total,
            }

    def close(self) -> None:
        """Close the file (idempotent); later calls raise SpoolError."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (called with the lock held) ------------------------------------------------

    @contextmanager
    def _guard(self, op: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._db is None:
                raise SpoolError(f"{self.path}: {op} on a closed spool")
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise SpoolError(f"{self.path}: {op} failed: {exc}") from exc

    def _write(self, db: sqlite3.Connection, durable: bool, body: Callable[[], Any]) -> Any:
        """Run `body` in one write transaction; on failure roll back, totals included."""
        self._set_sync(db, "FULL" if durable else "NORMAL")
        saved = (self._count, self._bytes, self._dropped_total)
        db.execute("BEGIN IMMEDIATE")
        try:
            result = body()
            db.execute("COMMIT")
        except BaseException:
            self._count, self._bytes, self._dropped_total = saved
            if db.in_transaction:
                with suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise
        return result

    def _set_sync(self, db: sqlite3.Connection, level: str) -> None:
        # Per connection, changeable between transactions; applies at the next commit.
        if self._sync != level:
            db.execute(f"PRAGMA synchronous={level}")
            self._sync = level

    def _drop_expired(self, db: sqlite3.Connection, now: float) -> None:
        cutoff = now - self.max_age_s  # older than max_age_s: created < cutoff
        count, size = db.execute(
            "SELECT count(*), coalesce(sum(length(payload)), 0) FROM items WHERE created < ?",
            (cutoff,),
        ).fetchone()
        if count:
            db.execute("DELETE FROM items WHERE created < ?", (cutoff,))
            self._dropped(db, count, size)

    @staticmethod
    def _expendable_bytes(db: sqlite3.Connection) -> int:
        # Few rows (answers are rate-limited, and acked within moments), by a partial index.
        return db.execute(
            "SELECT coalesce(sum(length(payload)), 0) FROM items WHERE expendable"
        ).fetchone()[0]

    def _drop_oldest(self, db: sqlite3.Connection, excess: int) -> None:
        """Drop the oldest items until at least `excess` payload bytes are freed: the
        expendable ones first, then (only once none is left) the others."""
        if excess > 0:
            freed = self._drop_range(db, excess, "expendable AND ")
            if freed < excess:
                self._drop_range(db, excess - freed, "")

    def _drop_range(self, db: sqlite3.Connection, excess: int, which: str) -> int:
        """Drop the oldest items matching `which` (an SQL condition and "AND ", or "")
        until at least `excess` payload bytes are freed; returns the bytes freed."""
        freed = count = 0
        last = 0
        while freed < excess:
            rows = db.execute(
                f"SELECT id, length(payload) FROM items WHERE {which}id > ? ORDER BY id LIMIT 256",
                (last,),
            ).fetchall()
            if not rows:
                break
            for item_id, size in rows:
                last = item_id  # the boundary of the delete
                freed += size
                count += 1
                if freed >= excess:
                    break
        if count:
            db.execute(f"DELETE FROM items WHERE {which}id <= ?", (last,))
            self._dropped(db, count, freed)
        return freed

    def _dropped(self, db: sqlite3.Connection, count: int, size: int) -> None:
        db.execute(
            "UPDATE meta SET value = value + ? WHERE key IN "
            "('dropped_total', 'dropped_unreported')",
            (count,),
        )
        self._count -= count
        self._bytes -= size
        self._dropped_total += count

    @staticmethod
    def _meta(db: sqlite3.Connection, key: str) -> int:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else 0


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with suppress(OSError):  # some file systems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def _boottime() -> float:
    """Seconds since boot, suspend included, never set by anyone (unlike the wall clock)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)
