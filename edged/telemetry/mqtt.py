"""Telemetry to the fleet over MQTT, with a durable store-and-forward spool behind it.

Topics, under `edged/v1/<group>/<device>/` (schemas in docs/schema/):

- `state`, retained, QoS 1: the birth `{"online": true, "ts", "seq", "bdSeq", "version",
  "hardware", "models"}` on every (re)connect and on `cmd/rebirth`; the Last Will, registered
  with each CONNECT, is the same topic retained `{"online": false, "ts", "seq", "bdSeq"}`, and
  a clean stop publishes that itself (a clean DISCONNECT suppresses the Will).
- `telemetry`, QoS 1 with an MQTT 5 message expiry; `event`, QoS 1. Both go through the spool.
- `audit`, retained, QoS 1: the latest audit summary.
- `cmd/rebirth`, `cmd/audit` (and `cmd/#`, so unknown commands get an answer): JSON objects.

Sequence numbers. `bdSeq` counts connections: it is in the Will registered with a CONNECT and
in the birth that follows it, so a dashboard can tell which death belongs to which birth; it is
kept in `<state_dir>/mqtt-bdseq` so it keeps counting across restarts. `seq` of telemetry and
event is the spool id: one sequence shared by both topics, persistent, gap-free, so a gap in
the merged telemetry+event stream is a loss (the `spool_dropped` event says how many; its
own seq follows the survivors). `seq` of audit only increases while the daemon runs. `seq`
of state is `bdSeq * STATE_SEQ_SPAN + n` for the n-th birth of a connection, and its Will
(and the offline state of a clean stop) carries `(bdSeq + 1) * STATE_SEQ_SPAN - 1`: above every
birth of its own connection, below the next connection's first birth, across restarts too
(bdSeq persists). So ordering state messages by seq puts a death after the birth it ends.
The Will's `ts` is when it was registered (at CONNECT): MQTT gives the broker no way to
stamp it at the death, so the offline time is when the broker publishes it.

Store-and-forward. `publish_telemetry` and `publish_event` commit the payload to the spool
(fsync'd) in the caller's thread and return its seq; the MQTT thread sends it and deletes it
on PUBACK. The stored payload carries neither `seq` nor `historical`: both are spliced into
the JSON when the item is sent (`{"seq":N,"historical":true,...`). An item is `historical`
when it was created before the CONNACK of the connection that sends it: produced while the
broker was away, or sent before a connection was lost and sent again. Deciding at send time
(not at creation) is what makes "replayed" exact: the producer cannot know whether the link
will hold until the PUBACK. After each CONNACK every pending item is sent again in id order,
at most `window` (and the broker's Receive Maximum) unacknowledged at once. Replayed
telemetry keeps the full expiry: it counts from when the broker receives it, and the spool has
its own age bound. A PUBACK with a failure reason code (not authorised, topic invalid,
payload invalid) deletes the item too, since sending it again would fail again, and counts it
as `rejected`; only "quota exceeded" keeps it for the next connection.

Threads. paho's Client is not safe to drive from several threads, so one thread (started by
`start()`) owns it: it connects, publishes, reads and reconnects. Other threads only append to
the spool (which has its own lock), set a few fields under a lock, and wake the owner through a
socket pair. The owner runs paho's external-loop API (`loop_read`/`loop_write`/`loop_misc`
around its own select()) rather than `loop_forever`/`loop_start`: the latter own the thread
and the reconnect, and paho replays its in-memory in-flight messages after an automatic
reconnect, which would duplicate the spool replay. A new Client is made for each connection
(fresh message ids, the Will with the new bdSeq), with the reconnect delay paho would use
(`reconnect_delay_set(1, 30)`): doubling from 1 s to at most 30 s, reset by a CONNACK.

MQTT 5 is the default; a broker that answers "unsupported protocol version" gets MQTT 3.1.1
from the next attempt on (no message expiry there). TLS (`mqtts://`, a CA, optionally a client
certificate) and a username with the password read from a file at each connect; the password
is never logged and is in no repr.

With no broker configured, `LogPublisher` writes the same payloads as JSON lines to the
`edged.telemetry.loop` logger.
"""

from __future__ import annotations

import logging
import math
import os
import random
import select
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edged.telemetry.spool import Spool, SpoolError

