"""The spool under a wall clock that jumps: a board without a real-time clock boots in 1970
and jumps to today when NTP answers. What it spooled offline before the jump is all kept
(on the wall clock, it was "56 years old" and dropped at the next append)."""

from __future__ import annotations

import time
from pathlib import Path

from edged.telemetry.spool import Spool

TODAY = 1_796_000_000.0  # late 2026


def test_a_forward_jump_of_the_wall_clock_drops_nothing(tmp_path: Path, monkeypatch) -> None:
    wall = [100.0]  # 1970-01-01 00:01:40: booted without an RTC
    monkeypatch.setattr(time, "time", lambda: wall[0])
    path = tmp_path / "spool.db"
    with Spool(path, max_age_s=7 * 86400) as spool:
        for i in range(10):
            spool.append("edged/v1/g/d/telemetry", b'{"i":%d}' % i)
        wall[0] = TODAY  # NTP answers
        spool.append("edged/v1/g/d/telemetry", b'{"i":10}')
        assert len(spool.pending(limit=100)) == 11
    with Spool(path, max_age_s=7 * 86400) as again:  # and after a restart at the new time
        assert [item.id for item in again.pending(limit=100)] == list(range(1, 12))


def test_ages_continue_across_restarts(tmp_path: Path) -> None:
    """The clock goes on from what the file recorded: an item's age is not reset by a
    restart, so the age bound still holds."""
    path = tmp_path / "spool.db"
    with Spool(path) as spool:
        spool.append("t", b"{}")
    with Spool(path, max_age_s=3600) as again:
        (item,) = again.pending()
        assert 0 <= again.now() - item.created < 60


def test_a_file_from_before_the_spool_clock_keeps_its_items(tmp_path: Path) -> None:
    """A spool written by an earlier edged holds wall-clock times: the clock continues from
    its newest item, so none of them is suddenly old (or in the future for weeks)."""
    path = tmp_path / "spool.db"
    with Spool(path, clock=lambda: TODAY) as old:
        old.append("t", b"{}")
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM meta WHERE key = 'clock_us'")
    with Spool(path, max_age_s=3600) as spool:
        assert len(spool.pending()) == 1
        assert TODAY <= spool.now() < TODAY + 60
