"""Fleet commands as a broken or hostile fleet sends them: a flood of rebirths and unknown
commands with 64 KiB ids. The answers (events, each a spooled fsync'd write that shares the
spool's bound with unsent telemetry) stay few and small; the telemetry spooled before the
flood is all still there. A real Mosquitto, the real publisher and spool."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import paho.mqtt.client as paho
import pytest

from edged.telemetry.mqtt.commands import ANSWER_BURST, ANSWERS_PER_S, MAX_ID_CHARS
from tests.support.broker import Broker, SubProcess
from tests.test_mqtt import BASE, of, publisher, wait

pytestmark = pytest.mark.needs_broker


@pytest.fixture
def broker(tmp_path: Path):
    with Broker(tmp_path / "broker") as b:
        yield b


def test_a_command_flood_costs_the_spool_almost_nothing(tmp_path: Path, broker: Broker) -> None:
    p = publisher(tmp_path, broker.url, spool_bytes=2**20)
    watcher = SubProcess(broker.port, BASE + "event", tmp_path / "sub.out").ready()
    flood = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    flood.connect("127.0.0.1", broker.port)
    flood.loop_start()
    try:
        p.start()
        assert p.wait_connected(10)
        big_id = "x" * 60_000  # the payload just under MAX_COMMAND_BYTES
        start = time.monotonic()
        for i in range(1000):
            topic = BASE + ("cmd/rebirth" if i % 2 else f"cmd/nope{i}")
            flood.publish(topic, orjson.dumps({"id": big_id}), qos=1)
        wait(lambda: p.stats()["commands"] >= 1000, timeout=60, what="1000 commands")
        elapsed = time.monotonic() - start
        time.sleep(1.0)
        events = of(watcher.messages(), "event")
    finally:
        flood.loop_stop()
        flood.disconnect()
        p.stop(5)
        watcher.close()
    answers = [e for e in events if e["kind"].startswith("command_")]
    assert answers, "some were answered"
    assert len(answers) <= ANSWER_BURST + ANSWERS_PER_S * (elapsed + 1) + 1
    assert all(len(e.get("id", "")) <= MAX_ID_CHARS for e in answers)
    assert all("id longer than" in e["reason"] for e in answers if "reason" in e)
    stats = p.stats()
    assert stats["commands_unanswered"] >= 1000 - len(answers) - 1


def test_telemetry_spooled_before_a_flood_is_all_sent(tmp_path: Path, broker: Broker) -> None:
    """Telemetry spooled while offline is still there after a flood of commands: the answers
    to 1,000 commands with 64 KiB ids once took 50 MB of a 1 MiB spool's room, evicting it."""
    p = publisher(tmp_path, broker.url, spool_bytes=2**20)
    for i in range(200):  # spooled before connecting: the backlog a reconnect sends
        p.publish_telemetry({"i": i, "pad": "t" * 1000})
    watcher = SubProcess(broker.port, BASE + "telemetry", tmp_path / "tele.out").ready()
    flood = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    flood.connect("127.0.0.1", broker.port)
    flood.loop_start()
    try:
        p.start()
        assert p.wait_connected(10)
        for i in range(1000):
            flood.publish(BASE + f"cmd/n{i}", orjson.dumps({"id": "y" * 60_000}), qos=1)
        wait(lambda: p.stats()["commands"] >= 1000, timeout=60, what="1000 commands")
        wait(lambda: len(of(watcher.messages(), "telemetry")) >= 200, timeout=30, what="all")
        sent = sorted(t["i"] for t in of(watcher.messages(), "telemetry") if "i" in t)
    finally:
        flood.loop_stop()
        flood.disconnect()
        p.stop(5)
        watcher.close()
    assert sent[:200] == list(range(200))
