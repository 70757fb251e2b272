"""Fleet commands as a broken or hostile fleet sends them: floods of rebirths and unknown
commands with 64 KiB ids, a flood that would starve a real command, a command far larger than
any command is, and answers arriving while the spool is full of unsent telemetry.

The answers stay few and small, a flood of one kind leaves the others answered, and no answer
ever displaces telemetry: the spool keeps every telemetry item. A real Mosquitto where the
broker matters; the real publisher, outbox and spool in every test."""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import orjson
import paho.mqtt.client as paho
import pytest

from edged.config import MqttSettings
from edged.telemetry.mqtt.commands import (
    ANSWER_BURST,
    ANSWERS_PER_S,
    COMMAND_LIMITS,
    MAX_ID_CHARS,
)
from edged.telemetry.mqtt.publisher import Publisher
from edged.telemetry.spool import APPLICATION_ID, Spool, SpoolFull
from tests.support.broker import Broker, Message, SubProcess, wait

BASE = "edged/v1/g/d/"
BIG_ID = "x" * 60_000  # a payload just under the 64 KiB a command may have


def make_publisher(tmp: Path, url: str, spool_bytes: int = 2**20) -> Publisher:
    p = Publisher(
        MqttSettings(url=url, group="g", device_id="d"),
        Spool(tmp / "spool.sqlite", max_bytes=spool_bytes),
        tmp,
        owns_spool=True,
        reconnect_min_s=0.2,
        reconnect_max_s=1.0,
    )
    p.set_birth({"version": "test"})
    return p


def of(messages: list[Message], kind: str) -> list[dict]:
    return [m.payload for m in messages if m.topic == BASE + kind]


def message(name: str, payload: bytes, retain: bool = False) -> paho.MQTTMessage:
    msg = paho.MQTTMessage(topic=(BASE + "cmd/" + name).encode())
    msg.payload, msg.retain = payload, retain
    return msg


class Flood:
    """A second MQTT client that publishes commands to the device."""

    def __init__(self, port: int) -> None:
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def send(self, name: str, payload: bytes) -> None:
        self.client.publish(BASE + "cmd/" + name, payload, qos=1)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def broker(tmp_path: Path):
    with Broker(tmp_path / "broker") as b:
        yield b


@pytest.mark.needs_broker
@pytest.mark.slow
def test_a_flood_is_answered_a_bounded_number_of_times_and_telemetry_all_sent(
    tmp_path: Path, broker: Broker
) -> None:
    """1,000 rebirth and unknown commands with 64 KiB ids, on top of 200 telemetry items
    spooled while offline: every telemetry item arrives, none was dropped, and the answers
    are at most what the per-kind buckets allow, each echoing at most MAX_ID_CHARS."""
    p = make_publisher(tmp_path, broker.url)
    for i in range(200):
        p.publish_telemetry({"i": i, "pad": "t" * 1000})
    watcher = SubProcess(
        broker.port, [BASE + "event", BASE + "telemetry"], tmp_path / "sub"
    ).ready()
    flood = Flood(broker.port)
    try:
        p.start()
        assert p.wait_connected(10)
        start = time.monotonic()
        for i in range(1000):
            flood.send("rebirth" if i % 2 else f"nope{i}", orjson.dumps({"id": BIG_ID}))
        wait(lambda: p.stats()["commands"] >= 1000, timeout=120, what="1000 commands")
        elapsed = time.monotonic() - start
        wait(lambda: len(of(watcher.messages(), "telemetry")) >= 200, 30, "all telemetry")
        time.sleep(1.0)
        messages = watcher.messages()
        stats = p.stats()
    finally:
        flood.close()
        p.stop(5)
        watcher.close()
    assert sorted(t["i"] for t in of(messages, "telemetry")) == list(range(200))
    assert stats["spool"]["dropped_total"] == 0
    answers = [e for e in of(messages, "event") if e["kind"].startswith("command_")]
    kinds = 2  # rebirth, and the one bucket all unknown names share
    assert answers, "the first of each kind are answered"
    assert len(answers) <= kinds * (ANSWER_BURST + ANSWERS_PER_S * (elapsed + 1))
    assert all(len(e["id"]) == MAX_ID_CHARS for e in answers)
    assert all("id longer than" in e["reason"] for e in answers)
    assert stats["commands_unanswered"] == 1000 - len(answers)


@pytest.mark.needs_broker
def test_a_flood_of_unknown_commands_does_not_starve_an_audit(
    tmp_path: Path, broker: Broker
) -> None:
    """Each kind has its own bucket: 1,000 unknown commands leave cmd/audit its answer (one
    shared bucket ran dry, and the audit was dropped unanswered)."""
    p = make_publisher(tmp_path, broker.url)
    audits: list[dict] = []
    p.set_audit_handler(lambda command: audits.append(command) or {"checks": 1})
    watcher = SubProcess(broker.port, BASE + "event", tmp_path / "sub").ready()
    flood = Flood(broker.port)
    try:
        p.start()
        assert p.wait_connected(10)
        for i in range(1000):
            flood.send(f"nope{i}", b"{}")
        flood.send("audit", b'{"id": "legit"}')
        wait(lambda: p.stats()["commands"] >= 1001, timeout=120, what="1001 commands")
        done = watcher.wait_for(
            lambda m: any(e.get("id") == "legit" for e in of(m, "event")), timeout=30
        )
    finally:
        flood.close()
        p.stop(5)
        watcher.close()
    (answer,) = [e for e in of(done, "event") if e.get("id") == "legit"]
    assert answer["kind"] == "command_done" and audits == [{"id": "legit"}]


