"""The JSON both publishers write: compact bytes, the keys only the publisher may set, the
timestamp, and a short reason from an exception."""

from __future__ import annotations

import time
from typing import Any

import orjson

# Keys the publisher writes; a payload that brings its own would be ambiguous.
RESERVED = frozenset({"seq", "bdSeq", "historical", "topic"})


def dumps(obj: Any) -> bytes:
    """Compact JSON; NaN and infinities become null (orjson), which strict parsers accept."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def check_keys(payload: dict[str, Any], what: str) -> None:
    """In the caller's thread: a payload that is no dict, or sets a reserved key, fails
    there rather than in the MQTT thread."""
    if not isinstance(payload, dict):
        raise TypeError(f"{what} must be a dict, got {type(payload).__name__}")
    clash = RESERVED & payload.keys()
    if clash:
        raise ValueError(f"{what} must not set {sorted(clash)}: the publisher writes them")


def event_record(kind: str, detail: dict[str, Any] | None) -> dict[str, Any]:
    """`{"kind": kind, **detail}`, the detail checked like any payload."""
    detail = detail or {}
    check_keys(detail, "event detail")
    if "kind" in detail:
        raise ValueError("event detail must not set 'kind'")
    return {"kind": kind, **detail}


def now() -> float:
    return round(time.time(), 3)


def short_reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
