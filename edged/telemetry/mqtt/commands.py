"""`cmd/...` from the fleet: `cmd/rebirth` and `cmd/audit`, each answered by an event.

Commands arrive in the MQTT thread. An audit runs in a worker thread (it reads the whole
system, about 0.2 s of a core here) and at most one per AUDIT_MIN_INTERVAL_S; a rebirth
(the retained state again) at most one per REBIRTH_MIN_INTERVAL_S.

What a flood costs. Every command kind (rebirth, audit, and all unknown names together) has
its own token bucket (`COMMAND_LIMITS`: a burst of ANSWER_BURST, then ANSWERS_PER_S): a
command past it is dropped before its payload is parsed, counted, and reported by one
warning per window (edged.telemetry.mqtt.ratelimit), so garbage on one topic never starves
another command of its answer. A command that is admitted gets exactly one answer event
(command_done, command_rejected or command_failed). The `id` a command carries is echoed
only up to MAX_ID_CHARS: a longer one is refused, its first characters echoed. Answers are
spooled as expendable (edged.telemetry.spool): they never displace telemetry or other
events, and they are the first to go when the spool needs room. A broker-side flood
therefore costs a few answers a second of a few hundred bytes each, never the telemetry the
spool holds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import paho.mqtt.client as paho

from edged.telemetry.mqtt.outbox import Outbox
from edged.telemetry.mqtt.payloads import short_reason
from edged.telemetry.mqtt.ratelimit import KindLimits
from edged.telemetry.topics import COMMAND_PREFIX, json_type

log = logging.getLogger("edged.telemetry.mqtt")
MAX_COMMAND_BYTES = 64 * 1024
MAX_NAME_CHARS = 64  # of a command's name (the topic after cmd/), as answers echo it
AUDIT_MIN_INTERVAL_S = 10.0
REBIRTH_MIN_INTERVAL_S = 1.0
ANSWER_BURST = 10
ANSWERS_PER_S = 1.0
MAX_ID_CHARS = 128
KNOWN = ("audit", "rebirth")
UNKNOWN = "unknown"  # the one bucket every other command name shares
COMMAND_LIMITS = {kind: (ANSWER_BURST, ANSWERS_PER_S) for kind in (*KNOWN, UNKNOWN)}
DROP_REPORT_WINDOW_S = 60.0


class Commands:
    """The commands under `<base>cmd/`; answers go out through the outbox as events."""

    def __init__(self, base: str, outbox: Outbox) -> None:
        self.prefix = base + COMMAND_PREFIX
        self.outbox = outbox
        self.handler: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self._busy = False  # an audit is running (its worker clears it)
        self._audit_started = -math.inf  # monotonic time of the last audit started
        self._rebirth_at = -math.inf  # monotonic time of the last rebirth
        self.limits = KindLimits(COMMAND_LIMITS, DROP_REPORT_WINDOW_S, log, "MQTT commands")
        # commands: received; rejected: not run (refused, or dropped by the limit);
        # unanswered: dropped by the limit, or whose answer the spool had no room for.
        self.counts = {"commands": 0, "commands_rejected": 0, "commands_unanswered": 0}

    def on_command(self, msg: paho.MQTTMessage) -> None:
        self.counts["commands"] += 1
        command = command_name(msg, self.prefix)
        if not self.limits.admit(command if command in KNOWN else UNKNOWN):
            self.counts["commands_rejected"] += 1
            self.counts["commands_unanswered"] += 1
            return
        payload, reason = parse(msg)
        ident = payload.get("id") if payload else None
        ref = {"id": ident[:MAX_ID_CHARS]} if isinstance(ident, str) else {}
        if reason is None and command not in KNOWN:
            reason = f"unknown command; known: {', '.join(KNOWN)}"
        if reason is None and command == "rebirth":
            reason = self._may_rebirth()
        if reason is None and command == "audit":
            reason = self._start_audit(payload or {}, ref)
            if reason is None:
                return  # the worker answers
        if reason is not None:
            self.counts["commands_rejected"] += 1
            log.warning("MQTT command %r rejected: %s", command, reason)
            self._answer("command_rejected", {"command": command, "reason": reason, **ref})
            return
        self.outbox.request_birth()  # rebirth: the MQTT thread publishes it at its next turn
        self._answer("command_done", {"command": "rebirth", **ref})

    def _answer(self, kind: str, detail: dict[str, Any]) -> None:
        if self.outbox.publish_answer(kind, detail) is None:
            self.counts["commands_unanswered"] += 1

    def _may_rebirth(self) -> str | None:
        now = time.monotonic()
        if now - self._rebirth_at < REBIRTH_MIN_INTERVAL_S:
            return f"at most one rebirth every {REBIRTH_MIN_INTERVAL_S:g} s"
        self._rebirth_at = now
        return None

    def _start_audit(self, payload: dict[str, Any], ref: dict[str, Any]) -> str | None:
        handler = self.handler
        if handler is None:
            return "this daemon has no audit handler"
        with self._lock:
            if self._busy:
                return "an audit is already running"
            wait = self._audit_started + AUDIT_MIN_INTERVAL_S - time.monotonic()
            if wait > 0:
                return (
                    f"at most one audit every {AUDIT_MIN_INTERVAL_S:g} s; the next may "
                    f"start in {wait:.1f} s"
                )
            self._busy = True
            self._audit_started = time.monotonic()

        def work() -> None:
            try:
                summary = handler(payload)
                self.outbox.publish_audit(summary)
                self._answer("command_done", {"command": "audit", **ref})
            except Exception as exc:
                log.exception("audit command failed")
                self._answer(
                    "command_failed", {"command": "audit", "reason": short_reason(exc), **ref}
                )
            finally:
                with self._lock:
                    self._busy = False

        threading.Thread(target=work, name="edged-mqtt-audit", daemon=True).start()
        return None


def command_name(msg: paho.MQTTMessage, prefix: str) -> str:
    """The topic after `<base>cmd/`, at most MAX_NAME_CHARS characters. paho's `topic`
    raises UnicodeDecodeError for a topic that is not UTF-8 (brokers should refuse one, but
    a command must not take the MQTT thread down), so such a name is shown with U+FFFD."""
    try:
        topic = msg.topic
    except UnicodeDecodeError:
        raw = msg._topic  # paho keeps the bytes only there
        topic = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else ""
    name = topic[len(prefix) :] if topic.startswith(prefix) else topic
    return name[:MAX_NAME_CHARS]


def parse(msg: paho.MQTTMessage) -> tuple[dict[str, Any] | None, str | None]:
    """(the JSON object, None), or why the command is refused."""
    if msg.retain:
        return None, "retained commands are ignored (they would run at every reconnect)"
    if len(msg.payload) > MAX_COMMAND_BYTES:
        return None, f"payload larger than {MAX_COMMAND_BYTES} bytes"
    try:
        payload = orjson.loads(msg.payload)  # nesting past 1024 levels is a JSONDecodeError
    except orjson.JSONDecodeError as exc:
        return None, f"payload is not JSON: {short_reason(exc)}"
    if not isinstance(payload, dict):
        return None, f"payload must be a JSON object, got {json_type(payload)}"
    if "id" in payload and not isinstance(payload["id"], str):
        return payload, "id must be a string"
    if len(payload.get("id", "")) > MAX_ID_CHARS:
        return payload, f"id longer than {MAX_ID_CHARS} characters"
    return payload, None
