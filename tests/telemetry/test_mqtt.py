"""MQTT telemetry against a real Mosquitto, with `mosquitto_sub` as the independent client:
retained birth and clean offline, the Will after kill -9, replay after a broker outage and
after a kill -9 of the publisher, the spool bound, TLS and passwords, commands, MQTT 3.1.1
(configured, and as the fallback from a broker that refuses MQTT 5), the log-only publisher,
and the JSON Schemas in docs/schema."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from edged.config import MqttSettings
from edged.telemetry.mqtt.log_publisher import LogPublisher
from edged.telemetry.mqtt.publisher import Publisher, open_publisher
from edged.telemetry.mqtt.session import SettingsError, device_id_from
from edged.telemetry.spool import Spool
from tests.support.broker import (
    Broker,
    Certs,
    Message,
    SubProcess,
    first_seen,
    make_certs,
    pub,
    sub_once,
    wait,
)
from tests.support.schema import SCHEMAS, check, errors, schema

REPO = Path(__file__).resolve().parents[2]
BASE = "edged/v1/g/d/"
BIRTH = {
    "version": "0.1.0",
    "hardware": {"cpu": "test", "cores": 2},
    "models": {"m": {"backend": "onnxruntime", "device": "CPU"}},
}


# -- helpers --------------------------------------------------------------------------------------


def settings(url: str, **kw: Any) -> MqttSettings:
    return MqttSettings(url=url, group="g", device_id="d", **kw)


def publisher(tmp: Path, url: str, *, spool_bytes: int = 2**20, **kw: Any) -> Publisher:
    opts = {k: kw.pop(k) for k in ("window", "reconnect_min_s", "reconnect_max_s") if k in kw}
    opts.setdefault("reconnect_min_s", 0.2)
    opts.setdefault("reconnect_max_s", 1.0)
    p = Publisher(
        settings(url, **kw),
        Spool(tmp / "spool.sqlite", max_bytes=spool_bytes),
        tmp,
        owns_spool=True,
        **opts,
    )
    p.set_birth(BIRTH)
    return p


def of(messages: list[Message], kind: str) -> list[dict]:
    return [m.payload for m in messages if m.topic == BASE + kind]


@pytest.fixture
def broker(tmp_path: Path):
    with Broker(tmp_path / "broker") as b:
        yield b


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


# A publisher in its own process, for kill -9. Prints SPOOLED once its telemetry is committed
# and CONNECTED <bdSeq> once the broker has acknowledged the connection.
CHILD = r"""
import sys, time
from pathlib import Path
from edged.config import MqttSettings
from edged.telemetry.mqtt.publisher import Publisher
from edged.telemetry.spool import Spool
url, state, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
p = Publisher(MqttSettings(url=url, group="g", device_id="d", keepalive_s=2),
              Spool(state / "spool.sqlite"), state, reconnect_min_s=0.2, reconnect_max_s=1)
p.set_birth({"version": "child"})
for i in range(count):
    p.publish_telemetry({"models": {}, "i": i})
print("SPOOLED", flush=True)
p.start()
if p.wait_connected(10):
    print("CONNECTED", p.bdseq, flush=True)