@pytest.mark.needs_broker
def test_a_command_far_larger_than_any_command_never_reaches_the_device(
    tmp_path: Path, broker: Broker
) -> None:
    """MQTT 5's Maximum Packet Size: the broker discards a 4 MiB command instead of handing
    it to paho (which would hold it all in memory); a command just over 64 KiB still gets
    its answer, and the connection stays up."""
    p = make_publisher(tmp_path, broker.url)
    watcher = SubProcess(broker.port, BASE + "event", tmp_path / "sub").ready()
    flood = Flood(broker.port)
    try:
        p.start()
        assert p.wait_connected(10)
        flood.send("rebirth", b'{"pad": "' + b"z" * (4 * 2**20) + b'"}')
        flood.send("rebirth", b'{"pad": "' + b"z" * (70 * 2**10) + b'"}')
        flood.send("rebirth", b'{"id": "after"}')
        events = watcher.wait_for(
            lambda m: any(e.get("id") == "after" for e in of(m, "event")), timeout=30
        )
        stats = p.stats()
    finally:
        flood.close()
        p.stop(5)
        watcher.close()
    assert stats["commands"] == 2 and stats["connected"] and stats["connects"] == 1
    reasons = [e.get("reason") for e in of(events, "event")]
    assert reasons[0] == "payload larger than 65536 bytes"


def test_answers_never_displace_spooled_telemetry(tmp_path: Path) -> None:
    """The spool full of unsent telemetry (the broker slow or away) while commands keep
    coming: not one telemetry item is dropped; the answers find no room and are counted.
    In process (the commands go to the dispatcher as the MQTT thread would hand them)."""
    offline = make_publisher(tmp_path, "mqtt://127.0.0.1:1")
    for i in range(50):
        offline.publish_telemetry({"i": i, "pad": "t" * 1000})
    full = offline.spool.stats()["bytes"]
    offline.stop(0)
    p = make_publisher(tmp_path, "mqtt://127.0.0.1:1", spool_bytes=full)  # the same file, full
    try:
        for i in range(1000):
            name = ("audit", f"nope{i}")[i % 2]  # each answered: refused
            body = orjson.dumps({"id": BIG_ID if i % 4 < 2 else f"c{i}"})
            p.commands.on_command(message(name, body))
        stats = p.stats()
        kept = [orjson.loads(item.payload).get("i") for item in p.spool.pending(limit=100)]
    finally:
        p.stop(0)
    assert kept == list(range(50))
    assert stats["spool"]["dropped_total"] == 0
    assert stats["commands_unanswered"] == 1000


def test_the_spool_drops_answers_before_telemetry(tmp_path: Path) -> None:
    """The mechanism: an expendable item (an answer) only takes room nothing else needs; a
    telemetry append that needs room drops the answers first, oldest first."""
    with Spool(tmp_path / "spool.sqlite", max_bytes=1000) as spool:
        spool.append("t", b"a" * 400)
        first = spool.append("e", b"b" * 200, expendable=True)
        spool.append("e", b"c" * 200, expendable=True)
        with pytest.raises(SpoolFull):
            spool.append("e", b"d" * 700, expendable=True)  # the answers' room is not enough
        assert spool.stats()["dropped_total"] == 0
        spool.append("t", b"e" * 300)  # needs 100 bytes: the oldest answer goes
        assert [item.id for item in spool.pending()] == [1, first + 1, first + 2]
        spool.append("t", b"f" * 500)  # the other answer, then the oldest telemetry
        assert [item.payload[:1] for item in spool.pending()] == [b"e", b"f"]
        assert spool.stats()["dropped_total"] == 3


def test_a_flood_logs_one_warning_per_window(tmp_path: Path, caplog) -> None:
    """Drops past a bucket are counted, not logged one by one: 1,000 unknown commands give
    one rate-limit warning (and at most a burst of "rejected" lines for those answered)."""
    p = make_publisher(tmp_path, "mqtt://127.0.0.1:1")
    try:
        with caplog.at_level(logging.WARNING, logger="edged.telemetry.mqtt"):
            for i in range(1000):
                p.commands.on_command(message(f"nope{i}", b"{}"))
        stats = p.stats()
    finally:
        p.stop(0)
    texts = [r.getMessage() for r in caplog.records]
    limited = [t for t in texts if "over their rate limit" in t]
    burst, _ = COMMAND_LIMITS["unknown"]
    assert len(limited) == 1 and "a burst of 10" in limited[0]
    assert len([t for t in texts if "rejected" in t]) <= burst + 1
    assert stats["commands_unanswered"] >= 1000 - burst - 1


def test_a_spool_from_before_expendable_items_keeps_its_items(tmp_path: Path) -> None:
    """A file written by an edged without the `expendable` column (the schema of version 1
    as it was) is opened with its items, and answers then go first in it too."""
    path = tmp_path / "spool.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE items (id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL,"
            " payload BLOB NOT NULL, qos INTEGER NOT NULL, created REAL NOT NULL);"
            "CREATE INDEX items_created ON items (created);"
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
            "INSERT INTO meta VALUES ('dropped_total', 0), ('dropped_unreported', 0);"
            "INSERT INTO items (topic, payload, qos, created) VALUES ('t', x'7b7d', 1, 5.0);"
            f"PRAGMA application_id={APPLICATION_ID}; PRAGMA user_version=1;"
        )
    with Spool(path, max_bytes=10) as spool:
        answer = spool.append("e", b"{}", expendable=True)
        spool.append("t", b"[1,2,3]")  # 2 + 2 + 7 > 10: the answer goes, not the old item
        assert [item.id for item in spool.pending()] == [1, answer + 1]
