"""`Publisher`: the session, the outbox and the commands in the MQTT thread; and
`open_publisher`, the daemon's one call."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.reasoncodes import ReasonCode

from edged.telemetry.mqtt.commands import Commands
from edged.telemetry.mqtt.log_publisher import LogPublisher
from edged.telemetry.mqtt.outbox import Outbox
from edged.telemetry.mqtt.session import RESERVED_INFLIGHT, Session, device_id_from
from edged.telemetry.settings import MqttSettings
from edged.telemetry.spool import Spool, SpoolError

log = logging.getLogger("edged.telemetry.mqtt")
SPOOL_FILE = "telemetry-spool.sqlite"


def open_publisher(settings: MqttSettings | None, state_dir: Path) -> Publisher | LogPublisher:
    """A broker-backed Publisher with its spool in the state dir (bounded as the settings
    say), or a LogPublisher when no broker is configured. Not started. Raises SpoolError
    for an unusable spool file and SettingsError for an unreadable ca/cert/key/password
    file."""
    if settings is None:
        return LogPublisher()
    spool = Spool(
        Path(state_dir) / SPOOL_FILE,
        max_bytes=settings.spool_max_bytes,
        max_age_s=settings.spool_max_age_s,
    )
    return Publisher(settings, spool, state_dir, owns_spool=True)


class Publisher:
    """Telemetry, events, state and audit to one broker; see the package docstring."""

    def __init__(
        self,
        settings: MqttSettings,
        spool: Spool,
        state_dir: Path,
        *,
        owns_spool: bool = False,
        window: int = 100,
        reconnect_min_s: float = 1.0,
        reconnect_max_s: float = 30.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if settings.device_id is None:
            settings = replace(settings, device_id=device_id_from())
        self.settings = settings
        self.spool = spool
        self._owns_spool = owns_spool
        self.window = max(1, window)
        self.session = Session(
            settings,
            state_dir,
            self,
            inflight=self.window + RESERVED_INFLIGHT,
            reconnect_min_s=reconnect_min_s,
            reconnect_max_s=reconnect_max_s,
            connect_timeout_s=connect_timeout_s,
        )
        self.outbox = Outbox(settings, spool, self.session, self.window)
        self.commands = Commands(settings.base, self.outbox)
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._stop_deadline = 0.0

    def __repr__(self) -> str:
        return (
            f"Publisher(url={self.settings.url!r}, group={self.settings.group!r}, "
            f"device_id={self.settings.device_id!r}, connected={self.connected})"
        )

    # -- the API (any thread) -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.session.connected

    @property
    def bdseq(self) -> int:
        return self.session.bdseq.value

    @property
    def last_error(self) -> str | None:
        return self.session.last_error

    def set_birth(self, info: dict[str, Any]) -> None:
        """Birth metadata (version, hardware, models); republished at once when connected."""
        self.outbox.set_birth(info)

    def publish_telemetry(self, payload: dict[str, Any]) -> int | None:
        """Commit to the spool and return the seq; None if the spool failed (logged)."""
        return self.outbox.publish_telemetry(payload)

    def publish_event(self, kind: str, detail: dict[str, Any] | None = None) -> int | None:
        return self.outbox.publish_event(kind, detail)

    def publish_audit(self, summary: dict[str, Any]) -> None:
        """The latest audit summary, retained; only the newest is kept until it is sent."""
        self.outbox.publish_audit(summary)

    def set_audit_handler(self, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """`cmd/audit` calls handler(command payload) in a worker thread; the summary it
        returns is published on `audit`, and an event answers the command."""
        self.commands.handler = handler

    def start(self) -> None:
        if self._thread is not None or self.session.closed:
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
        self.session.wake()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("MQTT thread did not stop within %.1f s", timeout)
            return False
        return self.outbox.offline_acked

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.connected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stats(self) -> dict[str, Any]:
        try:
            spool = self.spool.stats()
        except SpoolError as exc:
            spool = {"error": str(exc)}
        sent, commands = self.outbox.counts, self.commands.counts
        return {
            "connected": self.connected,
            "bdSeq": self.bdseq,
            "protocol": self.session.protocol,
            "inflight": len(self.outbox.inflight),
            "last_error": self.last_error,
            "published": sent["published"],
            "acked": sent["acked"],
            "rejected": sent["rejected"],
            "replayed": sent["replayed"],
            "connects": self.session.connects,
            "spool_errors": sent["spool_errors"],
            **commands,
            "spool": spool,
        }

    # -- what the session reports (the MQTT thread) ------------------------------------------------

    def on_connack(self, receive_max: int) -> None:
        self.outbox.on_connack(receive_max)

    def on_puback(self, mid: int, reason: ReasonCode) -> None:
        self.outbox.on_puback(mid, reason)

    def on_command(self, msg: paho.MQTTMessage) -> None:
        self.commands.on_command(msg)

    def on_abandon(self) -> None:
        self.outbox.forget()

    # -- the MQTT thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop_requested:
            try:
                if self.session.step():
                    self.outbox.pump()
            except Exception:  # a bug must not end telemetry: log, drop the client, retry
                log.exception("MQTT thread error; reconnecting")
                self.session.lost("internal error")
                time.sleep(0.1)
        try:
            self._shutdown()
        except Exception:
            log.exception("MQTT clean stop failed")
        finally:
            self._close()

    def _shutdown(self) -> None:
        session = self.session
        if session.client is None:
            return
        if not session.connected:
            session.abandon()  # no CONNACK yet: closing the socket lets the Will speak
            return
        self.outbox.last_words()
        while (
            not self.outbox.offline_acked
            and session.client is not None
            and not session.drop_client
            and time.monotonic() < self._stop_deadline
        ):
            session.service(0.05)
        session.disconnect(self._stop_deadline)
        log.info(
            "MQTT stopped (offline state %s)",
            "acknowledged" if self.outbox.offline_acked else "not acknowledged",
        )
        session.abandon()

    def _close(self) -> None:
        self.session.close()
        if self._owns_spool:
            self.spool.close()
