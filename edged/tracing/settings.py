"""What is traced: the [trace] table (TraceConfig) and the trace extension's settings
(TraceSetting), global or per model, as Triton's `/v2[/models/{m}]/trace/setting` and gRPC
`TraceSetting` read and answer them. Both transports hand their request here as a mapping
of setting name to a list of strings (None: clear the model's own value), so the checks and
the messages are one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
DEFAULT_URL = "http://localhost:4318/v1/traces"  # an OTLP/HTTP collector on the device


class TraceSettingError(ValueError):
    """A trace setting that cannot be taken; its message names the setting and the value."""


@dataclass(frozen=True)
class TraceSetting:
    """One scope's settings (Triton's names without the trace_ prefix)."""

    level: tuple[str, ...] = ("OFF",)  # ("OFF",) or some of TIMESTAMPS, TENSORS
    rate: int = 1000  # one request traced in every `rate`
    count: int = -1  # traces left to take (-1: no limit)
    log_frequency: int = 0  # write the file every N traces (0: at shutdown)

    @property
    def on(self) -> bool:
        return self.level != ("OFF",) and self.count != 0

    def response(self, mode: str, file: Path | None) -> dict[str, Any]:
        """The settings as Triton answers them: strings, and the level as a list."""
        answer: dict[str, Any] = {
            "trace_level": list(self.level),
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
        }
        if mode == "triton":
            answer["log_frequency"] = str(self.log_frequency)
            answer["trace_file"] = str(file) if file is not None else ""
        answer["trace_mode"] = mode
        return answer


@dataclass(frozen=True)
class TraceConfig:
    """[trace]: the mode and the global settings the daemon starts with."""

    mode: str = "triton"  # "triton": Triton's JSON trace file; "opentelemetry": OTLP spans
    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    # The trace file (triton mode); None: <state_dir>/trace.json. Not settable over the API,
    # as in Triton: a client must not choose where the daemon writes.
    file: Path | None = None
    url: str = DEFAULT_URL  # opentelemetry mode: the collector's OTLP/HTTP traces endpoint
    # Extra OpenTelemetry resource attributes, as (key, value) pairs (hashable, as the
    # config is).
    resource: tuple[tuple[str, str], ...] = ()

    @property
    def setting(self) -> TraceSetting:
        return TraceSetting(self.level, self.rate, self.count, self.log_frequency)


def read_level(values: Any) -> tuple[str, ...]:
    """trace_level: a list of OFF | TIMESTAMPS | TENSORS (OFF alone)."""
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, list | tuple) or not values:
        raise TraceSettingError(f"trace_level must be a list of {', '.join(LEVELS)}")
    for value in values:
        if value not in LEVELS:
            raise TraceSettingError(
                f"trace_level: unknown level {value!r}; expected {', '.join(LEVELS)}"
            )
    if "OFF" in values:
        if len(values) > 1:
            raise TraceSettingError("trace_level: OFF must be given alone")
        return ("OFF",)
    return tuple(level for level in LEVELS if level in values)


def read_int(name: str, value: Any, low: int) -> int:
    """An integer setting, given as a string (Triton's form) or a number."""
    if isinstance(value, list | tuple) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool):
        raise TraceSettingError(f"Unable to parse '{name}', got: {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise TraceSettingError(f"Unable to parse '{name}', got: {value!r}") from None
    if number < low or number > 2**31 - 1:
        raise TraceSettingError(
            f"Unable to parse '{name}', expecting a value from {low} to {2**31 - 1}, got: {number}"
        )
    return number


KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency")


def updated(
    current: TraceSetting, changes: Mapping[str, Any], fallback: TraceSetting
) -> TraceSetting:
    """`current` with `changes` applied (None clears a value: it becomes `fallback`'s)."""
    new = {}
    for key, value in changes.items():
        if key == "trace_file":
            raise TraceSettingError(
                "trace file location can not be updated through network protocol "
                "(set [trace] file in the config)"
            )
        if key == "trace_mode":
            raise TraceSettingError("trace_mode is set by [trace] mode in the config")
        if key not in KEYS:
            raise TraceSettingError(f"unknown trace setting {key!r}; expected {', '.join(KEYS)}")
        attr = "level" if key == "trace_level" else key.removeprefix("trace_")
        if value is None:
            new[attr] = getattr(fallback, attr)
        elif key == "trace_level":
            new[attr] = read_level(value)
        elif key == "trace_rate":
            new[attr] = read_int(key, value, 1)
        elif key == "trace_count":
            new[attr] = read_int(key, value, -1)
        else:
            new[attr] = read_int(key, value, 0)
    return replace(current, **new)
