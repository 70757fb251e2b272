"""`edgectl fleet`: every device's latency tail, thermals and liveness, from the MQTT topics the
daemons publish (edged/telemetry/mqtt.py, docs/schema/), as a live table, a one-shot check with an
exit code, and Prometheus metrics.

Throughput. A fleet of 1,000 devices at 1 Hz is 1,000 messages a second for one Python process,
so the work per message is kept small and in one place: paho's network thread calls
`Fleet.handle`, which splits the topic, parses the payload with orjson, checks the few fields
it uses, reduces the telemetry to one immutable record (figures per model, the device's worst
model, its top outlier cause, its hottest zone) and stores it under a lock held only for a
few assignments. Everything else — staleness, thresholds, sorting, the table, the JSON, the
Prometheus families — is computed from a snapshot when it is asked for (about once a second),
never per message. scripts/bench_fleet.py measures it (docs/BENCHMARKS.md, "Fleet monitor").

Liveness. `state` is retained: a birth (`online: true`) or the Last Will / clean-stop payload
(`online: false`). A death whose `bdSeq` is below the current birth's belongs to an older
connection (a Will the broker sends late, after the device already reconnected), and is
ignored, as Sparkplug B does. A device whose telemetry stops for `stale_factor` (3) times its
reported `interval_s` (10 s, the daemon's default, when it has not reported one yet) is
"stale", counted from the last telemetry or, for a device not yet heard, from when the monitor
subscribed.

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

Lag (receive time minus the payload's `ts`) is kept for the last LAG_WINDOW live telemetry
messages; on one machine it is the monitor's and the broker's delay, across machines it also
holds the clock offset between device and monitor. Replayed (`historical`) telemetry is
counted but not in the lag, nor does it replace newer figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import shutil
import signal
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import orjson

# as edged.telemetry.mqtt.TOPIC_ROOT; not imported to keep edgectl's start light
TOPIC_ROOT = "edged/v1"
KINDS = ("state", "telemetry", "event")
DEFAULT_INTERVAL_S = 10.0  # the daemon's [telemetry] interval_s default
DEFAULT_STALE_FACTOR = 3.0
DEFAULT_WAIT_S = 3.0
LAG_WINDOW = 10_000  # lag samples kept (10 s at 1,000 msg/s); sorted at each redraw
QUANTILES = (("0.5", "p50_ms"), ("0.99", "p99_ms"), ("0.999", "p999_ms"))
EXIT_OK, EXIT_BREACH, EXIT_BAD_INPUT = 0, 1, 2
EXIT_FAILED = 1
_BAD_LEVEL = frozenset("/+#\0")
_ENVELOPE = frozenset({"ts", "seq", "bdSeq", "historical", "kind"})


class FleetError(ValueError):
    """Bad input to `edgectl fleet` (a flag, the broker URL, the thresholds file): exit 2."""


class BadPayload(ValueError):
    """A device's message the monitor cannot use; counted and ignored."""


# -- thresholds -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Thresholds:
    """Limits a device must stay within; None: not checked. Offline and stale devices breach
    unless `allow_offline`."""

    max_p99_ms: float | None = None
    max_p999_ms: float | None = None
    max_jitter_ms: float | None = None
    max_temp_c: float | None = None
    allow_offline: bool = False

    @classmethod
    def from_mapping(cls, data: Any, where: str) -> Thresholds:
        """From a parsed TOML/JSON object; every error names the key."""
        if not isinstance(data, dict):
            raise FleetError(f"{where}: expected a table/object of thresholds, got "
                             f"{type(data).__name__}")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise FleetError(f"{where}: unknown key {key!r} (known: "
                                 f"{', '.join(sorted(known))})")
            if key == "allow_offline":
                if not isinstance(value, bool):
                    raise FleetError(f"{where}: {key}: expected true or false, got {value!r}")
            elif (isinstance(value, bool) or not isinstance(value, int | float)
                  or not math.isfinite(value) or value < 0):
                raise FleetError(f"{where}: {key}: expected a number >= 0, got {value!r}")
            values[key] = float(value) if key != "allow_offline" else value
        return cls(**values)

    def with_flags(self, **flags: Any) -> Thresholds:
        """Flags given on the command line override the file."""
        given = {k: v for k, v in flags.items() if v is not None and v is not False}
        for key, value in given.items():
            if key != "allow_offline" and (not math.isfinite(value) or value < 0):
                raise FleetError(f"--{key.replace('_', '-')}: expected a number >= 0, got "
                                 f"{value}")
        return Thresholds(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **given})


