"""Property-based fuzzing of the fleet command handling, in process: whatever topic suffix
(text, bytes that are not UTF-8, or not under cmd/ at all) and payload (random bytes, huge,
non-UTF-8, deeply nested JSON, wrong types, retained) reaches the dispatcher, it raises
nothing, answers at most once, and every answer it spools is a well-formed event (the
schema in docs/schema, ids and names cut to their bounds) made within time and memory
bounds. The publisher is real but never connects; its spool is a real file."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import orjson
import paho.mqtt.client as paho
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edged.config import MqttSettings
from edged.telemetry.mqtt.commands import (
    MAX_COMMAND_BYTES,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    Commands,
    parse,
)
from edged.telemetry.mqtt.publisher import Publisher
from edged.telemetry.spool import Spool
from tests.support.schema import check

BASE = "edged/v1/g/d/"


def dumps(value: object) -> bytes:
    """The stdlib's JSON: it writes what orjson refuses to (NaN, integers past 64 bits)."""
    return json.dumps(value).encode()


ANSWERS = {"command_done", "command_rejected", "command_failed"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=30,
)
ids = st.one_of(
    st.text(max_size=2 * MAX_ID_CHARS),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just("i" * 5000),
)
objects = st.builds(
    lambda value, ident, with_id: dumps(
        {
            **(value if isinstance(value, dict) else {"v": value}),
            **({"id": ident} if with_id else {}),
        }
    ),
    json_values,
    ids,
    st.booleans(),
)
payloads = st.one_of(
    objects,
    st.binary(max_size=2048),  # random, and mostly not UTF-8
    json_values.map(dumps),  # any JSON value: arrays, strings, null
    st.integers(1, 200_000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(1, 200_000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
    st.sampled_from(
        [
            b'{"id": "\xff\xfe"}',  # not UTF-8 inside a string
            b'{"id": "a", "id": 7}',  # a duplicate key
            b'{"x": 1e999999}',
            b'{"x": NaN}',
            b"\xef\xbb\xbf{}",  # a byte order mark
            b"",
            b"{" + b" " * (MAX_COMMAND_BYTES + 1) + b"}",  # just too large
            b'{"id": "' + b"z" * (4 * MAX_COMMAND_BYTES) + b'"}',  # far too large
        ]
    ),
)
names = st.one_of(
    st.sampled_from([b"rebirth", b"audit", b"", b"rebirth/x", b"audit/../rebirth", b"#", b"+"]),
    st.text(max_size=300).map(str.encode),
    st.binary(max_size=100),  # mostly not UTF-8: paho's msg.topic raises for those
)


def message(suffix: bytes, payload: bytes, retain: bool, under_cmd: bool) -> paho.MQTTMessage:
    topic = (BASE + "cmd/").encode() + suffix if under_cmd else suffix
    msg = paho.MQTTMessage(topic=topic)
    msg.payload, msg.retain = payload, retain
    return msg


def answers_since(spool: Spool, after: int) -> list[dict]:
    """The events spooled after id `after`, as the outbox sends them (seq spliced in)."""
    return [
        {"seq": item.id, **orjson.loads(item.payload)}
        for item in spool.pending(limit=10, after_id=after)
    ]


def test_any_command_is_answered_at_most_once_with_a_well_formed_event(tmp_path: Path) -> None:
    p = Publisher(
        MqttSettings(url="mqtt://127.0.0.1:1", group="g", device_id="d"),
        Spool(tmp_path / "spool.sqlite", max_bytes=64 * 2**20),
        tmp_path,
        owns_spool=True,
    )
    audits: list[dict] = []
    last = [0]
    tracemalloc.start()

    @settings(
        max_examples=200,
        deadline=None,  # the bound that matters is asserted around on_command itself
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        suffix=names,
        payload=payloads,
        retain=st.booleans(),
        under_cmd=st.booleans() | st.just(True),
        with_handler=st.booleans(),
    )
    def one(suffix: bytes, payload: bytes, retain: bool, under_cmd: bool, with_handler: bool):
        commands = Commands(BASE, p.outbox)  # fresh buckets: every command gets through
        if with_handler:
            commands.handler = lambda command: audits.append(command) or {"checks": 1}
        msg = message(suffix, payload, retain, under_cmd)
        command, reason = parse(msg)  # the parser alone: an object, or why not
        if reason is None:
            assert isinstance(command, dict)
            assert len(command.get("id", "")) <= MAX_ID_CHARS
        else:
            assert isinstance(reason, str) and len(reason) <= 400
        started = time.monotonic()
        commands.on_command(msg)
        assert time.monotonic() - started < 1.0  # in the MQTT thread: it must not stall
        while commands._busy and time.monotonic() - started < 5:  # an audit's worker
            time.sleep(0.001)
        new = answers_since(p.spool, last[0])
        assert len(new) <= 1
        for event in new:
            check("event", event)
            assert event["kind"] in ANSWERS
            assert len(event["command"]) <= MAX_NAME_CHARS
            assert len(event.get("id", "")) <= MAX_ID_CHARS
            assert len(event.get("reason", "")) <= 400
            last[0] = event["seq"]
        assert commands.counts["commands"] == 1
        assert commands.counts["commands_unanswered"] == 1 - len(new)

    try:
        one()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        p.stop(0)
    assert peak < 128 * 2**20, f"peak {peak / 2**20:.0f} MiB"
