"""The limits `edgectl fleet` holds every device to, from a TOML/JSON file and the flags, and
the error for bad input to the command (exit 2)."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


class FleetError(ValueError):
    """Bad input to `edgectl fleet` (a flag, the broker URL, the thresholds file): exit 2."""


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
            raise FleetError(
                f"{where}: expected a table/object of thresholds, got {type(data).__name__}"
            )
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise FleetError(
                    f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})"
                )
            if key == "allow_offline":
                if not isinstance(value, bool):
                    raise FleetError(f"{where}: {key}: expected true or false, got {value!r}")
            elif (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise FleetError(f"{where}: {key}: expected a number >= 0, got {value!r}")
            values[key] = float(value) if key != "allow_offline" else value
        return cls(**values)

    def with_flags(self, **flags: Any) -> Thresholds:
        """Flags given on the command line override the file."""
        given = {k: v for k, v in flags.items() if v is not None and v is not False}
        for key, value in given.items():
            if key != "allow_offline" and (not math.isfinite(value) or value < 0):
                raise FleetError(f"--{key.replace('_', '-')}: expected a number >= 0, got {value}")
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