log = logging.getLogger("edged.telemetry.mqtt")
TOPIC_ROOT = "edged/v1"
KINDS = ("state", "telemetry", "event", "audit")
# Births per connection that state seqs leave room for (a rebirth is a rare command): state
# seq = bdSeq * STATE_SEQ_SPAN + n; deaths take the last slot. JSON keeps 2^53 exact, so
# bdSeq may reach 2^33 connections.
STATE_SEQ_SPAN = 1 << 20


def death_seq(bdseq: int) -> int:
    """The state seq of connection `bdseq`'s Will: after all its births (module doc)."""
    return (bdseq + 1) * STATE_SEQ_SPAN - 1
# Keys the publisher writes; a payload that brings its own would be ambiguous.
RESERVED = frozenset({"seq", "bdSeq", "historical", "topic"})
PROTOCOLS = ("5", "3.1.1")
BDSEQ_FILE = "mqtt-bdseq"
SPOOL_FILE = "telemetry-spool.sqlite"
MAX_COMMAND_BYTES = 64 * 1024
# cmd/audit reads the whole system (about 0.2 s of a core here): one may start per this many
# seconds; a flood is answered with at most one command_rejected event per second (each
# event is an fsync'd spool write), the rest only counted.
AUDIT_MIN_INTERVAL_S = 10.0
REJECT_EVENTS_PER_S = 1.0
_UNSUPPORTED_PROTOCOL = 0x84  # CONNACK reason; paho maps a 3.1.1 broker's "refused: version" to it
_QUOTA_EXCEEDED = 0x97  # PUBACK reason: try again later, unlike the other failures
_BAD_LEVEL = frozenset("/+#\0")
_RESERVED_INFLIGHT = 4  # in-flight slots kept for state and audit next to the spool window


class SettingsError(ValueError):
    """`<setting>: <problem>`; the config layer maps `setting` to its TOML key."""

    def __init__(self, setting: str, problem: str):
        self.setting, self.problem = setting, problem
        super().__init__(f"{setting}: {problem}")