def load_thresholds(path: Path) -> Thresholds:
    """A TOML (or, for *.json, JSON) file with the keys of `Thresholds`, at the top level or
    under a [thresholds] table."""
    where = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise FleetError(f"--thresholds {where}: {exc.strerror or exc}") from None
    is_json = path.suffix.lower() == ".json"
    try:
        data = json.loads(raw) if is_json else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError, JSONDecodeError
        raise FleetError(f"{where}: not valid {'JSON' if is_json else 'TOML'}: {exc}") from None
    if isinstance(data, dict) and set(data) == {"thresholds"}:
        data, where = data["thresholds"], f"{where}: [thresholds]"
    return Thresholds.from_mapping(data, where)


# -- what one device told us ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's latest window (total time: queue + compute), ms."""

    count: int
    p50_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    max_ms: float | None
    jitter_ms: float | None
    outlier_count: int
    outliers: dict[str, int]
    backend: str | None

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "p999_ms": self.p999_ms, "max_ms": self.max_ms, "jitter_ms": self.jitter_ms,
                "outlier_count": self.outlier_count, "outliers": dict(self.outliers),
                "backend": self.backend}


def _tail_key(m: ModelFigures) -> tuple[float, float]:
    """Worse tails sort higher: p99.9, then p99; a model without requests is the best."""
    return (-1.0 if m.p999_ms is None else m.p999_ms, -1.0 if m.p99_ms is None else m.p99_ms)


@dataclass(frozen=True, slots=True)
class Telemetry:
    ts: float  # the device's clock
    seq: int | None
    bdseq: int | None
    received: float  # the monitor's monotonic clock
    interval_s: float | None
    models: dict[str, ModelFigures]
    worst: str | None  # the model with the worst tail
    top_cause: tuple[str, int] | None  # summed over the models' outliers
    hottest: tuple[str, float] | None
    throttling: bool | None


@dataclass(frozen=True, slots=True)
class State:
    online: bool
    ts: float
    bdseq: int | None
    version: str | None = None
    backends: dict[str, str | None] = field(default_factory=dict)


@dataclass(slots=True)
class Device:
    group: str
    device: str
    state: State | None = None
    telemetry: Telemetry | None = None
    event: dict[str, Any] | None = None  # the last event: kind, ts and its own keys
    throttling: bool | None = None  # from telemetry or a later `throttling` event
    hottest: tuple[str, float] | None = None
    thermal_ts: float = -math.inf
    messages: int = 0
    bad: int = 0
    last_bad: str | None = None


def _number(value: Any, what: str, *, optional: bool = True) -> float | None:
    # type() checks: bool is an int subclass and must not pass as a number
    if value is None and optional:
        return None
    if type(value) is float or type(value) is int:
        if value < 0:
            raise BadPayload(f"{what}: negative ({value})")
        return float(value)
    raise BadPayload(f"{what}: expected a number, got {_json_type(value)}")


def _count(value: Any, what: str) -> int:
    if type(value) is int and value >= 0:
        return value
    raise BadPayload(f"{what}: expected a count, got {_json_type(value)}")


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _envelope(p: Any) -> tuple[float, int | None, int | None]:
    if type(p) is not dict:
        raise BadPayload(f"expected a JSON object, got {_json_type(p)}")
    ts = p.get("ts")
    if type(ts) is not float and type(ts) is not int:
        raise BadPayload(f"ts: expected a number, got {_json_type(ts)}")
    seq, bdseq = p.get("seq"), p.get("bdSeq")
    if seq is not None and type(seq) is not int:
        raise BadPayload(f"seq: expected an integer, got {_json_type(seq)}")
    if bdseq is not None and type(bdseq) is not int:
        raise BadPayload(f"bdSeq: expected an integer, got {_json_type(bdseq)}")
    return float(ts), seq, bdseq


