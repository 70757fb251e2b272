"""`edgectl fleet`'s monitor: every device's latency tail, thermals and liveness, from the MQTT
topics the daemons publish (edged/telemetry/mqtt/, edged/telemetry/topics.py, docs/schema/),
as a live table, a one-shot check with an exit code (edged/cli/fleet.py), and Prometheus
metrics (edged/fleet/exporter.py). This module is the MQTT side and the live redraw; the
messages are parsed and stored by edged/fleet/store.py, the rows built by edged/fleet/report.py.

Shared subscriptions (`--share NAME`, MQTT 5 `$share/NAME/...`). The broker hands each message
to one member of the share group, so several monitors split the message stream. Two things
follow. Retained messages are not delivered on a shared subscription (the MQTT 5
specification; mosquitto 2.0 sends them to every member anyway, so the monitor subscribes with
retain handling 2, "send none", and drops any stored copy that still comes): the retained
birth/Will of a device that is not changing is not seen, and a device's state comes from the
state messages published while the monitor runs and from its telemetry, which marks it
online. And the split is per message, not per device: with K monitors each sees a given
device's telemetry about every K-th window. Figures stay right (each message is a whole
window), but staleness needs `--stale-factor` raised to about 3 × K.
"""

from __future__ import annotations

import collections
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import orjson

from edged.fleet.report import DEFAULT_STALE_FACTOR, fleet_rows, format_table, summary
from edged.fleet.store import WATCHED_KINDS, Fleet
from edged.fleet.thresholds import FleetError, Thresholds
from edged.telemetry.topics import device_topic


@dataclass(frozen=True)
class BrokerAddress:
    url: str
    host: str
    port: int
    tls: bool