@dataclass(frozen=True)
class MqttSettings:
    url: str  # mqtt://host[:1883] or mqtts://host[:8883]
    group: str
    device_id: str
    ca_file: Path | None = None  # None with mqtts://: the system's CA store
    cert_file: Path | None = None  # client certificate (with key_file)
    key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = field(default=None, repr=False)  # read at each connect
    keepalive_s: int = 30
    telemetry_expiry_s: int = 3600  # MQTT 5 message expiry of telemetry; 0: none
    protocol: str = "5"  # or "3.1.1"

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("mqtt", "mqtts"):
            raise SettingsError("url", f'must start with mqtt:// or mqtts://, got {self.url!r}')
        if parts.username is not None or parts.password is not None:
            # A password in the URL would end up in configs, logs and process listings.
            raise SettingsError("url", "must not carry user:password@; use username and "
                                       "password_file")
        try:
            port = parts.port
        except ValueError:
            raise SettingsError("url", f"invalid port in {self.url!r}") from None
        if not parts.hostname or port == 0:
            raise SettingsError("url", f"expected mqtt[s]://HOST[:PORT], got {self.url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise SettingsError("url", f"expected mqtt[s]://HOST[:PORT] and nothing after it, "
                                       f"got {self.url!r}")
        for name in ("group", "device_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or _BAD_LEVEL & set(value):
                raise SettingsError(name, f"must be a non-empty MQTT topic level (no '/', '+', "
                                          f"'#'), got {value!r}")
        if parts.scheme == "mqtt" and (self.ca_file or self.cert_file or self.key_file):
            raise SettingsError("url", "ca_file/cert_file/key_file need an mqtts:// url")
        if (self.cert_file is None) != (self.key_file is None):
            raise SettingsError("cert_file" if self.cert_file is None else "key_file",
                                "cert_file and key_file go together")
        if self.password_file is not None and not self.username:
            raise SettingsError("username", "required with password_file")
        if not 1 <= self.keepalive_s <= 65535:
            raise SettingsError("keepalive_s", f"must be 1..65535, got {self.keepalive_s}")
        if not 0 <= self.telemetry_expiry_s <= 2**32 - 1:
            raise SettingsError("telemetry_expiry_s", f"must be 0..4294967295 seconds, got "
                                                      f"{self.telemetry_expiry_s}")
        if self.protocol not in PROTOCOLS:
            raise SettingsError("protocol", f'must be "5" or "3.1.1", got {self.protocol!r}')

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "mqtts"

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or (8883 if self.tls else 1883)

    @property
    def base(self) -> str:
        return f"{TOPIC_ROOT}/{self.group}/{self.device_id}/"

    def topic(self, kind: str) -> str:
        return self.base + kind


def device_id_from(root_path: str | Path = "/etc/machine-id") -> str:
    """The systemd machine id (stable across reboots, unique per install); the hostname when
    the file is missing, empty or unreadable (containers often have none)."""
    try:
        text = Path(root_path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if text and not (_BAD_LEVEL & set(text)) and text.isprintable():
        return text
    name = socket.gethostname().strip()
    return "".join("_" if c in _BAD_LEVEL else c for c in name) or "unknown"


def dumps(obj: Any) -> bytes:
    """Compact JSON; NaN and infinities become null (orjson), which strict parsers accept."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def _check_keys(payload: dict[str, Any], what: str) -> None:
    if not isinstance(payload, dict):
        raise TypeError(f"{what} must be a dict, got {type(payload).__name__}")
    clash = RESERVED & payload.keys()
    if clash:
        raise ValueError(f"{what} must not set {sorted(clash)}: the publisher writes them")


class TelemetryPublisher(Protocol):
    """What the daemon talks to: `Publisher` (a broker) or `LogPublisher` (none)."""

    def set_birth(self, info: dict[str, Any]) -> None: ...
    def publish_telemetry(self, payload: dict[str, Any]) -> int | None: ...
    def publish_event(self, kind: str, detail: dict[str, Any] | None = None) -> int | None: ...
    def publish_audit(self, summary: dict[str, Any]) -> None: ...
    def set_audit_handler(self, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 10.0) -> bool: ...
    def stats(self) -> dict[str, Any]: ...

    @property
    def connected(self) -> bool: ...


def open_publisher(settings: MqttSettings | None, state_dir: Path, *,
                   spool_max_bytes: int = 50 * 2**20,
                   spool_max_age_s: float = 7 * 86400) -> Publisher | LogPublisher:
    """The daemon's one call: a broker-backed Publisher with its spool in the state dir, or a
    LogPublisher when no broker is configured. Not started. Raises SpoolError for an unusable
    spool file and SettingsError for an unreadable ca/cert/key/password file."""
    if settings is None:
        return LogPublisher()
    spool = Spool(Path(state_dir) / SPOOL_FILE, max_bytes=spool_max_bytes,
                  max_age_s=spool_max_age_s)
    return Publisher(settings, spool, state_dir, owns_spool=True)


class _BdSeq:
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


class Publisher:
    """Telemetry, events, state and audit to one broker; see the module docstring."""

    def __init__(self, settings: MqttSettings, spool: Spool, state_dir: Path, *,
                 owns_spool: bool = False, window: int = 100,
                 reconnect_min_s: float = 1.0, reconnect_max_s: float = 30.0,
                 connect_timeout_s: float = 10.0) -> None:
        for name in ("ca_file", "cert_file", "key_file", "password_file"):
            path = getattr(settings, name)
            if path is not None and not os.access(path, os.R_OK):
                raise SettingsError(name, f"cannot read {path}")
        self.settings = settings
        self.spool = spool
        self._owns_spool = owns_spool
        self.window = max(1, window)
        self._reconnect_min = reconnect_min_s
        self._reconnect_max = max(reconnect_min_s, reconnect_max_s)
        self._connect_timeout = connect_timeout_s
        self._bdseq = _BdSeq(state_dir)
        self._protocol = settings.protocol
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._stop_deadline = 0.0
        self._offline_acked = False
        # shared with other threads (under _lock)
        self._birth: dict[str, Any] = {}
        self._birth_wanted = False
        self._audit: bytes | None = None
        self._new_items = True
        self._audit_handler: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._command_busy = False
        self._audit_started = -math.inf  # monotonic time of the last audit started
        self._last_reject_event = -math.inf
        # owned by the MQTT thread
        self._client: paho.Client | None = None
        self._connected = False
        self._connecting_since = 0.0
        self._connected_at = 0.0
        self._drop_client = False
        self._drop_reason = ""
        self._retry_now = False
        self._next_attempt = 0.0
        self._delay = reconnect_min_s
        self._failures = 0
        self._cursor = 0  # the highest spool id handed to this connection
        self._inflight: dict[int, int] = {}  # paho mid -> spool id
        self._others: dict[int, str] = {}  # paho mid -> what (state, audit)
        self._window_now = self.window
        self._last_drop_check = 0.0
        self._state_seq = 0
        self._audit_seq = 0
        self._counts = {"published": 0, "acked": 0, "rejected": 0, "replayed": 0,
                        "connects": 0, "spool_errors": 0, "commands": 0,
                        "commands_rejected": 0}
        self.last_error: str | None = None

    def __repr__(self) -> str:
        return (f"Publisher(url={self.settings.url!r}, group={self.settings.group!r}, "
                f"device_id={self.settings.device_id!r}, connected={self._connected})")

    # -- the API (any thread) -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def bdseq(self) -> int:
        return self._bdseq.value

    def set_birth(self, info: dict[str, Any]) -> None:
        """Birth metadata (version, hardware, models); republished at once when connected."""
        _check_keys(info, "birth info")
        dumps(info)  # fail in the caller, not in the MQTT thread
        with self._lock:
            self._birth = dict(info)
            self._birth_wanted = True
        self._wake()

    def publish_telemetry(self, payload: dict[str, Any]) -> int | None:
        """Commit to the spool and return the seq; None if the spool failed (logged)."""
        _check_keys(payload, "telemetry")
        return self._spool_append("telemetry", {"ts": _now(), "bdSeq": self.bdseq, **payload})

    def publish_event(self, kind: str, detail: dict[str, Any] | None = None) -> int | None:
        detail = detail or {}
        _check_keys(detail, "event detail")
        if "kind" in detail:
            raise ValueError("event detail must not set 'kind'")
        return self._spool_append("event", {"ts": _now(), "bdSeq": self.bdseq, "kind": kind,
                                            **detail})

    def publish_audit(self, summary: dict[str, Any]) -> None:
        """The latest audit summary, retained; only the newest is kept until it is sent."""
        _check_keys(summary, "audit summary")
        with self._lock:
            self._audit_seq += 1
            self._audit = dumps({"ts": _now(), "seq": self._audit_seq, "bdSeq": self.bdseq,
                                 **summary})
        self._wake()

    def set_audit_handler(self, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """`cmd/audit` calls handler(command payload) in a worker thread; the summary it
        returns is published on `audit`, and an event answers the command."""
        self._audit_handler = handler

    def start(self) -> None:
        if self._thread is not None or self._wake_r.fileno() < 0:
            raise RuntimeError("a Publisher starts once")
        self._thread = threading.Thread(target=self._run, name="edged-mqtt", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Publish the offline state, wait for its PUBACK, disconnect cleanly. True when the
        broker acknowledged the offline state (False: not connected, or no PUBACK in time;
        the Will covers those)."""
        thread = self._thread
        if thread is None:
            self._close()
            return False
        self._stop_deadline = time.monotonic() + max(0.1, timeout - 0.2)
        self._stop_requested = True
        self._wake()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("MQTT thread did not stop within %.1f s", timeout)
            return False
        return self._offline_acked

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._connected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stats(self) -> dict[str, Any]:
        try:
            spool = self.spool.stats()
        except SpoolError as exc:
            spool = {"error": str(exc)}
        return {"connected": self._connected, "bdSeq": self.bdseq, "protocol": self._protocol,
                "inflight": len(self._inflight), "last_error": self.last_error,
                **self._counts, "spool": spool}

    # -- callers' side ----------------------------------------------------------------------------

    def _spool_append(self, kind: str, record: dict[str, Any]) -> int | None:
        data = dumps(record)
        try:
            seq = self.spool.append(self.settings.topic(kind), data, qos=1)
        except (SpoolError, ValueError) as exc:  # ValueError: larger than the whole spool
            self._counts["spool_errors"] += 1
            log.error("%s not spooled: %s", kind, exc)
            return None
        with self._lock:
            self._new_items = True
        self._wake()
        return seq

    def _wake(self) -> None:
        with suppress(OSError):  # BlockingIOError: already awake (buffer full); or closed
            self._wake_w.send(b"\0")

    # -- the MQTT thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop_requested:
            try:
                self._step()
            except Exception:  # a bug must not end telemetry: log, drop the client, retry
                log.exception("MQTT thread error; reconnecting")
                self._lost("internal error")
                time.sleep(0.1)
        try:
            self._shutdown()
        except Exception:
            log.exception("MQTT clean stop failed")
        finally:
            self._close()

    def _step(self) -> None:
        if self._client is None:
            delay = self._next_attempt - time.monotonic()
            if delay > 0:
                self._wait(delay)
            else:
                self._connect()
            return
        self._service(1.0)
        if self._drop_client:
            self._lost(self._drop_reason)
            return
        if self._connected:
            self._pump()
        elif time.monotonic() - self._connecting_since > self._connect_timeout:
            self._failed(f"no CONNACK within {self._connect_timeout:.0f} s")

    def _wait(self, seconds: float) -> None:
        ready, _, _ = select.select([self._wake_r], [], [], min(seconds, 1.0))
        if ready:
            self._drain_wake()

    def _drain_wake(self) -> None:
        with suppress(OSError):  # BlockingIOError: drained
            while self._wake_r.recv(4096):
                pass

    def _service(self, timeout: float) -> None:
        """One select() over the client's socket and the wake pipe, then paho's read, write
        and keepalive work: paho's external-loop API, all in this thread."""
        client = self._client
        assert client is not None
        sock = client.socket()
        if sock is None:
            self._drop_client = True
            return
        pending = getattr(sock, "pending", None)  # bytes already decrypted by TLS
        ready_tls = bool(pending and pending())
        wlist = [sock] if client.want_write() else []
        try:
            readable, writable, _ = select.select([sock, self._wake_r], wlist, [],
                                                  0 if ready_tls else timeout)
        except (OSError, ValueError):
            self._drop_client = True
            return
        if self._wake_r in readable:
            self._drain_wake()
        if sock in readable or ready_tls:
            client.loop_read()
        if client.socket() is not None and (writable or client.want_write()):
            client.loop_write()
        if client.socket() is not None:
            client.loop_misc()
        if client.socket() is None and not self._drop_client:
            self._drop_client = True
            self._drop_reason = self._drop_reason or "connection closed"

    def _connect(self) -> None:
        s = self.settings
        proto = paho.MQTTv5 if self._protocol == "5" else paho.MQTTv311
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"edged-{s.device_id}",
                             protocol=proto, reconnect_on_failure=False)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        client.max_inflight_messages_set(self.window + _RESERVED_INFLIGHT)
        bd = self.bdseq
        self._state_seq = 0  # births of this connection (state seq, module docstring)
        client.will_set(s.topic("state"), dumps({"online": False, "ts": _now(),
                                                  "seq": death_seq(bd), "bdSeq": bd}),
                        qos=1, retain=True, properties=self._json_props())
        try:
            if s.tls:
                client.tls_set(ca_certs=_str(s.ca_file), certfile=_str(s.cert_file),
                               keyfile=_str(s.key_file))
            if s.username:
                client.username_pw_set(s.username, self._password())
        except (OSError, ValueError) as exc:
            self._failed(f"TLS/credentials setup failed: {_reason(exc)}")
            return
        self._client = client
        self._drop_client = False
        self._drop_reason = ""
        self._connecting_since = time.monotonic()
        try:
            if proto == paho.MQTTv5:
                client.connect(s.host, s.port, keepalive=s.keepalive_s, clean_start=True)
            else:
                client.connect(s.host, s.port, keepalive=s.keepalive_s)
        except (OSError, ValueError) as exc:  # refused, unreachable, TLS verification
            self._failed(_reason(exc))

    def _password(self) -> str | None:
        path = self.settings.password_file
        if path is None:
            return None
        try:
            return Path(path).read_text().rstrip("\r\n")
        except OSError as exc:  # the message names the file, never its content
            raise OSError(f"cannot read password_file {path}: {exc.strerror}") from None

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any,
                    reason: ReasonCode, properties: Properties | None) -> None:
        if client is not self._client:
            return
        if reason.is_failure:
            self._drop_client = True
            self._drop_reason = f"broker refused the connection: {reason}"
            if reason.value == _UNSUPPORTED_PROTOCOL and self._protocol == "5":
                log.warning("broker does not speak MQTT 5; using MQTT 3.1.1")
                self._protocol = "3.1.1"
                self._retry_now = True
            return
        # The broker's Receive Maximum (mosquitto: 20) bounds our unacknowledged QoS 1
        # messages; a few stay free for state and audit. (paho cannot change its own
        # inflight limit once connected, and does not apply this one itself.)
        receive_max = getattr(properties, "ReceiveMaximum", 65535) if properties else 65535
        self._window_now = max(1, min(self.window, receive_max - _RESERVED_INFLIGHT))
        self._connected_at = time.time()
        self._counts["connects"] += 1
        self._delay = self._reconnect_min
        if self._failures or self.last_error:
            log.info("MQTT connected to %s after %d failed attempts (bdSeq %d)",
                     self.settings.url, self._failures, self.bdseq)
        else:
            log.info("MQTT connected to %s (bdSeq %d)", self.settings.url, self.bdseq)
        self._failures = 0
        self.last_error = None
        self._cursor = 0
        self._inflight.clear()
        self._others.clear()
        with self._lock:
            self._birth_wanted = True
            self._new_items = True
        client.subscribe(self.settings.base + "cmd/#", qos=1)
        self._connected = True

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any,
                       reason: ReasonCode, properties: Properties | None) -> None:
        if client is not self._client:
            return
        self._drop_client = True
        if not self._drop_reason:
            if getattr(flags, "is_disconnect_packet_from_server", False):
                self._drop_reason = f"broker sent DISCONNECT: {reason}"
            elif reason.value == 0x80:  # paho's "Unspecified error": the socket closed
                self._drop_reason = "connection closed"
            else:
                self._drop_reason = str(reason)

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int,
                    reason: ReasonCode, properties: Properties | None) -> None:
        if client is not self._client:
            return
        what = self._others.pop(mid, None)
        if what is not None:
            if what == "offline":
                self._offline_acked = not reason.is_failure
            if reason.is_failure:
                log.warning("broker refused the %s message: %s", what, reason)
            return
        item_id = self._inflight.pop(mid, None)
        if item_id is None:
            return
        if reason.is_failure:
            if reason.value == _QUOTA_EXCEEDED:
                return  # stays in the spool; sent again on the next connection
            self._counts["rejected"] += 1
            log.warning("broker refused spooled message %d: %s (dropped)", item_id, reason)
        else:
            self._counts["acked"] += 1
        try:
            self.spool.ack(item_id)
        except SpoolError as exc:
            self._counts["spool_errors"] += 1
            log.error("spool ack failed: %s", exc)

    def _failed(self, reason: str) -> None:
        """A connection attempt that did not reach CONNACK: back off and retry."""
        self._abandon()
        self._failures += 1
        if reason != self.last_error:
            log.warning("MQTT connection to %s failed: %s; retrying within %.0f s",
                        self.settings.url, reason, self._reconnect_max)
        else:
            log.debug("MQTT connection to %s failed again: %s", self.settings.url, reason)
        self.last_error = reason
        self._schedule()

    def _lost(self, reason: str) -> None:
        """The client is gone: before CONNACK (a failed attempt) or after (a lost link)."""
        was_connected = self._connected
        self._abandon()
        if self._retry_now:  # protocol fallback: the next attempt at once
            self._retry_now = False
            self._next_attempt = 0.0
            return
        if not was_connected:
            self._failed(reason or "connection closed before CONNACK")
            return
        # The broker has published (or will) the Will of that connection; the next one
        # registers a new Will, so it gets a new bdSeq.
        self._bdseq.next()
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

    def _abandon(self) -> None:
        client, self._client = self._client, None
        self._connected = False
        self._drop_client = False
        self._inflight.clear()
        self._others.clear()
        if client is not None:
            sock = client.socket()
            if sock is not None:
                with suppress(OSError):
                    sock.close()

    # -- while connected -------------------------------------------------------------------------

    def _pump(self) -> None:
        client = self._client
        assert client is not None
        with self._lock:
            birth = self._birth_wanted
            self._birth_wanted = False
            audit, self._audit = self._audit, None
            new_items = self._new_items
            self._new_items = False
        if birth:
            self._publish_birth(client)
        if audit is not None:
            self._publish_other(client, "audit", audit, "audit")
        now = time.monotonic()
        if now - self._last_drop_check >= 1.0:
            self._last_drop_check = now
            self._report_drops()
        if new_items:
            self._fill_window(client)

    def _publish_birth(self, client: paho.Client) -> None:
        with self._lock:
            info = dict(self._birth)
        self._state_seq += 1
        payload = dumps({"online": True, "ts": _now(),
                         "seq": self.bdseq * STATE_SEQ_SPAN + self._state_seq,
                         "bdSeq": self.bdseq, **info})
        self._publish_other(client, "state", payload, "birth")

    def _publish_other(self, client: paho.Client, kind: str, payload: bytes, what: str) -> int:
        info = client.publish(self.settings.topic(kind), payload, qos=1, retain=True,
                              properties=self._json_props())
        self._others[info.mid] = what
        return info.mid

    def _report_drops(self) -> None:
        try:
            dropped = self.spool.take_dropped()
        except SpoolError as exc:
            log.error("spool: %s", exc)
            return
        if dropped:
            log.warning("spool bound dropped %d unsent messages (oldest first)", dropped)
            self.publish_event("spool_dropped", {"count": dropped})

    def _fill_window(self, client: paho.Client) -> None:
        room = self._window_now - len(self._inflight)
        if room <= 0:
            with self._lock:
                self._new_items = True  # look again when PUBACKs free the window
            return
        try:
            items = self.spool.pending(limit=room, after_id=self._cursor)
        except SpoolError as exc:
            log.error("spool: %s", exc)
            return
        telemetry_props = self._telemetry_props()
        json_props = self._json_props()
        for item in items:
            historical = item.created < self._connected_at
            head = b'{"seq":%d,' % item.id + (b'"historical":true,' if historical else b"")
            body = item.payload[1:] if item.payload[:1] == b"{" else item.payload
            props = telemetry_props if item.topic.endswith("/telemetry") else json_props
            info = client.publish(item.topic, head + body, qos=item.qos, properties=props)
            if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
                log.warning("publish of spooled message %d failed: %s", item.id,
                            paho.error_string(info.rc))
                break
            self._inflight[info.mid] = item.id
            self._cursor = item.id
            self._counts["published"] += 1
            if historical:
                self._counts["replayed"] += 1
            if client.socket() is None:
                break
        if len(items) == room:
            with self._lock:
                self._new_items = True  # a full batch: there may be more

    def _json_props(self) -> Properties | None:
        if self._protocol != "5":
            return None
        props = Properties(PacketTypes.PUBLISH)
        props.PayloadFormatIndicator = 1  # UTF-8
        props.ContentType = "application/json"
        return props

    def _telemetry_props(self) -> Properties | None:
        props = self._json_props()
        if props is not None and self.settings.telemetry_expiry_s:
            props.MessageExpiryInterval = self.settings.telemetry_expiry_s
        return props

    # -- commands ----------------------------------------------------------------------------------

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        if client is not self._client:
            return
        command = msg.topic[len(self.settings.base) + len("cmd/"):]
        self._counts["commands"] += 1
        payload, reason = self._parse_command(msg)
        ref = {"id": payload["id"]} if payload and isinstance(payload.get("id"), str) else {}
        if reason is None and command not in ("rebirth", "audit"):
            reason = "unknown command; known: audit, rebirth"
        if reason is None and command == "audit":
            reason = self._start_audit(payload or {}, ref)
        if reason is not None:
            self._counts["commands_rejected"] += 1
            if reason.startswith(("at most one audit", "an audit is already running")):
                now = time.monotonic()
                if now - self._last_reject_event < 1.0 / REJECT_EVENTS_PER_S:
                    return  # a flood: counted, not answered one by one
                self._last_reject_event = now
            log.warning("MQTT command %r rejected: %s", command, reason)
            self.publish_event("command_rejected", {"command": command, "reason": reason,
                                                    **ref})
            return
        if command == "rebirth":
            self._publish_birth(client)
            self.publish_event("command_done", {"command": "rebirth", **ref})

    @staticmethod
    def _parse_command(msg: paho.MQTTMessage) -> tuple[dict[str, Any] | None, str | None]:
        if msg.retain:
            return None, "retained commands are ignored (they would run at every reconnect)"
        if len(msg.payload) > MAX_COMMAND_BYTES:
            return None, f"payload larger than {MAX_COMMAND_BYTES} bytes"
        try:
            payload = orjson.loads(msg.payload)
        except orjson.JSONDecodeError as exc:
            return None, f"payload is not JSON: {exc}"
        if not isinstance(payload, dict):
            return None, f"payload must be a JSON object, got {_json_type(payload)}"
        if "id" in payload and not isinstance(payload["id"], str):
            return payload, "id must be a string"
        return payload, None

    def _start_audit(self, payload: dict[str, Any], ref: dict[str, Any]) -> str | None:
        handler = self._audit_handler
        if handler is None:
            return "this daemon has no audit handler"
        with self._lock:
            if self._command_busy:
                return "an audit is already running"
            wait = self._audit_started + AUDIT_MIN_INTERVAL_S - time.monotonic()
            if wait > 0:
                return (f"at most one audit every {AUDIT_MIN_INTERVAL_S:g} s; the next may "
                        f"start in {wait:.1f} s")
            self._command_busy = True
            self._audit_started = time.monotonic()

        def work() -> None:
            try:
                summary = handler(payload)
                self.publish_audit(summary)
                self.publish_event("command_done", {"command": "audit", **ref})
            except Exception as exc:
                log.exception("audit command failed")
                self.publish_event("command_failed", {"command": "audit",
                                                      "reason": _reason(exc), **ref})
            finally:
                with self._lock:
                    self._command_busy = False

        threading.Thread(target=work, name="edged-mqtt-audit", daemon=True).start()
        return None

    # -- stopping ----------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        client = self._client
        if client is None:
            return
        if not self._connected:
            self._abandon()  # no CONNACK yet: closing the socket lets the Will speak
            return
        with self._lock:
            audit, self._audit = self._audit, None
            new_items = self._new_items
        if audit is not None:
            self._publish_other(client, "audit", audit, "audit")
        if new_items:  # the last telemetry goes out before the offline state (PUBACKs come
            self._fill_window(client)  # in order); whatever does not fit stays spooled
        self._publish_other(client, "state", dumps(
            {"online": False, "ts": _now(), "seq": death_seq(self.bdseq),
             "bdSeq": self.bdseq}), "offline")
        while (not self._offline_acked and self._client is not None
               and not self._drop_client and time.monotonic() < self._stop_deadline):
            self._service(0.05)
        if self._client is not None and not self._drop_client:
            client.disconnect()
            while client.want_write() and time.monotonic() < self._stop_deadline:
                if client.loop_write() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    break
        log.info("MQTT stopped (offline state %s)",
                 "acknowledged" if self._offline_acked else "not acknowledged")
        self._abandon()

    def _close(self) -> None:
        for sock in (self._wake_r, self._wake_w):
            sock.close()
        if self._owns_spool:
            self.spool.close()