def parse_telemetry(p: Any, received: float) -> Telemetry:
    ts, seq, bdseq = _envelope(p)
    models_in = p.get("models")
    if type(models_in) is not dict:
        raise BadPayload(f"models: expected an object, got {_json_type(models_in)}")
    models: dict[str, ModelFigures] = {}
    causes: dict[str, int] = {}
    for name, m in models_in.items():
        if type(m) is not dict:
            raise BadPayload(f"models.{name}: expected an object, got {_json_type(m)}")
        outliers = m.get("outliers") or {}
        if type(outliers) is not dict:
            raise BadPayload(f"models.{name}.outliers: expected an object")
        for cause, n in outliers.items():
            causes[cause] = causes.get(cause, 0) + _count(n, f"models.{name}.outliers.{cause}")
        backend = m.get("backend")
        models[name] = ModelFigures(
            _count(m.get("count", 0), f"models.{name}.count"),
            _number(m.get("p50_ms"), f"models.{name}.p50_ms"),
            _number(m.get("p99_ms"), f"models.{name}.p99_ms"),
            _number(m.get("p999_ms"), f"models.{name}.p999_ms"),
            _number(m.get("max_ms"), f"models.{name}.max_ms"),
            _number(m.get("jitter_ms"), f"models.{name}.jitter_ms"),
            _count(m.get("outlier_count", 0), f"models.{name}.outlier_count"),
            outliers, backend if type(backend) is str else None)
    worst = max(models, key=lambda n: _tail_key(models[n])) if models else None
    top = None
    if causes:  # the most frequent cause; ties go to the name that sorts first
        cause = min(causes, key=lambda c: (-causes[c], c))
        if causes[cause] > 0:
            top = (cause, causes[cause])
    hottest, throttling = _thermal(p.get("thermal"))
    interval = p.get("interval_s")
    interval = _number(interval, "interval_s") or None
    return Telemetry(ts, seq, bdseq, received, interval, models, worst, top, hottest,
                     throttling)


def _thermal(thermal: Any) -> tuple[tuple[str, float] | None, bool | None]:
    """`sysconf.thermal.ThermalState.to_dict()`: only `hottest` and `throttling` are used."""
    if thermal is None:
        return None, None
    if type(thermal) is not dict:
        raise BadPayload(f"thermal: expected an object, got {_json_type(thermal)}")
    hottest = thermal.get("hottest")
    if hottest is not None:
        if type(hottest) is not dict:
            raise BadPayload(f"thermal.hottest: expected an object, got {_json_type(hottest)}")
        name, temp = hottest.get("name"), hottest.get("temp_c")
        if type(name) is not str or (type(temp) is not float and type(temp) is not int):
            raise BadPayload("thermal.hottest: expected {name: string, temp_c: number}")
        hottest = (name, float(temp))
    throttling = thermal.get("throttling")
    if throttling is not None and type(throttling) is not bool:
        raise BadPayload(f"thermal.throttling: expected a boolean, got {_json_type(throttling)}")
    return hottest, throttling


def parse_state(p: Any) -> State:
    ts, _seq, bdseq = _envelope(p)
    online = p.get("online")
    if type(online) is not bool:
        raise BadPayload(f"online: expected a boolean, got {_json_type(online)}")
    version = p.get("version")
    models = p.get("models")
    backends = {}
    if type(models) is dict:
        for name, info in models.items():
            backend = info.get("backend") if type(info) is dict else None
            backends[name] = backend if type(backend) is str else None
    return State(online, ts, bdseq, version if type(version) is str else None, backends)


def parse_event(p: Any) -> dict[str, Any]:
    ts, _seq, _bdseq = _envelope(p)
    kind = p.get("kind")
    if type(kind) is not str or not kind:
        raise BadPayload(f"kind: expected a non-empty string, got {_json_type(kind)}")
    event = {"kind": kind, "ts": ts}
    event.update((k, v) for k, v in p.items() if k not in _ENVELOPE)
    return event


# -- the aggregate ----------------------------------------------------------------------------

