"""What goes to the broker: telemetry and events through the spool, the retained state and
audit beside it, and what each PUBACK means (package docstring, "Store-and-forward").

The publish_* methods and set_birth run in the caller's thread: they commit to the spool or
set a field under the lock, and wake the MQTT thread. Everything else runs in the MQTT
thread, with the session's client of the current connection.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edged.telemetry.mqtt.payloads import check_keys, dumps, event_record, now
from edged.telemetry.mqtt.session import RESERVED_INFLIGHT, STATE_SEQ_SPAN, Session, death_seq
from edged.telemetry.settings import MqttSettings
from edged.telemetry.spool import Spool, SpoolError, SpoolFull

log = logging.getLogger("edged.telemetry.mqtt")
TELEMETRY_EXPIRY_S = 3600  # MQTT 5 message expiry of telemetry (from the broker's receipt)
_QUOTA_EXCEEDED = 0x97  # PUBACK reason: try again later, unlike the other failures


class Outbox:
    """The spooled telemetry and events in flight on the current connection, and the
    retained state and audit that wait beside them."""

    def __init__(self, settings: MqttSettings, spool: Spool, session: Session, window: int) -> None:
        self.settings = settings
        self.spool = spool
        self.session = session
        self.window = window
        self._lock = threading.Lock()
        # shared with other threads (under _lock)
        self._birth: dict[str, Any] = {}
        self._birth_wanted = False
        self._audit: bytes | None = None
        self._audit_seq = 0
        self._new_items = True
        # owned by the MQTT thread
        self._connected_at = 0.0
        self._cursor = 0  # the highest spool id handed to this connection
        self.inflight: dict[int, int] = {}  # paho mid -> spool id
        self._others: dict[int, str] = {}  # paho mid -> what (state, audit)
        self._window_now = window
        self._last_drop_check = 0.0
        self._state_seq = 0  # births of this connection (state seq, package docstring)
        self.offline_acked = False
        self.counts = {"published": 0, "acked": 0, "rejected": 0, "replayed": 0, "spool_errors": 0}

    # -- callers' side -------------------------------------------------------------------------

    def set_birth(self, info: dict[str, Any]) -> None:
        check_keys(info, "birth info")
        dumps(info)  # fail in the caller, not in the MQTT thread
        with self._lock:
            self._birth = dict(info)
            self._birth_wanted = True
        self.session.wake()

    def publish_telemetry(self, payload: dict[str, Any]) -> int | None:
        check_keys(payload, "telemetry")
        return self._append(
            "telemetry", {"ts": now(), "bdSeq": self.session.bdseq.value, **payload}
        )

    def publish_event(self, kind: str, detail: dict[str, Any] | None = None) -> int | None:
        return self._append(
            "event", {"ts": now(), "bdSeq": self.session.bdseq.value, **event_record(kind, detail)}
        )

    def publish_answer(self, kind: str, detail: dict[str, Any]) -> int | None:
        """An event that answers a fleet command, spooled as expendable: it never displaces
        telemetry or another event, and goes first when they need room (the spool's module
        doc). None when the spool has no room for it without displacing them."""
        record = {"ts": now(), "bdSeq": self.session.bdseq.value, **event_record(kind, detail)}
        return self._append("event", record, expendable=True)

    def request_birth(self) -> None:
        """Any thread: publish the birth again at the MQTT thread's next turn (cmd/rebirth)."""
        with self._lock:
            self._birth_wanted = True
        self.session.wake()

    def publish_audit(self, summary: dict[str, Any]) -> None:
        check_keys(summary, "audit summary")
        with self._lock:
            self._audit_seq += 1
            self._audit = dumps(
                {"ts": now(), "seq": self._audit_seq, "bdSeq": self.session.bdseq.value, **summary}
            )
        self.session.wake()

    def _append(self, kind: str, record: dict[str, Any], expendable: bool = False) -> int | None:
        data = dumps(record)
        try:
            seq = self.spool.append(self.settings.topic(kind), data, qos=1, expendable=expendable)
        except SpoolFull as exc:  # an answer, with no room but what telemetry holds: the
            log.debug("%s not spooled: %s", kind, exc)  # commands count it as unanswered
            return None
        except (SpoolError, ValueError) as exc:  # ValueError: larger than the whole spool
            self.counts["spool_errors"] += 1
            log.error("%s not spooled: %s", kind, exc)
            return None
        with self._lock:
            self._new_items = True
        self.session.wake()
        return seq

    # -- the connection's side -----------------------------------------------------------------

    def on_connack(self, receive_max: int) -> None:
        """A new connection: everything pending goes again, from the oldest, at most the
        broker's Receive Maximum unacknowledged, less a few slots for state and audit."""
        self._window_now = max(1, min(self.window, receive_max - RESERVED_INFLIGHT))
        self._connected_at = self.spool.now()  # ages are on the spool's clock
        self._state_seq = 0
        self.forget()
        self._cursor = 0
        with self._lock:
            self._birth_wanted = True
            self._new_items = True

    def forget(self) -> None:
        """The client is gone, and with it whatever it had in flight."""
        self.inflight.clear()
        self._others.clear()

    def pump(self) -> None:
        client = self.session.client
        assert client is not None
        with self._lock:
            birth = self._birth_wanted
            self._birth_wanted = False
            audit, self._audit = self._audit, None
            new_items = self._new_items
            self._new_items = False
        if birth:
            self.publish_birth()
        if audit is not None:
            self._publish_other(client, "audit", audit, "audit")
        now_s = time.monotonic()
        if now_s - self._last_drop_check >= 1.0:
            self._last_drop_check = now_s
            self._report_drops()
        if new_items:
            self._fill_window(client)

    def publish_birth(self) -> None:
        client = self.session.client
        assert client is not None
        with self._lock:
            info = dict(self._birth)
        self._state_seq += 1
        bdseq = self.session.bdseq.value
        payload = dumps(
            {
                "online": True,
                "ts": now(),
                "seq": bdseq * STATE_SEQ_SPAN + self._state_seq,
                "bdSeq": bdseq,
                **info,
            }
        )
        self._publish_other(client, "state", payload, "birth")

    def last_words(self) -> None:
        """At a clean stop: the audit and the telemetry still waiting, then the offline
        state (PUBACKs come in order); whatever does not fit the window stays spooled."""
        client = self.session.client
        assert client is not None
        with self._lock:
            audit, self._audit = self._audit, None
            new_items = self._new_items
        if audit is not None:
            self._publish_other(client, "audit", audit, "audit")
        if new_items:
            self._fill_window(client)
        bdseq = self.session.bdseq.value
        self._publish_other(
            client,
            "state",
            dumps({"online": False, "ts": now(), "seq": death_seq(bdseq), "bdSeq": bdseq}),
            "offline",
        )

    def _publish_other(self, client: paho.Client, kind: str, payload: bytes, what: str) -> int:
        info = client.publish(
            self.settings.topic(kind),
            payload,
            qos=1,
            retain=True,
            properties=self.session.json_props(),
        )
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
        room = self._window_now - len(self.inflight)
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
        json_props = self.session.json_props()
        for item in items:
            historical = item.created < self._connected_at
            head = b'{"seq":%d,' % item.id + (b'"historical":true,' if historical else b"")
            body = item.payload[1:] if item.payload[:1] == b"{" else item.payload
            props = telemetry_props if item.topic.endswith("/telemetry") else json_props
            info = client.publish(item.topic, head + body, qos=item.qos, properties=props)
            if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
                log.warning(
                    "publish of spooled message %d failed: %s", item.id, paho.error_string(info.rc)
                )
                break
            self.inflight[info.mid] = item.id
            self._cursor = item.id
            self.counts["published"] += 1
            if historical:
                self.counts["replayed"] += 1
            if client.socket() is None:
                break
        if len(items) == room:
            with self._lock:
                self._new_items = True  # a full batch: there may be more

    def _telemetry_props(self) -> Properties | None:
        props = self.session.json_props()
        if props is not None:
            props.MessageExpiryInterval = TELEMETRY_EXPIRY_S
        return props

    def on_puback(self, mid: int, reason: ReasonCode) -> None:
        what = self._others.pop(mid, None)
        if what is not None:
            if what == "offline":
                self.offline_acked = not reason.is_failure
            if reason.is_failure:
                log.warning("broker refused the %s message: %s", what, reason)
            return
        item_id = self.inflight.pop(mid, None)
        if item_id is None:
            return
        if reason.is_failure:
            if reason.value == _QUOTA_EXCEEDED:
                return  # stays in the spool; sent again on the next connection
            self.counts["rejected"] += 1
            log.warning("broker refused spooled message %d: %s (dropped)", item_id, reason)
        else:
            self.counts["acked"] += 1
        try:
            self.spool.ack(item_id)
        except SpoolError as exc:
            self.counts["spool_errors"] += 1
            log.error("spool ack failed: %s", exc)