class LogPublisher:
    """No broker configured: the same payloads, one JSON line each, to `edged.telemetry.loop`
    (`{"topic": "telemetry", "ts", "seq", "bdSeq", ...}`); seq counts per topic from 1 and
    bdSeq is 0, since there is no connection."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("edged.telemetry.loop")
        self._lock = threading.Lock()
        self._seq = dict.fromkeys(KINDS, 0)
        self._birth: dict[str, Any] = {}
        self._started = False

    def __repr__(self) -> str:
        return "LogPublisher()"

    @property
    def connected(self) -> bool:
        return False

    def set_birth(self, info: dict[str, Any]) -> None:
        _check_keys(info, "birth info")
        self._birth = dict(info)
        if self._started:
            self._emit("state", {"online": True, **self._birth})

    def publish_telemetry(self, payload: dict[str, Any]) -> int | None:
        _check_keys(payload, "telemetry")
        return self._emit("telemetry", payload)

    def publish_event(self, kind: str, detail: dict[str, Any] | None = None) -> int | None:
        detail = detail or {}
        _check_keys(detail, "event detail")
        if "kind" in detail:
            raise ValueError("event detail must not set 'kind'")
        return self._emit("event", {"kind": kind, **detail})

    def publish_audit(self, summary: dict[str, Any]) -> None:
        _check_keys(summary, "audit summary")
        self._emit("audit", summary)

    def set_audit_handler(self, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Commands need a broker; accepted so the daemon need not care which it has."""

    def start(self) -> None:
        self._started = True
        self._emit("state", {"online": True, **self._birth})

    def stop(self, timeout: float = 10.0) -> bool:
        if self._started:
            self._emit("state", {"online": False})
            self._started = False
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"connected": False, "logged": dict(self._seq)}

    def _emit(self, topic: str, payload: dict[str, Any]) -> int:
        with self._lock:
            self._seq[topic] += 1
            seq = self._seq[topic]
        record = {"topic": topic, "ts": payload.get("ts", _now()), "seq": seq, "bdSeq": 0,
                  **payload}
        self.logger.info("%s", dumps(record).decode())
        return seq


def _now() -> float:
    return round(time.time(), 3)


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)