class Fleet:
    """Every device's latest state, telemetry and event. `handle` is called from paho's
    thread; `devices`/`rows` from any other. The lock covers assignments only."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall
        self.started = clock()  # staleness of devices never heard counts from here
        self._lock = threading.Lock()
        self._devices: dict[tuple[str, str], Device] = {}
        # Written by the handling thread only; read racily (ints) by the others.
        self.counts = {"state": 0, "telemetry": 0, "event": 0}
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
        parts = topic.split("/")
        if len(parts) != 5 or parts[4] not in self.counts:
            self.count_bad(None, f"{topic}: not an edged/v1/<group>/<device>/<kind> topic")
            return
        group, name, kind = parts[2], parts[3], parts[4]
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
                if (record["kind"] == "throttling" and type(throttling) is bool
                        and record["ts"] >= device.thermal_ts):
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
        if (not s.online and old is not None and old.online and old.bdseq is not None
                and s.bdseq is not None and s.bdseq < old.bdseq):
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
            return [Device(d.group, d.device, d.state, d.telemetry, d.event, d.throttling,
                           d.hottest, d.thermal_ts, d.messages, d.bad, d.last_bad)
                    for d in self._devices.values()]

    def lag_quantiles(self) -> dict[str, float | None]:
        lags = sorted(list(self.lag))  # list(deque): one C call, safe against appends
        if not lags:
            return {"p50_s": None, "p99_s": None, "max_s": None, "samples": 0}
        return {"p50_s": _quantile(lags, 0.5), "p99_s": _quantile(lags, 0.99),
                "max_s": lags[-1], "samples": len(lags)}

    def stats(self) -> dict[str, Any]:
        return {"messages": dict(self.counts), "bad_payloads": self.bad,
                "late": self.late, "historical": self.historical,
                "ignored_deaths": self.ignored_deaths, "last_bad": self.last_bad,
                "lag": self.lag_quantiles()}


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- rows: what the table, the JSON and the alerts show ----------------------------------------

def device_row(d: Device, now: float, thresholds: Thresholds, *, started: float,
               stale_factor: float = DEFAULT_STALE_FACTOR) -> dict[str, Any]:
    """One device as a JSON object (the `--json` list holds these), breaches included."""
    t = d.telemetry
    interval = (t.interval_s if t is not None else None) or DEFAULT_INTERVAL_S
    heard = t.received if t is not None else started
    age = None if t is None else round(max(0.0, now - t.received), 3)
    silent = now - heard
    stale = stale_factor > 0 and silent > stale_factor * interval
    if d.state is not None and not d.state.online:
        state = "offline"
    elif stale and (d.state is not None or t is not None):
        state = "stale"
    elif d.state is not None or t is not None:
        state = "online"
    else:
        state = "unknown"  # only malformed messages so far
    worst = t.models[t.worst] if t is not None and t.worst is not None else None
    row: dict[str, Any] = {
        "group": d.group, "device": d.device, "state": state,
        "online": None if d.state is None and t is None else state in ("online", "stale"),
        "stale": stale and state == "stale",
        "bdSeq": d.state.bdseq if d.state is not None else (t.bdseq if t else None),
        "version": d.state.version if d.state is not None else None,
        "state_ts": d.state.ts if d.state is not None else None,
        "telemetry_ts": t.ts if t is not None else None,
        "seq": t.seq if t is not None else None,
        "age_s": age, "interval_s": t.interval_s if t is not None else None,
        "worst_model": t.worst if t is not None else None,
        "p50_ms": worst.p50_ms if worst else None,
        "p99_ms": worst.p99_ms if worst else None,
        "p999_ms": worst.p999_ms if worst else None,
        "jitter_ms": worst.jitter_ms if worst else None,
        "top_cause": (None if t is None or t.top_cause is None
                      else {"cause": t.top_cause[0], "count": t.top_cause[1]}),
        "hottest": (None if d.hottest is None
                    else {"name": d.hottest[0], "temp_c": d.hottest[1]}),
        "throttling": d.throttling,
        "last_event": d.event,
        "models": {} if t is None else {n: m.to_json() for n, m in t.models.items()},
        "backends": d.state.backends if d.state is not None else {},
        "messages": d.messages, "bad_payloads": d.bad, "last_bad": d.last_bad,
    }
    row["breaches"] = breaches(row, t, thresholds, silent, interval)
    return row


def breaches(row: dict[str, Any], t: Telemetry | None, th: Thresholds, silent: float,
             interval: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not th.allow_offline:
        if row["state"] == "offline":
            out.append({"what": "offline", "text": "offline"})
        elif row["state"] == "stale":
            out.append({"what": "stale", "text": f"stale: no telemetry for {silent:.0f} s "
                                                 f"(interval {interval:g} s)"})
    if t is not None:
        for what, limit, attr, label in (("p99", th.max_p99_ms, "p99_ms", "p99"),
                                         ("p999", th.max_p999_ms, "p999_ms", "p99.9"),
                                         ("jitter", th.max_jitter_ms, "jitter_ms", "jitter")):
            if limit is None:
                continue
            for name, m in sorted(t.models.items()):
                value = getattr(m, attr)
                if value is not None and value > limit:
                    out.append({"what": what, "model": name, "value": value, "limit": limit,
                                "text": f"{label} {value:g} ms > {limit:g} ms ({name})"})
    hottest = row["hottest"]
    if th.max_temp_c is not None and hottest is not None and hottest["temp_c"] > th.max_temp_c:
        out.append({"what": "temp", "zone": hottest["name"], "value": hottest["temp_c"],
                    "limit": th.max_temp_c,
                    "text": f"temp {hottest['temp_c']:g} °C > {th.max_temp_c:g} °C "
                            f"({hottest['name']})"})
    return out


def _sort_key(row: dict[str, Any]) -> tuple:
    p999, p99 = row["p999_ms"], row["p99_ms"]
    return (p999 is None, -(p999 or 0.0), p99 is None, -(p99 or 0.0), row["group"],
            row["device"])


def fleet_rows(fleet: Fleet, thresholds: Thresholds, *,
               stale_factor: float = DEFAULT_STALE_FACTOR) -> list[dict[str, Any]]:
    """Every device, worst tail (p99.9, then p99) first; devices without figures last."""
    now = fleet.clock()
    rows = [device_row(d, now, thresholds, started=fleet.started, stale_factor=stale_factor)
            for d in fleet.devices()]
    rows.sort(key=_sort_key)
    return rows


# -- the table --------------------------------------------------------------------------------

COLUMNS = ("", "DEVICE", "GROUP", "STATE", "MODEL", "P50", "P99", "P99.9", "JITTER",
           "TOP CAUSE", "HOTTEST", "THROTTLING", "AGE")
_RIGHT = frozenset({"P50", "P99", "P99.9", "JITTER", "AGE"})


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    cause = row["top_cause"]
    hottest = row["hottest"]
    throttling = row["throttling"]
    return ("!" if row["breaches"] else "", row["device"][:40], row["group"][:24], row["state"],
            (row["worst_model"] or "-")[:24], _ms(row["p50_ms"]), _ms(row["p99_ms"]),
            _ms(row["p999_ms"]), _ms(row["jitter_ms"]),
            "-" if cause is None else f"{cause['cause']} ({cause['count']})",
            "-" if hottest is None else f"{hottest['name']} {hottest['temp_c']:.1f}°C",
            "-" if throttling is None else ("yes" if throttling else "no"),
            "-" if row["age_s"] is None else f"{row['age_s']:.1f}s")


def format_table(rows: list[dict[str, Any]], *, title: str = "",
                 max_rows: int | None = None, footer: Iterable[str] = ()) -> str:
    """The table, times in ms; `!` marks a row that breaches a threshold."""
    shown = rows if max_rows is None else rows[:max(0, max_rows)]
    cells = [_cells(r) for r in shown]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(COLUMNS)]
    lines = [title] if title else []

    def line(values: Sequence[str]) -> str:
        return " ".join(v.rjust(w) if COLUMNS[i] in _RIGHT else v.ljust(w)
                        for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    lines.append(line(COLUMNS))
    lines += [line(c) for c in cells]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more (smaller tails)")
    lines += list(footer)
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], fleet: Fleet) -> str:
    states = collections.Counter(r["state"] for r in rows)
    lag = fleet.lag_quantiles()
    lag_text = ("" if lag["p99_s"] is None
                else f", lag p50 {lag['p50_s'] * 1e3:.0f} ms p99 {lag['p99_s'] * 1e3:.0f} ms")
    parts = ", ".join(f"{states[s]} {s}" for s in ("online", "stale", "offline", "unknown")
                      if states[s])
    return (f"{len(rows)} devices ({parts or 'none'}), "
            f"{sum(1 for r in rows if r['breaches'])} breaching; "
            f"{sum(fleet.counts.values())} messages, {fleet.bad} malformed{lag_text}")


# -- Prometheus -------------------------------------------------------------------------------

class FleetCollector:
    """A custom collector: the families are built from a snapshot at each scrape, so the
    message path never touches prometheus_client."""

    def __init__(self, fleet: Fleet, thresholds: Thresholds, stale_factor: float) -> None:
        self.fleet = fleet
        self.thresholds = thresholds
        self.stale_factor = stale_factor

    def describe(self) -> list:
        return []  # unchecked collector: families vary with the fleet

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fleet = self.fleet
        rows = fleet_rows(fleet, self.thresholds, stale_factor=self.stale_factor)
        gd = ["group", "device"]
        up = GaugeMetricFamily("edged_fleet_device_up", "1 when the device is online and its "
                               "telemetry is not stale, else 0", labels=gd)
        latency = GaugeMetricFamily(
            "edged_fleet_latency_seconds", "Request latency (queue + compute) quantiles of "
            "the device's last telemetry window", labels=[*gd, "model", "quantile"])
        jitter = GaugeMetricFamily("edged_fleet_jitter_seconds", "p99 minus p50 of the "
                                   "device's last telemetry window", labels=[*gd, "model"])
        requests = GaugeMetricFamily("edged_fleet_window_requests", "Requests in the "
                                     "device's last telemetry window", labels=[*gd, "model"])
        temp = GaugeMetricFamily("edged_fleet_temperature_celsius", "The device's hottest "
                                 "thermal reading", labels=[*gd, "zone"])
        throttling = GaugeMetricFamily("edged_fleet_throttling", "1 while the device reports "
                                       "thermal or power throttling", labels=gd)
        outliers = GaugeMetricFamily(
            "edged_fleet_outliers", "Outliers (requests above the previous window's p99) "
            "each cause touched, in the device's last telemetry window only: a per-window "
            "count that is replaced, not a running total", labels=[*gd, "model", "cause"])
        seen = GaugeMetricFamily("edged_fleet_last_telemetry_timestamp_seconds", "The "
                                 "device's ts of its newest telemetry (device clock)",
                                 labels=gd)
        breaching = GaugeMetricFamily("edged_fleet_breaching", "Thresholds the device "
                                      "breaches now (edgectl fleet's own)", labels=gd)
        for r in rows:
            key = [r["group"], r["device"]]
            up.add_metric(key, 1.0 if r["state"] == "online" else 0.0)
            breaching.add_metric(key, float(len(r["breaches"])))
            if r["throttling"] is not None:
                throttling.add_metric(key, 1.0 if r["throttling"] else 0.0)
            if r["hottest"] is not None:
                temp.add_metric([*key, r["hottest"]["name"]], r["hottest"]["temp_c"])
            if r["telemetry_ts"] is not None:
                seen.add_metric(key, r["telemetry_ts"])
            for model, m in r["models"].items():
                # payloads carry milliseconds; Prometheus wants seconds, the base unit
                for q, attr in QUANTILES:
                    if m[attr] is not None:
                        latency.add_metric([*key, model, q], m[attr] / 1e3)
                if m["jitter_ms"] is not None:
                    jitter.add_metric([*key, model], m["jitter_ms"] / 1e3)
                requests.add_metric([*key, model], float(m["count"]))
                for cause, n in m["outliers"].items():
                    outliers.add_metric([*key, model, cause], float(n))
        devices = GaugeMetricFamily("edged_fleet_devices", "Devices known, by state",
                                    labels=["state"])
        states = collections.Counter(r["state"] for r in rows)
        for s in ("online", "stale", "offline", "unknown"):
            devices.add_metric([s], float(states[s]))
        messages = CounterMetricFamily("edged_fleet_messages", "Messages received and "
                                       "parsed, by topic kind", labels=["kind"])
        for kind, n in fleet.counts.items():
            messages.add_metric([kind], float(n))
        bad = CounterMetricFamily("edged_fleet_bad_payloads", "Messages ignored: not JSON, "
                                  "or fields of the wrong type")
        bad.add_metric([], float(fleet.bad))
        lag = GaugeMetricFamily("edged_fleet_telemetry_lag_seconds", "Receive time minus "
                                "the payload's ts over the recent live telemetry (includes "
                                "device clock offset)", labels=["quantile"])
        lq = fleet.lag_quantiles()
        for q, k in (("0.5", "p50_s"), ("0.99", "p99_s")):
            if lq[k] is not None:
                lag.add_metric([q], lq[k])
        yield from (up, latency, jitter, requests, temp, throttling, outliers, seen, breaching,
                    devices, messages, bad, lag)


DEFAULT_PROMETHEUS_ADDR = "127.0.0.1"  # loopback: the fleet's figures are not for everyone


def serve_prometheus(collector: FleetCollector, port: int,
                     addr: str = DEFAULT_PROMETHEUS_ADDR):
    """prometheus_client's own HTTP server on addr:port; returns the server."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server


