"""`LogPublisher`: no broker configured, so the publisher's payloads go to the log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from edged.telemetry.mqtt.payloads import check_keys, dumps, event_record, now
from edged.telemetry.topics import KINDS


class LogPublisher:
    """The same payloads, one JSON line each, to `edged.telemetry.loop` (`{"topic":
    "telemetry", "ts", "seq", "bdSeq", ...}`); seq counts per topic from 1 and bdSeq is 0,
    since there is no connection."""

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
        check_keys(info, "birth info")
        self._birth = dict(info)
        if self._started:
            self._emit("state", {"online": True, **self._birth})

    def publish_telemetry(self, payload: dict[str, Any]) -> int | None:
        check_keys(payload, "telemetry")
        return self._emit("telemetry", payload)

    def publish_event(self, kind: str, detail: dict[str, Any] | None = None) -> int | None:
        return self._emit("event", event_record(kind, detail))

    def publish_audit(self, summary: dict[str, Any]) -> None:
        check_keys(summary, "audit summary")
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
        record = {"topic": topic, "ts": payload.get("ts", now()), "seq": seq, "bdSeq": 0, **payload}
        self.logger.info("%s", dumps(record).decode())
        return seq
