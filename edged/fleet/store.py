"""The fleet monitor's in-memory store: every device's latest state, telemetry and event,
fed one MQTT message at a time.

Throughput. A fleet of 1,000 devices at 1 Hz is 1,000 messages a second for one Python process,
so the work per message is kept small and in one place: paho's network thread calls
`Fleet.handle`, which splits the topic, parses the payload with orjson, checks the few fields
it uses, reduces the telemetry to one immutable record (figures per model, the device's worst
model, its top outlier cause, its hottest zone) and stores it under a lock held only for a
few assignments. Everything else — staleness, thresholds, sorting, the table, the JSON, the
Prometheus families — is computed from a snapshot when it is asked for (about once a second,
edged/fleet/report.py), never per message. scripts/bench_fleet.py measures it
(docs/BENCHMARKS.md, "Fleet monitor").

Liveness. `state` is retained: a birth (`online: true`) or the Last Will / clean-stop payload
(`online: false`). A death whose `bdSeq` is below the current birth's belongs to an older
connection (a Will the broker sends late, after the device already reconnected), and is
ignored, as Sparkplug B does.

Lag (receive time minus the payload's `ts`) is kept for the last LAG_WINDOW live telemetry
messages; on one machine it is the monitor's and the broker's delay, across machines it also
holds the clock offset between device and monitor. Replayed (`historical`) telemetry is
counted but not in the lag, nor does it replace newer figures.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from edged.fleet.payloads import (
    BadPayload,
    Device,
    State,
    Telemetry,
    parse_event,
    parse_state,
    parse_telemetry,
)
from edged.telemetry.topics import split_topic

WATCHED_KINDS = ("state", "telemetry", "event")  # a device's topics the monitor reads
LAG_WINDOW = 10_000  # lag samples kept (10 s at 1,000 msg/s); sorted at each redraw


class Fleet:
    """Every device's latest state, telemetry and event. `handle` is called from paho's
    thread; `devices`/`rows` from any other. The lock covers assignments only."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self.clock = clock
        self.wall = wall
        self.started = clock()  # staleness of devices never heard counts from here
        self._lock = threading.Lock()
        self._devices: dict[tuple[str, str], Device] = {}
        # Written by the handling thread only; read racily (ints) by the others.
        self.counts = dict.fromkeys(WATCHED_KINDS, 0)
        self.bad = 0
        self.late = 0  # telemetry older than what the device already sent (not applied)
        self.historical = 0
        self.ignored_deaths = 0  # Wills of connections older than the current birth
        self.last_bad: str | None = None
        self.lag: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)  # seconds

    def reset_start(self) -> None:
        self.started = self.clock()

    def handle(self, topic: str, payload: bytes) -> None:
        """One message from the broker. Never raises for what a device sent."""
        levels = split_topic(topic)
        if levels is None or levels[2] not in self.counts:
            self.count_bad(None, f"{topic}: not an edged/v1/<group>/<device>/<kind> topic")
            return
        group, name, kind = levels
        now = self.clock()
        try:
            data = orjson.loads(payload)
            if kind == "telemetry":
                record: Any = parse_telemetry(data, now)
            elif kind == "state":
                record = parse_state(data)
            else:
                record = parse_event(data)
        except (orjson.JSONDecodeError, BadPayload) as exc:
            self.count_bad((group, name), f"{topic}: {exc}")
            return
        self.counts[kind] += 1
        historical = type(data) is dict and data.get("historical") is True
        with self._lock:
            device = self._devices.get((group, name))
            if device is None:
                device = self._devices[(group, name)] = Device(group, name)
            device.messages += 1
            if kind == "telemetry":
                self._telemetry(device, record, historical)
            elif kind == "state":
                self._state(device, record)
            else:
                device.event = record
                throttling = record.get("throttling")
                if (
                    record["kind"] == "throttling"
                    and type(throttling) is bool
                    and record["ts"] >= device.thermal_ts
                ):
                    device.throttling, device.thermal_ts = throttling, record["ts"]
        if kind == "telemetry" and not historical:
            self.lag.append(self.wall() - record.ts)

    def _telemetry(self, device: Device, t: Telemetry, historical: bool) -> None:
        if historical:
            self.historical += 1
        old = device.telemetry
        if old is not None and t.ts < old.ts:
            self.late += 1  # a replayed or duplicated older window: keep the newer figures
            return
        device.telemetry = t
        if t.ts >= device.thermal_ts:
            device.thermal_ts = t.ts
            device.hottest, device.throttling = t.hottest, t.throttling

    def _state(self, device: Device, s: State) -> None:
        old = device.state
        if (
            not s.online
            and old is not None
            and old.online
            and old.bdseq is not None
            and s.bdseq is not None
            and s.bdseq < old.bdseq
        ):
            self.ignored_deaths += 1  # the Will of an older connection, delivered late
            return
        device.state = s

    def count_bad(self, key: tuple[str, str] | None, reason: str) -> None:
        self.bad += 1
        self.last_bad = reason
        if key is not None:
            with self._lock:
                device = self._devices.get(key)
                if device is None:
                    device = self._devices[key] = Device(*key)
                device.bad += 1
                device.last_bad = reason

    def devices(self) -> list[Device]:
        """Copies, consistent per device."""
        with self._lock:
            return [
                Device(
                    d.group,
                    d.device,
                    d.state,
                    d.telemetry,
                    d.event,
                    d.throttling,
                    d.hottest,
                    d.thermal_ts,
                    d.messages,
                    d.bad,
                    d.last_bad,
                )
                for d in self._devices.values()
            ]

    def lag_quantiles(self) -> dict[str, float | None]:
        lags = sorted(list(self.lag))  # list(deque): one C call, safe against appends
        if not lags:
            return {"p50_s": None, "p99_s": None, "max_s": None, "samples": 0}
        return {
            "p50_s": _quantile(lags, 0.5),
            "p99_s": _quantile(lags, 0.99),
            "max_s": lags[-1],
            "samples": len(lags),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "messages": dict(self.counts),
            "bad_payloads": self.bad,
            "late": self.late,
            "historical": self.historical,
            "ignored_deaths": self.ignored_deaths,
            "last_bad": self.last_bad,
            "lag": self.lag_quantiles(),
        }


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
