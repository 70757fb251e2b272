"""A caller's W3C trace context (`traceparent`), read from an HTTP header or gRPC metadata.

Read by hand: the header is one fixed format (version-traceid-parentid-flags, lower-case
hex), and it must be read even when the OpenTelemetry packages (an optional extra) are not
installed, because a request that carries it is always traced. An invalid value is ignored,
as the W3C recommendation says: the request is then sampled like one without it."""

from __future__ import annotations

import re
from dataclasses import dataclass

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


@dataclass(frozen=True)
class TraceParent:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits: the caller's span, the parent of edged's request span
    flags: int  # bit 0: the caller sampled it

    @property
    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


def parse_traceparent(value: str | bytes | None) -> TraceParent | None:
    """The header's trace context, or None when absent or invalid."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None  # a version edged cannot know, or version 00 with extra fields
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))
