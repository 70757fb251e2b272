"""One broker connection at a time: the paho client, its Will, bdSeq, and reconnecting.

Everything here runs in the MQTT thread except `wake` (package docstring, "Threads"). The
session tells its `events` what happened on the connection (a CONNACK, a PUBACK, a command,
the client dropped); what is sent is the outbox's business.
"""

from __future__ import annotations

import logging
import os
import random
import select
import socket
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Protocol

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edged.telemetry.mqtt.payloads import dumps, now, short_reason
from edged.telemetry.settings import MqttSettings
from edged.telemetry.topics import BAD_LEVEL, COMMAND_PREFIX

log = logging.getLogger("edged.telemetry.mqtt")
# Births per connection that state seqs leave room for (a rebirth is a rare command): state
# seq = bdSeq * STATE_SEQ_SPAN + n; deaths take the last slot. JSON keeps 2^53 exact, so
# bdSeq may reach 2^33 connections.
STATE_SEQ_SPAN = 1 << 20
BDSEQ_FILE = "mqtt-bdseq"
RESERVED_INFLIGHT = 4  # in-flight slots kept for state and audit next to the spool window
# The largest packet the broker may send us (MQTT 5 CONNECT's Maximum Packet Size; the broker
# discards a larger message for us, spec 3.1.2.11.4). Only commands come our way, and one is
# at most 64 KiB (commands.MAX_COMMAND_BYTES): twice that leaves room for topic and properties,
# so a command a little too large is still answered, while a 256 MiB one (Mosquitto's default
# limit) never reaches paho, which would hold all of it in memory. MQTT 3.1.1 has no such
# property: there the broker's own message_size_limit is the bound.
MAX_INCOMING_PACKET_BYTES = 128 * 1024
_UNSUPPORTED_PROTOCOL = 0x84  # CONNACK reason; paho maps a 3.1.1 broker's "refused: version" to it
_FILES = ("ca_file", "cert_file", "key_file", "password_file")


def death_seq(bdseq: int) -> int:
    """The state seq of connection `bdseq`'s Will: after all its births (package doc)."""
    return (bdseq + 1) * STATE_SEQ_SPAN - 1


