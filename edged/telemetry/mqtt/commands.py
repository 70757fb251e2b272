"""`cmd/...` from the fleet: `cmd/rebirth` and `cmd/audit`, each answered by an event.

Commands arrive in the MQTT thread. An audit runs in a worker thread (it reads the whole
system, about 0.2 s of a core here) and at most one per AUDIT_MIN_INTERVAL_S; a rebirth
(the retained state again) at most one per REBIRTH_MIN_INTERVAL_S.

Every answer is an event, and every event an fsync'd spool write that shares the spool's
bound with unsent telemetry. So a flood of commands of any kind, known or not, is answered
by at most ANSWER_BURST events and then ANSWERS_PER_S (a token bucket), the rest only
counted; and the `id` a command carries is echoed only up to MAX_ID_CHARS (a longer one is
refused, its first characters echoed). A broker-side flood therefore costs the spool a few
hundred bytes a second, never the telemetry it holds.
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
from edged.telemetry.topics import COMMAND_PREFIX, json_type

log = logging.getLogger("edged.telemetry.mqtt")
MAX_COMMAND_BYTES = 64 * 1024
AUDIT_MIN_INTERVAL_S = 10.0
REBIRTH_MIN_INTERVAL_S = 1.0
ANSWER_BURST = 10
ANSWERS_PER_S = 1.0
MAX_ID_CHARS = 128
KNOWN = ("audit", "rebirth")


class TokenBucket:
    """`burst` at once, then `rate` per second (monotonic clock)."""

    def __init__(self, burst: int, rate: float) -> None:
        self.burst, self.rate = burst, rate
        self.tokens = float(burst)
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


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
        self._answers = TokenBucket(ANSWER_BURST, ANSWERS_PER_S)
        self.counts = {"commands": 0, "commands_rejected": 0, "commands_unanswered": 0}

    def on_command(self, msg: paho.MQTTMessage) -> None:
        command = msg.topic[len(self.prefix) :][:64]
        self.counts["commands"] += 1
        payload, reason = parse(msg)
        ident = payload.get("id") if payload else None
        ref = {"id": ident[:MAX_ID_CHARS]} if isinstance(ident, str) else {}
        if reason is None and command not in KNOWN:
            reason = f"unknown command; known: {', '.join(KNOWN)}"
        if reason is None and command == "rebirth":
            reason = self._may_rebirth()
        if reason is None and command == "audit":
            if not self._answers.take():  # would start work no answer could report
                self.counts["commands_rejected"] += 1
                self.counts["commands_unanswered"] += 1
                return
            reason = self._start_audit(payload or {}, ref)
            if reason is None:
                return
            self._answers.tokens += 1.0  # the refusal below takes this one's place
        if reason is not None:
            self.counts["commands_rejected"] += 1
            if not self._answers.take():
                self.counts["commands_unanswered"] += 1
                return  # a flood: counted, not answered one by one
            log.warning("MQTT command %r rejected: %s", command, reason)
            self.outbox.publish_event(
                "command_rejected", {"command": command, "reason": reason, **ref}
            )
            return
        if command == "rebirth":
            self.outbox.publish_birth()
            if self._answers.take():
                self.outbox.publish_event("command_done", {"command": "rebirth", **ref})
            else:
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
                self.outbox.publish_event("command_done", {"command": "audit", **ref})
            except Exception as exc:
                log.exception("audit command failed")
                self.outbox.publish_event(
                    "command_failed", {"command": "audit", "reason": short_reason(exc), **ref}
                )
            finally:
                with self._lock:
                    self._busy = False

        threading.Thread(target=work, name="edged-mqtt-audit", daemon=True).start()
        return None


def parse(msg: paho.MQTTMessage) -> tuple[dict[str, Any] | None, str | None]:
    """(the JSON object, None), or why the command is refused."""
    if msg.retain:
        return None, "retained commands are ignored (they would run at every reconnect)"
    if len(msg.payload) > MAX_COMMAND_BYTES:
        return None, f"payload larger than {MAX_COMMAND_BYTES} bytes"
    try:
        payload = orjson.loads(msg.payload)  # nesting past 1024 levels is a JSONDecodeError
    except orjson.JSONDecodeError as exc:
        return None, f"payload is not JSON: {exc}"
    if not isinstance(payload, dict):
        return None, f"payload must be a JSON object, got {json_type(payload)}"
    if "id" in payload and not isinstance(payload["id"], str):
        return payload, "id must be a string"
    if len(payload.get("id", "")) > MAX_ID_CHARS:
        return payload, f"id longer than {MAX_ID_CHARS} characters"
    return payload, None