time.sleep(120)
"""


def child(url: str, state: Path, count: int = 0) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(state), str(count)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def read_until(proc: subprocess.Popen[str], word: str, timeout: float = 15.0) -> str:
    result: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith(word):
                result.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not result:
        proc.kill()
        raise TimeoutError(f"child never printed {word}")
    return result[0]


# -- settings -------------------------------------------------------------------------------------


def test_settings_give_host_port_and_topics_and_unreadable_files_fail_at_open(
    tmp_path: Path,
) -> None:
    """The settings are checked by the config (tests/daemon/test_config.py); the publisher reads
    them, and refuses a file it cannot read when it opens."""
    s = settings("mqtt://broker.local")
    assert (s.host, s.port, s.tls) == ("broker.local", 1883, False)
    s = settings("mqtts://127.0.0.1")
    assert (s.host, s.port, s.tls) == ("127.0.0.1", 8883, True)
    assert settings("mqtts://[::1]:9999").port == 9999
    assert settings("mqtt://h:1").topic("state") == "edged/v1/g/d/state"
    with pytest.raises(SettingsError, match="ca_file: cannot read"):
        Publisher(
            settings("mqtts://h:1", ca_file=tmp_path / "missing.pem"),
            Spool(tmp_path / "s.sqlite"),
            tmp_path,
        )


def test_device_id_from_machine_id_or_hostname(tmp_path: Path) -> None:
    machine_id = tmp_path / "machine-id"
    machine_id.write_text("0123456789abcdef0123456789abcdef\n")
    assert device_id_from(machine_id) == "0123456789abcdef0123456789abcdef"
    host = socket.gethostname()
    assert device_id_from(tmp_path / "missing") == host.replace("/", "_")
    machine_id.write_text("\n")
    assert device_id_from(machine_id) == host.replace("/", "_")


def test_payloads_cannot_set_what_the_publisher_writes(tmp_path: Path) -> None:
    p = publisher(tmp_path, "mqtt://127.0.0.1:1")
    for key in ("seq", "bdSeq", "historical"):
        with pytest.raises(ValueError, match=key):
            p.publish_telemetry({key: 1})
    with pytest.raises(ValueError, match="kind"):
        p.publish_event("x", {"kind": "y"})
    with pytest.raises(TypeError):
        p.publish_telemetry([1, 2])  # type: ignore[arg-type]
    assert p.spool.stats()["count"] == 0
    p.stop()


# -- state: birth, clean stop, Will ---------------------------------------------------------------


@pytest.mark.needs_broker
def test_birth_is_retained_and_a_clean_stop_publishes_offline(
    tmp_path: Path, broker: Broker
) -> None:
    p = publisher(tmp_path, broker.url)
    p.start()
    assert p.wait_connected(10), p.last_error
    seq = p.publish_telemetry(
        {
            "models": {
                "m": {
                    "count": 3,
                    "p50_ms": 1.0,
                    "p99_ms": 2.0,
                    "p999_ms": 2.5,
                    "max_ms": 3.0,
                    "jitter_ms": 1.0,
                    "outliers": {"irq": 1},
                    "since_start": {
                        "count": 3,
                        "p50_ms": 1.0,
                        "p99_ms": 2.0,
                        "p999_ms": 2.5,
                        "max_ms": 3.0,
                        "jitter_ms": 1.0,
                    },
                }
            },
            "thermal": {"hottest": None, "throttling": False},
            "system": {},
        }
    )
    wait(lambda: p.stats()["spool"]["count"] == 0, what="telemetry acked")
    # A fresh subscriber gets the retained birth: the independent client's view.
    (birth,) = sub_once(broker.port, BASE + "state")
    assert birth["online"] is True and birth["bdSeq"] == p.bdseq == 0
    assert {k: birth[k] for k in BIRTH} == BIRTH
    check("state", birth)
    assert p.stats()["acked"] == 1 and seq == 1
    assert p.stop(5) is True
    (offline,) = sub_once(broker.port, BASE + "state")
    assert offline["online"] is False and offline["bdSeq"] == birth["bdSeq"]
    assert offline["seq"] > birth["seq"]  # ours, not the Will (registered before the birth)
    check("state", offline)

    # bdSeq counts connections across restarts (kept in the state dir).
    p2 = publisher(tmp_path, broker.url)
    p2.start()
    assert p2.wait_connected(10)
    wait(lambda: sub_once(broker.port, BASE + "state")[0]["online"], what="second birth")
    assert sub_once(broker.port, BASE + "state")[0]["bdSeq"] == 1
    p2.stop(5)


@pytest.mark.needs_broker
def test_kill_9_makes_the_broker_publish_the_will_with_the_births_bdseq(
    tmp_path: Path, broker: Broker
) -> None:
    (tmp_path / "mqtt-bdseq").write_text("41\n")  # a daemon that has connected before
    proc = child(broker.url, tmp_path)
    try:
        bdseq = int(read_until(proc, "CONNECTED").split()[1])
        assert bdseq == 42
        watcher = SubProcess(broker.port, BASE + "state", tmp_path / "state.out").ready()
        (birth,) = watcher.wait_for(lambda m: len(m) >= 1)[:1]
        assert birth.retained and birth.payload["online"] is True
        assert birth.payload["bdSeq"] == bdseq
        # SIGKILL: no DISCONNECT; the kernel closes the socket and the broker sends the Will
        # at once (without that, after 1.5 x keepalive_s = 3 s).
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        messages = watcher.wait_for(lambda m: len(m) >= 2, timeout=10)
        watcher.close()
    finally:
        proc.kill()
        proc.wait()
    will = messages[1].payload
    assert will["online"] is False and will["bdSeq"] == bdseq
    # Ordered by seq, the death comes after the birth it ends (it was registered before).
    assert will["seq"] > birth.payload["seq"]
    check("state", will)
    (retained,) = sub_once(broker.port, BASE + "state")
    assert retained == will


# -- store-and-forward ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.needs_broker
def test_broker_outage_every_message_arrives_in_order(tmp_path: Path) -> None:
    """Telemetry at 20 Hz while the broker is down for 6 s (the issue says 30 s; 6 s holds the
    same ~120 messages' worth of behaviour and keeps the suite short). The broker keeps the
    persistent subscriber's session across its restart, so the subscriber receives what the
    publisher replays even if the publisher reconnects first."""
    broker = Broker(tmp_path / "broker", persistence=True).start()
    try:
        watcher = SubProcess(
            broker.port,
            [BASE + "telemetry", BASE + "state"],
            tmp_path / "tele.out",
            "-c",
            "-i",
            "edged-test-outage",
        ).ready()
    except BaseException:
        broker.stop()
        raise
    p = publisher(tmp_path, broker.url, keepalive_s=5, reconnect_min_s=0.5, reconnect_max_s=2.0)
    produced: list[tuple[int, str]] = []  # (seq, phase)
    phase = "before"
    running = threading.Event()
    running.set()

    def produce() -> None:
        while running.is_set():
            # The phase is read once: read again after publishing, an item made just before
            # the reconnect would be labelled "after" once the main thread moved on.
            now = phase
            seq = p.publish_telemetry({"models": {}, "thermal": {}, "system": {}, "phase": now})
            assert seq is not None
            produced.append((seq, now))
            time.sleep(0.05)

    try:
        p.start()
        assert p.wait_connected(10)
        producer = threading.Thread(target=produce)
        producer.start()
        time.sleep(1.0)
        broker.stop()
        phase = "outage"
        time.sleep(6.0)
        phase = "restarting"
        broker.start()
        assert p.wait_connected(10), p.last_error
        phase = "after"
        time.sleep(1.0)
        running.clear()
        producer.join()
        last = produced[-1][0]
        messages = watcher.wait_for(
            lambda m: any(x.get("seq") == last for x in of(m, "telemetry")), timeout=20
        )
        wait(lambda: p.stats()["spool"]["count"] == 0, what="spool drained")
    finally:
        running.clear()
        p.stop(5)
        watcher.close()
        broker.stop()
    telemetry = of(messages, "telemetry")
    births = [b["bdSeq"] for b in of(messages, "state") if b["online"]]
    assert births[0] + 1 == births[-1], "a new connection, a new bdSeq"
    seqs = first_seen([t["seq"] for t in telemetry])
    assert seqs == list(range(produced[0][0], last + 1)), "lost or out of order"
    assert [s for s, _ in produced] == seqs
    by_seq = {t["seq"]: t for t in telemetry}
    outage = [s for s, ph in produced if ph == "outage"]
    assert len(outage) > 80  # ~120 at 20 Hz
    assert all(by_seq[s].get("historical") is True for s in outage)
    assert not any(by_seq[s].get("historical") for s, ph in produced if ph == "after")
    assert all(0 < m.expiry <= 3600 for m in messages if m.topic.endswith("/telemetry"))
    for t in telemetry[:3]:
        check("telemetry", t)
    check("telemetry", by_seq[outage[0]])
    assert p.stats()["replayed"] >= len(outage)


@pytest.mark.needs_broker
def test_spool_survives_kill_9_of_the_publisher(tmp_path: Path, broker: Broker) -> None:
    """Telemetry committed while the broker is unreachable, then kill -9: a new publisher on
    the same state dir sends all of it, marked historical."""
    broker.stop()  # nothing listens: the child spools and retries
    proc = child(broker.url, tmp_path, count=50)
    try:
        read_until(proc, "SPOOLED")
        time.sleep(0.3)  # a few refused connection attempts
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
    finally:
        proc.kill()
        proc.wait()
    broker.start()
    watcher = SubProcess(broker.port, BASE + "telemetry", tmp_path / "tele.out").ready()
    p = publisher(tmp_path, broker.url)
    try:
        p.start()
        messages = watcher.wait_for(lambda m: len(m) >= 50)
        wait(lambda: p.stats()["spool"]["count"] == 0, what="spool drained")
    finally:
        p.stop(5)
        watcher.close()
    payloads = [m.payload for m in messages]
    assert first_seen([t["seq"] for t in payloads]) == list(range(1, 51))
    assert [t["i"] for t in payloads[:50]] == list(range(50))
    assert all(t["historical"] is True for t in payloads)


@pytest.mark.needs_broker
def test_spool_bound_drops_the_oldest_and_reports_how_many(tmp_path: Path, broker: Broker) -> None:
    p = publisher(tmp_path, broker.url, spool_bytes=2000)
    pad = "x" * 150
    produced = [p.publish_telemetry({"models": {}, "pad": pad}) for _ in range(60)]
    assert produced == list(range(1, 61))  # seq = spool id, before any connection
    kept = p.spool.stats()["count"]
    assert 5 < kept < 15
    watcher = SubProcess(
        broker.port, [BASE + "telemetry", BASE + "event"], tmp_path / "sub.out"
    ).ready()
    try:
        p.start()
        messages = watcher.wait_for(lambda m: of(m, "event"))
    finally:
        p.stop(5)
        watcher.close()
    telemetry = first_seen([t["seq"] for t in of(messages, "telemetry")])
    (event,) = of(messages, "event")
    assert telemetry == list(range(61 - kept, 61)), "not the newest contiguous suffix"
    assert event["kind"] == "spool_dropped" and event["count"] == 60 - kept
    assert event["seq"] == 61  # after the survivors
    check("event", event)


@pytest.mark.needs_broker
def test_a_backlog_larger_than_the_brokers_receive_maximum_is_sent_in_order(
    tmp_path: Path, broker: Broker
) -> None:
    """Mosquitto allows 20 unacknowledged QoS 1 messages per client (Receive Maximum); 1,000
    spooled messages go out within that window, in order. Prints the replay rate."""
    p = publisher(tmp_path, broker.url, spool_bytes=10 * 2**20)
    for i in range(1000):
        p.publish_telemetry({"models": {}, "i": i})
    watcher = SubProcess(broker.port, BASE + "telemetry", tmp_path / "sub.out").ready()
    try:
        start = time.perf_counter()
        p.start()
        wait(lambda: p.stats()["spool"]["count"] == 0, timeout=30, what="backlog sent")
        elapsed = time.perf_counter() - start
        messages = watcher.wait_for(lambda m: len(m) >= 1000)
    finally:
        p.stop(5)
        watcher.close()
    print(f"replayed 1000 spooled messages in {elapsed:.2f} s ({1000 / elapsed:.0f} msg/s)")
    assert first_seen([m.payload["seq"] for m in messages]) == list(range(1, 1001))
    assert p.stats()["acked"] == 1000


# -- TLS and credentials --------------------------------------------------------------------------


@pytest.mark.needs_broker
def test_tls_client_certificate_and_password_file(
    tmp_path: Path, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "s3cret-Pa55word"
    password_file = tmp_path / "password"
    password_file.write_text(secret + "\n")
    caplog.set_level(logging.DEBUG)
    with Broker(
        tmp_path / "broker", certs=certs, users={"device": secret}, require_client_cert=True
    ) as broker:
        creds = ("-u", "device", "-P", secret)
        watcher = SubProcess(broker.port, BASE + "#", tmp_path / "sub.out", auth=creds).ready()
        p = publisher(
            tmp_path,
            broker.tls_url,
            ca_file=certs.ca,
            cert_file=certs.client_cert,
            key_file=certs.client_key,
            username="device",
            password_file=password_file,
        )
        try:
            p.start()
            assert p.wait_connected(10), p.last_error
            p.publish_telemetry({"models": {}})
            messages = watcher.wait_for(lambda m: of(m, "telemetry"))
            assert of(messages, "state")[0]["online"] is True
            texts = [repr(p), repr(p.settings), json.dumps(p.stats())]
            assert p.stop(5)
        finally:
            watcher.close()

        # A wrong password: refused by the broker, reported, retried, never logged.
        password_file.write_text("wrong-" + secret)
        bad = publisher(
            tmp_path / "bad",
            broker.tls_url,
            ca_file=certs.ca,
            cert_file=certs.client_cert,
            key_file=certs.client_key,
            username="device",
            password_file=password_file,
        )
        bad.start()
        wait(lambda: bad.last_error is not None, what="refusal reported")
        assert not bad.connected
        assert "refused" in bad.last_error and "authori" in bad.last_error.lower()
        bad.stop(2)
    logged = [r.getMessage() for r in caplog.records]
    assert any("MQTT connected" in line for line in logged)
    for text in [*logged, *texts]:
        assert secret not in text


@pytest.mark.needs_broker
@pytest.mark.timing
def test_tls_with_the_wrong_ca_fails_with_the_reason_not_a_crash(
    tmp_path: Path, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    with Broker(tmp_path / "broker", certs=certs) as broker:
        p = publisher(tmp_path, broker.tls_url, ca_file=certs.other_ca)
        p.start()
        wait(lambda: p.last_error is not None, what="failure reported")
        assert "certificate verify failed" in p.last_error
        assert not p.connected
        assert any(
            "certificate verify failed" in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING
        )
        p.publish_telemetry({"models": {}})  # still spooling
        assert p.spool.stats()["count"] == 1
        t = time.monotonic()
        assert p.stop(5) is False  # never connected: nothing to acknowledge
        assert time.monotonic() - t < 4  # not the 5 s timeout (loose: a loaded CI machine)


# -- commands -------------------------------------------------------------------------------------


@pytest.mark.needs_broker
def test_commands_are_validated_and_answered(tmp_path: Path, broker: Broker) -> None:
    p = publisher(tmp_path, broker.url)
    audits: list[dict] = []

    def audit(command: dict) -> dict:
        audits.append(command)
        return {"checks": 3, "failed": 1}

    watcher = SubProcess(
        broker.port, [BASE + "event", BASE + "state", BASE + "audit"], tmp_path / "sub.out"
    ).ready()
    # A retained command would run again at every reconnect: refused when it comes as the
    # retained message at subscription.
    pub(broker.port, BASE + "cmd/rebirth", "{}", "-r")
    try:
        p.start()
        assert p.wait_connected(10)
        watcher.wait_for(lambda m: of(m, "state"))
        pub(broker.port, BASE + "cmd/rebirth", "not json")
        pub(broker.port, BASE + "cmd/rebirth", "[1, 2]")
        pub(broker.port, BASE + "cmd/reboot", "{}")
        pub(broker.port, BASE + "cmd/audit", '{"id": "a0"}')  # no handler yet
        pub(broker.port, BASE + "cmd/rebirth", '{"id": 7}')
        pub(broker.port, BASE + "cmd/rebirth", '{"id": "r1"}')
        messages = watcher.wait_for(lambda m: len(of(m, "event")) >= 7)
        p.set_audit_handler(audit)
        pub(broker.port, BASE + "cmd/audit", '{"id": "a1"}')
        messages = watcher.wait_for(lambda m: len(of(m, "event")) >= 8 and of(m, "audit"))
    finally:
        p.stop(5)
        watcher.close()
    events = of(messages, "event")
    for e in events:
        check("event", e)
    rejected = [(e["command"], e["reason"]) for e in events if e["kind"] == "command_rejected"]
    assert [c for c, _ in rejected] == [
        "rebirth",
        "rebirth",
        "rebirth",
        "reboot",
        "audit",
        "rebirth",
    ]
    reasons = [r for _, r in rejected]
    assert reasons[0].startswith("retained commands are ignored")
    assert reasons[1].startswith("payload is not JSON")
    assert reasons[2] == "payload must be a JSON object, got an array"
    assert reasons[3].startswith("unknown command")
    assert "no audit handler" in reasons[4]
    assert reasons[5] == "id must be a string"
    assert [e for e in events if e["kind"] == "command_rejected"][4]["id"] == "a0"
    done = [e for e in events if e["kind"] == "command_done"]
    assert [(e["command"], e["id"]) for e in done] == [("rebirth", "r1"), ("audit", "a1")]
    births = [s for s in of(messages, "state") if s["online"]]
    assert len(births) == 2 and births[1]["seq"] > births[0]["seq"]
    assert births[1]["bdSeq"] == births[0]["bdSeq"]  # a rebirth, not a new connection
    (summary,) = of(messages, "audit")
    assert summary["checks"] == 3 and audits == [{"id": "a1"}]
    check("audit", summary)
    assert sub_once(broker.port, BASE + "audit")[0]["failed"] == 1  # retained


@pytest.mark.needs_broker
def test_audit_command_flood_is_rate_limited(tmp_path: Path, broker: Broker) -> None:
    """cmd/audit at 20/s: one audit runs; the rest are refused, with at most ANSWER_BURST
    command_rejected events and then ANSWERS_PER_S (each is a spooled, fsync'd write), all
    counted."""
    from edged.telemetry.mqtt.commands import ANSWER_BURST, ANSWERS_PER_S

    p = publisher(tmp_path, broker.url)
    audits: list[dict] = []
    p.set_audit_handler(lambda command: audits.append(command) or {"checks": 1})
    watcher = SubProcess(broker.port, BASE + "event", tmp_path / "sub.out").ready()
    try:
        p.start()
        assert p.wait_connected(10)
        start = time.monotonic()
        for i in range(20):
            pub(broker.port, BASE + "cmd/audit", f'{{"id": "f{i}"}}')
        wait(lambda: p.stats()["commands"] >= 20, what="20 commands")
        elapsed = time.monotonic() - start
        messages = watcher.wait_for(lambda m: any(x.payload["kind"] == "command_done" for x in m))
        time.sleep(0.5)
        messages = watcher.messages()
    finally:
        p.stop(5)
        watcher.close()
    assert len(audits) == 1
    events = [m.payload for m in messages]
    rejected = [e for e in events if e["kind"] == "command_rejected"]
    assert rejected and all(
        e["reason"].startswith(("at most one audit every 10 s", "an audit is already running"))
        for e in rejected
    )
    assert len(rejected) <= ANSWER_BURST + ANSWERS_PER_S * elapsed + 1
    assert p.stats()["commands_rejected"] == 19


# -- protocol versions ----------------------------------------------------------------------------


@pytest.mark.needs_broker
def test_mqtt_311_configured(tmp_path: Path, broker: Broker) -> None:
    watcher = SubProcess(broker.port, BASE + "telemetry", tmp_path / "sub.out").ready()
    p = publisher(tmp_path, broker.url, protocol="3.1.1")
    try:
        p.start()
        assert p.wait_connected(10)
        p.publish_telemetry({"models": {}})
        (message,) = watcher.wait_for(lambda m: m)
    finally:
        p.stop(5)
        watcher.close()
    assert message.payload["seq"] == 1 and message.expiry is None  # no expiry in 3.1.1
    assert sub_once(broker.port, BASE + "state")[0]["online"] is False


class V311Only:
    """A broker that does not speak MQTT 5: answers a v5 CONNECT as a 3.1.1 broker does
    ("refused: unacceptable protocol version") and passes every other connection through to
    the real one."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        while len(data) < 9:  # fixed header, protocol name "MQTT", level
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
        length_bytes = next(i for i in range(1, 5) if not data[i] & 0x80)
        level = data[1 + length_bytes + 6]
        if level == 5:
            self.refused += 1
            conn.sendall(b"\x20\x02\x00\x01")
            conn.close()
            return
        up = socket.create_connection(("127.0.0.1", self.upstream))
        up.sendall(data)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while chunk := src.recv(65536):
                    dst.sendall(chunk)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    s.close()

        threading.Thread(target=pump, args=(up, conn), daemon=True).start()
        pump(conn, up)

    def close(self) -> None:
        self.server.close()


@pytest.mark.needs_broker
def test_falls_back_to_311_when_the_broker_refuses_mqtt5(tmp_path: Path, broker: Broker) -> None:
    proxy = V311Only(broker.port)
    p = publisher(tmp_path, f"mqtt://127.0.0.1:{proxy.port}")
    try:
        p.start()
        assert p.wait_connected(10), p.last_error
        assert proxy.refused == 1 and p.stats()["protocol"] == "3.1.1"
        p.publish_telemetry({"models": {}})
        wait(lambda: p.stats()["acked"] == 1, what="telemetry acked over 3.1.1")
        assert sub_once(broker.port, BASE + "state")[0]["online"] is True
    finally:
        p.stop(5)
        proxy.close()


# -- no broker ------------------------------------------------------------------------------------


def test_log_publisher_writes_json_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edged.telemetry.loop")
    p = open_publisher(None, tmp_path)
    assert isinstance(p, LogPublisher)
    p.set_birth(BIRTH)
    p.start()
    assert p.publish_telemetry({"models": {}, "thermal": {"throttling": False}, "system": {}}) == 1
    assert p.publish_telemetry({"models": {}, "thermal": {}, "system": {}}) == 2
    p.publish_event("reload", {"model": "m"})
    p.publish_audit({"checks": 1})
    assert p.stop() is True
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "edged.telemetry.loop"]
    assert [(x["topic"], x["seq"]) for x in lines] == [
        ("state", 1),
        ("telemetry", 1),
        ("telemetry", 2),
        ("event", 1),
        ("audit", 1),
        ("state", 2),
    ]
    for line in lines:
        kind = line.pop("topic")
        check(kind, line)
    assert lines[0]["online"] is True and lines[0]["models"] == BIRTH["models"]
    assert lines[-1]["online"] is False
    with pytest.raises(ValueError):
        p.publish_telemetry({"seq": 3})


# -- schemas --------------------------------------------------------------------------------------


def test_schemas_are_json_and_reject_what_they_should() -> None:
    names = sorted(f.name.removesuffix(".schema.json") for f in SCHEMAS.glob("*.schema.json"))
    assert names == ["audit", "command", "envelope", "event", "state", "telemetry"]
    for name in names:
        root = schema(name)
        assert root["$schema"].endswith("2020-12/schema")
        assert re.fullmatch(rf".*/{name}\.schema\.json", root["$id"])
    ok = {"ts": 1.0, "seq": 1, "bdSeq": 0}
    tel = {**ok, "models": {}, "thermal": {}, "system": {}}
    assert not errors(tel, "telemetry")
    assert errors({k: v for k, v in tel.items() if k != "seq"}, "telemetry")  # seq missing
    for key in ("thermal", "system"):
        assert errors({k: v for k, v in tel.items() if k != key}, "telemetry")
    model = {
        "count": 1,
        "p50_ms": 1.0,
        "p99_ms": 1.0,
        "p999_ms": 1.0,
        "max_ms": 1.0,
        "jitter_ms": 0.0,
        "outliers": {"throttle": 1},
    }
    assert errors({**tel, "models": {"m": model}}, "telemetry")  # since_start missing
    model["since_start"] = {k: v for k, v in model.items() if k != "outliers"}
    assert not errors({**tel, "models": {"m": model}}, "telemetry")
    bad_rate = {
        **tel,
        "system": {
            "intrusions": {
                "span_s": 1.0,
                "scope": "all",
                "workers": {},
                "cpus": {"0": {"interrupts_per_s": -1, "softirqs_per_s": 0}},
            }
        },
    }
    assert errors(bad_rate, "telemetry")
    bad_model = {**ok, "models": {"m": {"count": 1, "p50_ms": "fast"}}}
    assert errors(bad_model, "telemetry")
    assert errors({**ok, "kind": "spool_dropped"}, "event")  # count
    assert errors({**ok, "online": False, "models": {}}, "state")
    assert not errors({"id": "x"}, "command")
    assert errors([], "command")