def device_id_from(root_path: str | Path = "/etc/machine-id") -> str:
    """The systemd machine id (stable across reboots, unique per install); the hostname when
    the file is missing, empty or unreadable (containers often have none)."""
    try:
        text = Path(root_path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if text and not (BAD_LEVEL & set(text)) and text.isprintable():
        return text
    name = socket.gethostname().strip()
    return "".join("_" if c in BAD_LEVEL else c for c in name) or "unknown"


class SettingsError(ValueError):
    """`<setting>: <problem>`: a file of the settings that this process cannot read now
    (the config checked that it exists; the daemon may run as another user)."""

    def __init__(self, setting: str, problem: str):
        self.setting, self.problem = setting, problem
        super().__init__(f"{setting}: {problem}")


class Events(Protocol):
    """What the session reports, in the MQTT thread."""

    def on_connack(self, receive_max: int) -> None: ...
    def on_puback(self, mid: int, reason: ReasonCode) -> None: ...
    def on_command(self, msg: paho.MQTTMessage) -> None: ...
    def on_abandon(self) -> None: ...


class BdSeq:
    """The connection counter in a small file: read once, written (atomically) before each
    CONNECT that uses a new value, so a restart never reuses a bdSeq a Will already carries."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / BDSEQ_FILE
        try:
            last = int(self.path.read_text().strip())
        except (OSError, ValueError):
            last = -1
        self.value = last + 1
        self._save()

    def next(self) -> int:
        self.value += 1
        self._save()
        return self.value

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(f"{self.value}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only state dir costs bdSeq continuity, not telemetry
            log.warning("cannot save bdSeq to %s: %s", self.path, exc)


class Session:
    """The client of the current connection (None between connections) and the backoff."""

    def __init__(
        self,
        settings: MqttSettings,
        state_dir: Path,
        events: Events,
        *,
        inflight: int,
        reconnect_min_s: float,
        reconnect_max_s: float,
        connect_timeout_s: float,
    ) -> None:
        for name in _FILES:
            path = getattr(settings, name)
            if path is not None and not os.access(path, os.R_OK):
                raise SettingsError(name, f"cannot read {path}")
        self.settings = settings
        self.events = events
        self._inflight = inflight  # paho's own limit: the spool window plus state and audit
        self._reconnect_min = reconnect_min_s
        self._reconnect_max = max(reconnect_min_s, reconnect_max_s)
        self._connect_timeout = connect_timeout_s
        self.bdseq = BdSeq(state_dir)
        self.protocol = settings.protocol  # "3.1.1" after a broker refused MQTT 5
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.client: paho.Client | None = None
        self.connected = False
        self._connecting_since = 0.0
        self.drop_client = False
        self._drop_reason = ""
        self._retry_now = False
        self._next_attempt = 0.0
        self._delay = reconnect_min_s
        self._failures = 0
        self.connects = 0
        self.last_error: str | None = None

    @property
    def closed(self) -> bool:
        return self._wake_r.fileno() < 0

    def wake(self) -> None:
        """Any thread: make the MQTT thread look at new work now."""
        with suppress(OSError):  # BlockingIOError: already awake (buffer full); or closed
            self._wake_w.send(b"\0")

    def close(self) -> None:
        for sock in (self._wake_r, self._wake_w):
            sock.close()

    def step(self) -> bool:
        """Connect, wait to, or serve the connection for up to a second; True when it is
        up afterwards, so the caller may send."""
        if self.client is None:
            delay = self._next_attempt - time.monotonic()
            if delay > 0:
                self._wait(delay)
            else:
                self._connect()
            return False
        self.service(1.0)
        if self.drop_client:
            self.lost(self._drop_reason)
            return False
        if self.connected:
            return True
        if time.monotonic() - self._connecting_since > self._connect_timeout:
            self._failed(f"no CONNACK within {self._connect_timeout:.0f} s")
        return False

    def _wait(self, seconds: float) -> None:
        ready, _, _ = select.select([self._wake_r], [], [], min(seconds, 1.0))
        if ready:
            self._drain_wake()

    def _drain_wake(self) -> None:
        with suppress(OSError):  # BlockingIOError: drained
            while self._wake_r.recv(4096):
                pass

    def service(self, timeout: float) -> None:
        """One select() over the client's socket and the wake pipe, then paho's read, write
        and keepalive work: paho's external-loop API, all in this thread."""
        client = self.client
        assert client is not None
        sock = client.socket()
        if sock is None:
            self.drop_client = True
            return
        pending = getattr(sock, "pending", None)  # bytes already decrypted by TLS
        ready_tls = bool(pending and pending())
        wlist = [sock] if client.want_write() else []
        try:
            readable, writable, _ = select.select(
                [sock, self._wake_r], wlist, [], 0 if ready_tls else timeout
            )
        except (OSError, ValueError):
            self.drop_client = True
            return
        if self._wake_r in readable:
            self._drain_wake()
        if sock in readable or ready_tls:
            client.loop_read()
        if client.socket() is not None and (writable or client.want_write()):
            client.loop_write()
        if client.socket() is not None:
            client.loop_misc()
        if client.socket() is None and not self.drop_client:
            self.drop_client = True
            self._drop_reason = self._drop_reason or "connection closed"

    def json_props(self) -> Properties | None:
        """PUBLISH properties of a JSON payload (MQTT 5 only)."""
        if self.protocol != "5":
            return None
        props = Properties(PacketTypes.PUBLISH)
        props.PayloadFormatIndicator = 1  # UTF-8
        props.ContentType = "application/json"
        return props

    def _connect(self) -> None:
        s = self.settings
        proto = paho.MQTTv5 if self.protocol == "5" else paho.MQTTv311
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"edged-{s.device_id}",
            protocol=proto,
            reconnect_on_failure=False,
        )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        client.max_inflight_messages_set(self._inflight)
        bd = self.bdseq.value
        client.will_set(
            s.topic("state"),
            dumps({"online": False, "ts": now(), "seq": death_seq(bd), "bdSeq": bd}),
            qos=1,
            retain=True,
            properties=self.json_props(),
        )
        try:
            if s.tls:
                client.tls_set(
                    ca_certs=_str(s.ca_file), certfile=_str(s.cert_file), keyfile=_str(s.key_file)
                )
            if s.username:
                client.username_pw_set(s.username, self._password())
        except (OSError, ValueError) as exc:
            self._failed(f"TLS/credentials setup failed: {short_reason(exc)}")
            return
        self.client = client
        self.drop_client = False
        self._drop_reason = ""
        self._connecting_since = time.monotonic()
        try:
            if proto == paho.MQTTv5:
                props = Properties(PacketTypes.CONNECT)
                props.MaximumPacketSize = MAX_INCOMING_PACKET_BYTES
                client.connect(
                    s.host, s.port, keepalive=s.keepalive_s, clean_start=True, properties=props
                )
            else:
                client.connect(s.host, s.port, keepalive=s.keepalive_s)
        except (OSError, ValueError) as exc:  # refused, unreachable, TLS verification
            self._failed(short_reason(exc))

    def _password(self) -> str | None:
        path = self.settings.password_file
        if path is None:
            return None
        try:
            return Path(path).read_text().rstrip("\r\n")
        except OSError as exc:  # the message names the file, never its content
            raise OSError(f"cannot read password_file {path}: {exc.strerror}") from None

    def _on_connect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: Any,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if client is not self.client:
            return
        if reason.is_failure:
            self.drop_client = True
            self._drop_reason = f"broker refused the connection: {reason}"
            if reason.value == _UNSUPPORTED_PROTOCOL and self.protocol == "5":
                log.warning("broker does not speak MQTT 5; using MQTT 3.1.1")
                self.protocol = "3.1.1"
                self._retry_now = True
            return
        # The broker's Receive Maximum (mosquitto: 20) bounds our unacknowledged QoS 1
        # messages. (paho cannot change its own inflight limit once connected, and does not
        # apply this one itself.)
        self.events.on_connack(
            getattr(properties, "ReceiveMaximum", 65535) if properties else 65535
        )
        self.connects += 1
        self._delay = self._reconnect_min
        if self._failures or self.last_error:
            log.info(
                "MQTT connected to %s after %d failed attempts (bdSeq %d)",
                self.settings.url,
                self._failures,
                self.bdseq.value,
            )
        else:
            log.info("MQTT connected to %s (bdSeq %d)", self.settings.url, self.bdseq.value)
        self._failures = 0
        self.last_error = None
        client.subscribe(self.settings.base + COMMAND_PREFIX + "#", qos=1)
        self.connected = True

    def _on_disconnect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: Any,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if client is not self.client:
            return
        self.drop_client = True
        if not self._drop_reason:
            if getattr(flags, "is_disconnect_packet_from_server", False):
                self._drop_reason = f"broker sent DISCONNECT: {reason}"
            elif reason.value == 0x80:  # paho's "Unspecified error": the socket closed
                self._drop_reason = "connection closed"
            else:
                self._drop_reason = str(reason)

    def _on_publish(
        self,
        client: paho.Client,
        userdata: Any,
        mid: int,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if client is self.client:
            self.events.on_puback(mid, reason)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        if client is self.client:
            self.events.on_command(msg)

    def _failed(self, reason: str) -> None:
        """A connection attempt that did not reach CONNACK: back off and retry."""
        self.abandon()
        self._failures += 1
        if reason != self.last_error:
            log.warning(
                "MQTT connection to %s failed: %s; retrying within %.0f s",
                self.settings.url,
                reason,
                self._reconnect_max,
            )
        else:
            log.debug("MQTT connection to %s failed again: %s", self.settings.url, reason)
        self.last_error = reason
        self._schedule()

    def lost(self, reason: str) -> None:
        """The client is gone: before CONNACK (a failed attempt) or after (a lost link)."""
        was_connected = self.connected
        self.abandon()
        if self._retry_now:  # protocol fallback: the next attempt at once
            self._retry_now = False
            self._next_attempt = 0.0
            return
        if not was_connected:
            self._failed(reason or "connection closed before CONNACK")
            return
        # The broker has published (or will) the Will of that connection; the next one
        # registers a new Will, so it gets a new bdSeq.
        self.bdseq.next()
        self.last_error = reason
        log.warning("MQTT connection to %s lost: %s; reconnecting", self.settings.url, reason)
        self._delay = self._reconnect_min
        self._schedule()

    def _schedule(self) -> None:
        # paho's own backoff: min delay, doubling per failure, capped; +-10 % jitter so a
        # fleet does not reconnect in lockstep after a broker restart.
        delay = self._delay * random.uniform(0.9, 1.1)
        self._next_attempt = time.monotonic() + delay
        self._delay = min(self._delay * 2, self._reconnect_max)

    def abandon(self) -> None:
        client, self.client = self.client, None
        self.connected = False
        self.drop_client = False
        self.events.on_abandon()
        if client is not None:
            sock = client.socket()
            if sock is not None:
                with suppress(OSError):
                    sock.close()

    def disconnect(self, deadline: float) -> None:
        """A clean DISCONNECT (which suppresses the Will), written out by `deadline`."""
        client = self.client
        if client is None or self.drop_client:
            return
        client.disconnect()
        while client.want_write() and time.monotonic() < deadline:
            if client.loop_write() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                break


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)