def _listen_address(addr: str) -> str:
    """An IP address to bind to (0.0.0.0 / :: for every interface); anything else is a
    FleetError naming the flag."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        raise FleetError(f"--prometheus-addr: expected an IP address such as 127.0.0.1, "
                         f"0.0.0.0 or ::, got {addr!r}") from None


def _host_port(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


# -- the MQTT side ----------------------------------------------------------------------------

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
        raise FleetError("--broker: must not carry user:password@; use --username and "
                         "--password-file")
    if not parts.hostname or port == 0 or parts.path not in ("", "/") or parts.query:
        raise FleetError(f"--broker: expected mqtt[s]://HOST[:PORT], got {url!r}")
    tls = parts.scheme == "mqtts"
    return BrokerAddress(url, parts.hostname, port or (8883 if tls else 1883), tls)


def subscriptions(group: str | None = None, share: str | None = None) -> list[str]:
    prefix = f"$share/{share}/" if share else ""
    return [f"{prefix}{TOPIC_ROOT}/{group or '+'}/+/{kind}" for kind in KINDS]


def _check_level(value: str | None, flag: str) -> None:
    if value is not None and (not value or _BAD_LEVEL & set(value)):
        raise FleetError(f"{flag}: must be a non-empty MQTT topic level (no '/', '+', '#'), "
                         f"got {value!r}")


class Monitor:
    """One paho client (MQTT 5, QoS 1 subscriptions) feeding a Fleet. paho's own thread
    (`loop_start`) reads, parses and reconnects (1 s doubling to 30 s); messages lost while
    the monitor itself is disconnected are not recovered (a clean session), the next window
    of each device brings it up to date."""

    def __init__(self, broker: BrokerAddress, fleet: Fleet, *, group: str | None = None,
                 share: str | None = None, username: str | None = None,
                 password_file: Path | None = None, ca_file: Path | None = None,
                 keepalive_s: int = 30, err: TextIO | None = None) -> None:
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
        client = paho.Client(CallbackAPIVersion.VERSION2,
                             client_id=f"edgectl-fleet-{uuid.uuid4().hex[:12]}",
                             protocol=MQTTProtocolVersion.MQTTv5)
        client.reconnect_delay_set(1, 30)
        if username:
            password = None
            if password_file is not None:
                try:
                    password = password_file.read_text().strip()
                except OSError as exc:
                    raise FleetError(f"--password-file {password_file}: "
                                     f"{exc.strerror or exc}") from None
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
        options = SubscribeOptions(qos=1, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND
                                   if self.shared else SubscribeOptions.RETAIN_SEND_ON_SUBSCRIBE)
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


# -- the command ------------------------------------------------------------------------------

SHARE_HELP = ("MQTT 5 shared subscription $share/NAME/edged/v1/...: monitors with the same "
              "NAME split the messages between them. Retained messages are not delivered on "
              "shared subscriptions (this monitor also drops any a broker sends), so a "
              "device's online/offline comes from the state messages published while this "
              "runs (telemetry marks a device online). The split is per message, not per "
              "device: with K monitors raise --stale-factor to about 3*K")


def add_fleet_parser(sub) -> None:
    """Add `fleet` and its flags to an argparse subparsers object."""
    p = sub.add_parser(
        "fleet", help="live table of every device's latency tail, thermals and state (MQTT)",
        description="Watch edged devices over MQTT: p50/p99/p99.9, jitter, top outlier cause, "
                    "hottest zone, throttling and liveness per device, worst tail first. "
                    "With --once, exit 1 when any device breaches a threshold.")
    p.add_argument("--broker", required=True, metavar="URL",
                   help="mqtt://HOST[:1883] or mqtts://HOST[:8883]")
    p.add_argument("--group", default=None, help="only this device group (default: all)")
    p.add_argument("--json", action="store_true",
                   help="a JSON list of device objects (live: one list per line each refresh)")
    p.add_argument("--once", action="store_true",
                   help="collect for --wait seconds, print once, exit 1 on any breach")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="S",
                   help="with --once: seconds to collect after subscribing (default 3; use "
                        "more than the devices' telemetry interval, 10 s by default, to see "
                        "every device's figures)")
    p.add_argument("--refresh", type=float, default=1.0, metavar="S",
                   help="live mode: seconds between redraws (default 1)")
    p.add_argument("--prometheus", type=int, default=None, metavar="PORT",
                   help="serve the fleet as Prometheus metrics on PORT (of --prometheus-addr)")
    p.add_argument("--prometheus-addr", default=DEFAULT_PROMETHEUS_ADDR, metavar="ADDR",
                   help="IP address the --prometheus server binds to (default 127.0.0.1, "
                        "this host only; 0.0.0.0 or :: for every interface, so a Prometheus "
                        "elsewhere can scrape it)")
    p.add_argument("--thresholds", type=Path, default=None, metavar="FILE",
                   help="TOML (or .json) with max_p99_ms, max_p999_ms, max_jitter_ms, "
                        "max_temp_c, allow_offline; flags override it")
    p.add_argument("--max-p99-ms", type=float, default=None, metavar="X",
                   help="breach when any model's p99 of the last window is above X ms")
    p.add_argument("--max-p999-ms", type=float, default=None, metavar="X",
                   help="... p99.9 above X ms")
    p.add_argument("--max-jitter-ms", type=float, default=None, metavar="X",
                   help="... jitter (p99 - p50) above X ms")
    p.add_argument("--max-temp-c", type=float, default=None, metavar="X",
                   help="breach when the hottest thermal reading is above X °C")
    p.add_argument("--allow-offline", action="store_true",
                   help="offline and stale devices are not breaches")
    p.add_argument("--stale-factor", type=float, default=DEFAULT_STALE_FACTOR, metavar="N",
                   help="stale after N telemetry intervals without telemetry (default 3; "
                        "0: never)")
    p.add_argument("--share", default=None, metavar="NAME", help=SHARE_HELP)
    p.add_argument("--username", default=None)
    p.add_argument("--password-file", type=Path, default=None, metavar="FILE")
    p.add_argument("--ca-file", type=Path, default=None, metavar="FILE",
                   help="CA for an mqtts:// broker (default: the system's)")


def thresholds_from_args(args) -> Thresholds:
    base = load_thresholds(args.thresholds) if args.thresholds else Thresholds()
    return base.with_flags(max_p99_ms=args.max_p99_ms, max_p999_ms=args.max_p999_ms,
                           max_jitter_ms=args.max_jitter_ms, max_temp_c=args.max_temp_c,
                           allow_offline=args.allow_offline)


def cmd_fleet(args, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Exit 0: collected, no device breaches (--once) or stopped with Ctrl-C (live); 1: a
    breach (--once) or the broker could not be used; 2: bad flags, URL or thresholds file."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        thresholds = thresholds_from_args(args)
        broker = parse_broker(args.broker)
        _check_level(args.group, "--group")
        _check_level(args.share, "--share")
        if not args.wait > 0 or not args.refresh > 0:
            raise FleetError("--wait and --refresh must be > 0 seconds")
        if args.stale_factor < 0:
            raise FleetError("--stale-factor must be >= 0")
        if args.prometheus is not None and not 1 <= args.prometheus <= 65535:
            raise FleetError(f"--prometheus: expected a port 1..65535, got {args.prometheus}")
        prometheus_addr = _listen_address(args.prometheus_addr)
        fleet = Fleet()
        monitor = Monitor(broker, fleet, group=args.group, share=args.share,
                          username=args.username, password_file=args.password_file,
                          ca_file=args.ca_file, err=err)
    except FleetError as exc:
        print(f"edgectl: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    server = None
    if args.prometheus is not None:
        try:
            server = serve_prometheus(FleetCollector(fleet, thresholds, args.stale_factor),
                                      args.prometheus, prometheus_addr)
        except OSError as exc:
            print(f"edgectl: error: --prometheus "
                  f"{_host_port(prometheus_addr, args.prometheus)}: "
                  f"{exc.strerror or exc}", file=err)
            return EXIT_FAILED
    monitor.start()
    try:
        if args.once:
            return _once(args, monitor, fleet, thresholds, out, err)
        run_live(monitor, fleet, thresholds, out=out, err=err, refresh_s=args.refresh,
                 as_json=args.json, stale_factor=args.stale_factor)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        monitor.stop()
        if server is not None:
            server.shutdown()
            server.server_close()


def _once(args, monitor: Monitor, fleet: Fleet, thresholds: Thresholds, out: TextIO,
          err: TextIO) -> int:
    connect_timeout = max(5.0, args.wait)
    if not monitor.subscribed.wait(connect_timeout):
        reason = monitor.failure or f"cannot reach {monitor.broker.url}"
        print(f"edgectl: error: {reason} (waited {connect_timeout:g} s)", file=err)
        return EXIT_FAILED
    time.sleep(args.wait)
    rows = fleet_rows(fleet, thresholds, stale_factor=args.stale_factor)
    if args.json:
        out.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        out.write(format_table(rows, title=f"edged fleet at {monitor.broker.url}: "
                                           f"{summary(rows, fleet)}") + "\n")
        for r in rows:
            for b in r["breaches"]:
                out.write(f"BREACH {r['group']}/{r['device']}: {b['text']}\n")
    if fleet.bad:
        print(f"edgectl fleet: ignored {fleet.bad} malformed message(s); last: "
              f"{fleet.last_bad}", file=err)
    out.flush()
    return EXIT_BREACH if any(r["breaches"] for r in rows) else EXIT_OK


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


def run_live(monitor: Monitor, fleet: Fleet, thresholds: Thresholds, *, out: TextIO,
             err: TextIO, refresh_s: float = 1.0, as_json: bool = False,
             stale_factor: float = DEFAULT_STALE_FACTOR,
             until: Callable[[], bool] | None = None) -> None:
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
                title = (f"edged fleet at {monitor.broker.url} "
                         f"{'(connected)' if monitor.connected else '(DISCONNECTED)'} "
                         f"{time.strftime('%H:%M:%S')}: {summary(rows, fleet)}")
                if tty:
                    height = shutil.get_terminal_size((120, 40)).lines
                    footer = ["", "recent alerts:", *recent] if recent else []
                    table = format_table(rows, title=title, footer=footer,
                                         max_rows=max(1, height - 4 - len(footer)))
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m edged.fleet.monitor ...`: the same as `edgectl fleet ...`."""
    parser = argparse.ArgumentParser(prog="edgectl")
    add_fleet_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["fleet", *(sys.argv[1:] if argv is None else argv)])
    return cmd_fleet(args)


if __name__ == "__main__":
    sys.exit(main())