def parse_broker(url: str) -> BrokerAddress:
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts"):
        raise FleetError(f"--broker: must start with mqtt:// or mqtts://, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise FleetError(f"--broker: invalid port in {url!r}") from None
    if parts.username is not None or parts.password is not None:
        raise FleetError(
            "--broker: must not carry user:password@; use --username and --password-file"
        )
    if not parts.hostname or port == 0 or parts.path not in ("", "/") or parts.query:
        raise FleetError(f"--broker: expected mqtt[s]://HOST[:PORT], got {url!r}")
    tls = parts.scheme == "mqtts"
    return BrokerAddress(url, parts.hostname, port or (8883 if tls else 1883), tls)


def subscriptions(group: str | None = None, share: str | None = None) -> list[str]:
    prefix = f"$share/{share}/" if share else ""
    return [prefix + device_topic(group or "+", "+", kind) for kind in WATCHED_KINDS]


class Monitor:
    """One paho client (MQTT 5, QoS 1 subscriptions) feeding a Fleet. paho's own thread
    (`loop_start`) reads, parses and reconnects (1 s doubling to 30 s); messages lost while
    the monitor itself is disconnected are not recovered (a clean session), the next window
    of each device brings it up to date."""

    def __init__(
        self,
        broker: BrokerAddress,
        fleet: Fleet,
        *,
        group: str | None = None,
        share: str | None = None,
        username: str | None = None,
        password_file: Path | None = None,
        ca_file: Path | None = None,
        keepalive_s: int = 30,
        err: TextIO | None = None,
    ) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

        self.broker = broker
        self.fleet = fleet
        self.topics = subscriptions(group, share)
        self.shared = share is not None
        self.retained_ignored = 0
        self.err = err if err is not None else sys.stderr
        self.subscribed = threading.Event()
        self.connected = False
        self.ever_connected = False
        self.failure: str | None = None  # a refusal that retrying will not fix
        self._stopping = False
        self._said_unreachable = False
        self._sub_mid: int | None = None
        self._keepalive = keepalive_s
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"edgectl-fleet-{uuid.uuid4().hex[:12]}",
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        client.reconnect_delay_set(1, 30)
        if username:
            password = None
            if password_file is not None:
                try:
                    password = password_file.read_text().strip()
                except OSError as exc:
                    raise FleetError(
                        f"--password-file {password_file}: {exc.strerror or exc}"
                    ) from None
            client.username_pw_set(username, password)
        if broker.tls:
            try:
                client.tls_set(ca_certs=str(ca_file) if ca_file else None)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise FleetError(f"--ca-file {ca_file}: {exc}") from None
        elif ca_file is not None:
            raise FleetError("--ca-file needs an mqtts:// broker")
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        self.client = client

    def _say(self, text: str) -> None:
        print(f"edgectl fleet: {text}", file=self.err, flush=True)

    def start(self) -> None:
        self.client.connect_async(self.broker.host, self.broker.port, self._keepalive)
        self.client.loop_start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    def _on_connect(self, client, _userdata, _flags, reason, _props) -> None:
        from paho.mqtt.subscribeoptions import SubscribeOptions

        if reason.is_failure:
            self.failure = f"the broker refused the connection: {reason}"
            self._say(f"{self.broker.url}: {self.failure}; retrying")
            return
        self.connected = True
        self._said_unreachable = False
        if self.ever_connected:
            self._say(f"reconnected to {self.broker.url}")
        self.ever_connected = True
        # Shared: "do not send retained messages" (MQTT 5 retain handling 2), what the
        # specification prescribes for shared subscriptions and mosquitto 2.0 does not do.
        options = SubscribeOptions(
            qos=1,
            retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND
            if self.shared
            else SubscribeOptions.RETAIN_SEND_ON_SUBSCRIBE,
        )
        _rc, self._sub_mid = client.subscribe([(t, options) for t in self.topics])

    def _on_subscribe(self, _client, _userdata, mid, reasons, _props) -> None:
        failed = [str(r) for r in reasons if r.is_failure]
        if failed:
            self.failure = f"the broker refused the subscription: {', '.join(failed)}"
            self._say(self.failure)
            return
        self.failure = None
        self.fleet.reset_start()
        self.subscribed.set()
        self._say(f"subscribed to {', '.join(self.topics)} at {self.broker.url}")

    def _on_connect_fail(self, _client, _userdata) -> None:
        if not self._said_unreachable:  # once per outage, not at every retry
            self._said_unreachable = True
            self._say(f"cannot reach {self.broker.url}; retrying")

    def _on_disconnect(self, _client, _userdata, _flags, reason, _props) -> None:
        was = self.connected
        self.connected = False
        self.subscribed.clear()
        if not self._stopping and was:
            self._say(f"lost the broker at {self.broker.url} ({reason}); reconnecting")

    def _on_message(self, _client, _userdata, msg) -> None:
        if self.shared and msg.retain:  # a broker's stored copy: see the module docstring
            self.retained_ignored += 1
            return
        try:
            self.fleet.handle(msg.topic, msg.payload)
        except Exception as exc:  # paho would end its loop on an exception: count, go on
            self.fleet.count_bad(None, f"internal error on {msg.topic!r}: {exc!r}")


class Alerts:
    """A line for each breach that appears, and one when it clears."""

    def __init__(self) -> None:
        self._active: dict[tuple[str, str], dict[tuple, str]] = {}

    def update(self, rows: list[dict[str, Any]], wall: float) -> list[str]:
        stamp = time.strftime("%H:%M:%S", time.localtime(wall))
        lines = []
        seen = set()
        for r in rows:
            key = (r["group"], r["device"])
            seen.add(key)
            now = {(b["what"], b.get("model"), b.get("zone")): b["text"] for b in r["breaches"]}
            before = self._active.get(key, {})
            for k, text in now.items():
                if k not in before:
                    lines.append(f"{stamp} ALERT {key[0]}/{key[1]}: {text}")
            for k in before.keys() - now.keys():
                lines.append(f"{stamp} cleared {key[0]}/{key[1]}: {before[k]}")
            if now:
                self._active[key] = now
            else:
                self._active.pop(key, None)
        for key in set(self._active) - seen:
            del self._active[key]
        return lines


def run_live(
    monitor: Monitor,
    fleet: Fleet,
    thresholds: Thresholds,
    *,
    out: TextIO,
    err: TextIO,
    refresh_s: float = 1.0,
    as_json: bool = False,
    stale_factor: float = DEFAULT_STALE_FACTOR,
    until: Callable[[], bool] | None = None,
) -> None:
    """Redraw every refresh_s until Ctrl-C/SIGTERM (or `until()`): the table on a cleared
    screen on a terminal (plain text with a blank line between redraws otherwise), or one
    JSON list per line; new breaches and cleared ones as lines on stderr and, on a
    terminal, under the table."""
    tty = out.isatty()
    alerts = Alerts()
    recent: collections.deque[str] = collections.deque(maxlen=5)
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        next_at = time.monotonic()
        while not stop.is_set() and not (until and until()):
            rows = fleet_rows(fleet, thresholds, stale_factor=stale_factor)
            new = alerts.update(rows, fleet.wall())
            for text in new:
                print(text, file=err, flush=True)
            recent.extend(new)
            if as_json:
                out.write(orjson.dumps(rows).decode() + "\n")
            else:
                title = (
                    f"edged fleet at {monitor.broker.url} "
                    f"{'(connected)' if monitor.connected else '(DISCONNECTED)'} "
                    f"{time.strftime('%H:%M:%S')}: {summary(rows, fleet)}"
                )
                if tty:
                    height = shutil.get_terminal_size((120, 40)).lines
                    footer = ["", "recent alerts:", *recent] if recent else []
                    table = format_table(
                        rows, title=title, footer=footer, max_rows=max(1, height - 4 - len(footer))
                    )
                    out.write("\x1b[H\x1b[2J" + table + "\n")
                else:
                    out.write(format_table(rows, title=title) + "\n\n")
            out.flush()
            next_at += refresh_s
            stop.wait(max(0.0, next_at - time.monotonic()))
            if next_at < time.monotonic():
                next_at = time.monotonic()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
