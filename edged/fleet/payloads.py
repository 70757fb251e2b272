"""What one device told the fleet monitor: its messages (docs/schema/) parsed into small
immutable records, and the per-device record the store keeps.

The parsers run on paho's thread for every message (edged/fleet/store.py), so they check only
the fields the monitor uses, with `type() is` tests (bool is an int subclass and must not pass
as a number), and raise BadPayload naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edged.telemetry.topics import json_type

_ENVELOPE = frozenset({"ts", "seq", "bdSeq", "historical", "kind"})


class BadPayload(ValueError):
    """A device's message the monitor cannot use; counted and ignored."""


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
        return {
            "count": self.count,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "p999_ms": self.p999_ms,
            "max_ms": self.max_ms,
            "jitter_ms": self.jitter_ms,
            "outlier_count": self.outlier_count,
            "outliers": dict(self.outliers),
            "backend": self.backend,
        }


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
    raise BadPayload(f"{what}: expected a number, got {json_type(value)}")


def _count(value: Any, what: str) -> int:
    if type(value) is int and value >= 0:
        return value
    raise BadPayload(f"{what}: expected a count, got {json_type(value)}")


def _envelope(p: Any) -> tuple[float, int | None, int | None]:
    if type(p) is not dict:
        raise BadPayload(f"expected a JSON object, got {json_type(p)}")
    ts = p.get("ts")
    if type(ts) is not float and type(ts) is not int:
        raise BadPayload(f"ts: expected a number, got {json_type(ts)}")
    seq, bdseq = p.get("seq"), p.get("bdSeq")
    if seq is not None and type(seq) is not int:
        raise BadPayload(f"seq: expected an integer, got {json_type(seq)}")
    if bdseq is not None and type(bdseq) is not int:
        raise BadPayload(f"bdSeq: expected an integer, got {json_type(bdseq)}")
    return float(ts), seq, bdseq


def parse_telemetry(p: Any, received: float) -> Telemetry:
    ts, seq, bdseq = _envelope(p)
    models_in = p.get("models")
    if type(models_in) is not dict:
        raise BadPayload(f"models: expected an object, got {json_type(models_in)}")
    models: dict[str, ModelFigures] = {}
    causes: dict[str, int] = {}
    for name, m in models_in.items():
        if type(m) is not dict:
            raise BadPayload(f"models.{name}: expected an object, got {json_type(m)}")
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
            outliers,
            backend if type(backend) is str else None,
        )
    worst = max(models, key=lambda n: _tail_key(models[n])) if models else None
    top = None
    if causes:  # the most frequent cause; ties go to the name that sorts first
        cause = min(causes, key=lambda c: (-causes[c], c))
        if causes[cause] > 0:
            top = (cause, causes[cause])
    hottest, throttling = _thermal(p.get("thermal"))
    interval = p.get("interval_s")
    interval = _number(interval, "interval_s") or None
    return Telemetry(ts, seq, bdseq, received, interval, models, worst, top, hottest, throttling)


def _thermal(thermal: Any) -> tuple[tuple[str, float] | None, bool | None]:
    """`sysconf.thermal.ThermalState.to_dict()`: only `hottest` and `throttling` are used."""
    if thermal is None:
        return None, None
    if type(thermal) is not dict:
        raise BadPayload(f"thermal: expected an object, got {json_type(thermal)}")
    hottest = thermal.get("hottest")
    if hottest is not None:
        if type(hottest) is not dict:
            raise BadPayload(f"thermal.hottest: expected an object, got {json_type(hottest)}")
        name, temp = hottest.get("name"), hottest.get("temp_c")
        if type(name) is not str or (type(temp) is not float and type(temp) is not int):
            raise BadPayload("thermal.hottest: expected {name: string, temp_c: number}")
        hottest = (name, float(temp))
    throttling = thermal.get("throttling")
    if throttling is not None and type(throttling) is not bool:
        raise BadPayload(f"thermal.throttling: expected a boolean, got {json_type(throttling)}")
    return hottest, throttling


def parse_state(p: Any) -> State:
    ts, _seq, bdseq = _envelope(p)
    online = p.get("online")
    if type(online) is not bool:
        raise BadPayload(f"online: expected a boolean, got {json_type(online)}")
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
        raise BadPayload(f"kind: expected a non-empty string, got {json_type(kind)}")
    event = {"kind": kind, "ts": ts}
    event.update((k, v) for k, v in p.items() if k not in _ENVELOPE)
    return event
