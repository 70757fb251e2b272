"""The checks every config key goes through, each naming the dotted key it checks.

`Checker` holds what checks need to know about the file (its name for errors, its folder for
relative paths, the machine's online CPUs); `Table` reads one TOML table into a dataclass of
`schema`, taking the field's default for a key the file leaves out, so no default is written
twice.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from edged.config.schema import TOP_KEYS, ServerConfig, default_of, toml_keys
from sysconf.cpulist import MAX_CPUS, parse_cpulist

# The test data folder's default, as in scripts/fetch_test_data.py: the demo config names
# ${EDGED_TEST_DATA} and must work on a machine where only `make data` has run.
TEST_DATA_VAR = "EDGED_TEST_DATA"
TEST_DATA_DEFAULT = "~/.cache/edged/test-data"
UNIT_NAME = re.compile(r"[A-Za-z0-9:_.@\\-]+")  # a systemd unit name (no path separators)
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


class ConfigError(ValueError):
    """One line: `<file>: <key>: <problem>` (no key for file-level problems)."""

    def __init__(self, source: str | Path, key: str | None, problem: str):
        self.source, self.key, self.problem = str(source), key, problem
        super().__init__(": ".join(p for p in (self.source, key, problem) if p))


class Checker:
    """Per-type checks; each takes the dotted key it is checking so errors can name it."""

    def __init__(self, source: Path, online_cpus: Collection[int] | None = None):
        self.source = source
        self.online = set(online_cpus) if online_cpus is not None else None
        # Absolute but not symlink-resolved: a model symlinked into a content-addressed
        # cache keeps its own name (and extension).
        self.absolute = Path(os.path.normpath(Path(source).absolute()))
        self.base = self.absolute.parent
        # The largest model file read at load ([server] max_model_bytes, set once the
        # [server] table is read; its default before that).
        self.max_model_bytes = default_of(
            next(f for f in fields(ServerConfig) if f.name == "max_model_bytes")
        )
        # Whether a model file may be read for its checks (path, sha256 pin, signature):
        # under [security] models = "enforce", only a trusted one (edged.trust), so no byte
        # of an untrusted file is parsed, not even its header. Set once [security] is read.
        self.may_read: Callable[[Path, str | None, Path | None], bool] = lambda *_: True

    def fail(self, key: str | None, problem: str) -> ConfigError:
        return ConfigError(self.source, key, problem)

    # -- structure ------------------------------------------------------------------------

    def keys(self, table: Mapping[str, Any], prefix: str | None, allowed: tuple[str, ...]):
        for key in table:
            if key in allowed:
                continue
            hint = "".join(
                f"; did you mean {m!r}?" for m in difflib.get_close_matches(key, allowed, n=1)
            )
            if not hint and prefix is None:  # a section's key written above all sections
                hint = "".join(
                    f"; it belongs in {'[[models]]' if s == 'models' else f'[{s}]'}"
                    for s, keys in TOP_KEYS.items()
                    if key in keys
                )
            raise self.fail(
                f"{prefix}.{key}" if prefix else key,
                f"unknown key{hint}; allowed: {', '.join(allowed)}",
            )

    def table(self, doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        value = doc.get(key, {})
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a table ([{key}]), got {show(value)}")
        return value

    # -- values ---------------------------------------------------------------------------

    def integer(self, value: Any, key: str, low: int, high: int | None = None) -> int:
        """An integer in [low, high]: every count and duration has an upper bound, so a
        value that passes cannot wedge or kill the daemon later (threads = 1000000)."""
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < low
            or (high is not None and value > high)
        ):
            rule = f">= {low}" if high is None else f"from {low} to {high}"
            raise self.fail(key, f"must be an integer {rule}, got {show(value)}")
        return value

    def number(self, value: Any, key: str, ok: Callable[[float], bool], rule: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
            raise self.fail(key, f"must be {rule}, got {show(value)}")
        return float(value)

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {show(value)}")
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {show(value)}")
        return value

    def int_list(self, value: Any, key: str, low: int, high: int | None = None) -> tuple[int, ...]:
        rule = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        if not isinstance(value, list):
            raise self.fail(key, f"must be an array of integers, got {show(value)}")
        for index, item in enumerate(value):
            if (
                isinstance(item, bool)
                or not isinstance(item, int)
                or item < low
                or (high is not None and item > high)
            ):
                raise self.fail(f"{key}[{index}]", f"must be {rule}, got {show(item)}")
        return tuple(value)

    def numbers(self, value: Any, key: str) -> tuple[float, ...]:
        """A number or a non-empty array of numbers (per-channel values: mean, std)."""
        items = value if isinstance(value, list) else [value]
        if not items or any(isinstance(x, bool) or not isinstance(x, int | float) for x in items):
            raise self.fail(key, f"must be a number or an array of numbers, got {show(value)}")
        return tuple(float(x) for x in items)

    def path(self, raw: str | Path, key: str) -> Path:
        """`$VAR`, `${VAR}` and `~` expanded; relative to the config file's folder."""

        def var(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            value = os.environ.get(name)
            if not value and name == TEST_DATA_VAR:
                return TEST_DATA_DEFAULT
            if value is None:
                raise self.fail(key, f"environment variable {name} is not set (in {raw!r})")
            return value

        expanded = os.path.expanduser(_VAR.sub(var, str(raw)))
        return Path(os.path.normpath(self.base / expanded))  # an absolute one stays itself

    def unit_list(self, value: Any, key: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise self.fail(key, f"must be an array of unit names, got {show(value)}")
        for index, item in enumerate(value):
            if not isinstance(item, str) or not UNIT_NAME.fullmatch(item):
                raise self.fail(
                    f"{key}[{index}]",
                    f"must be a systemd unit name like 'cups.service', got {show(item)}",
                )
        return tuple(value)

    def cpus(self, value: Any, key: str) -> tuple[int, ...]:
        if isinstance(value, str):
            try:
                cpus = tuple(parse_cpulist(value))
            except ValueError as exc:
                raise self.fail(key, str(exc)) from None
        elif isinstance(value, list):
            cpus = tuple(sorted(set(self.int_list(value, key, 0, MAX_CPUS - 1))))
        else:
            raise self.fail(
                key,
                f'must be a CPU list string such as "0-1,3" or an array '
                f"of integers, got {show(value)}",
            )
        if not cpus:
            raise self.fail(key, "empty; leave the key out to run the model unpinned")
        online = self.online
        missing = [] if online is None else [c for c in cpus if c not in online]
        if online is not None and missing:
            from sysconf.cpulist import format_cpulist

            raise self.fail(
                key,
                f"CPU {missing[0]} is not online on this machine (online: "
                f"{format_cpulist(sorted(online))})",
            )
        return cpus


class Table:
    """One TOML table read into the dataclass `cls`: its keys are checked against the
    fields first, and a key left out takes the field's default (unchecked: defaults are
    valid). `prefix` is the table's dotted name in errors."""

    def __init__(
        self,
        check: Checker,
        data: Mapping[str, Any],
        prefix: str,
        cls: type,
        allowed: tuple[str, ...] | None = None,
    ):
        check.keys(data, prefix, allowed if allowed is not None else toml_keys(cls))
        self.check, self.data, self.prefix = check, data, prefix
        self.defaults = {f.name: default_of(f) for f in fields(cls)}

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def key(self, key: str) -> str:
        return f"{self.prefix}.{key}"

    def get(self, key: str) -> Any:
        """The file's value, else the default; a required key the file lacks fails."""
        value = self.data.get(key, self.defaults.get(key, MISSING))
        if value is MISSING:
            raise self.check.fail(self.key(key), "required")
        return value

    def read(self, key: str, check: Callable[..., Any], *rule: Any) -> Any:
        """`check(value, dotted key, *rule)` of the file's value, else the default."""
        if key not in self.data:
            return self.get(key)
        return check(self.data[key], self.key(key), *rule)

    def integer(self, key: str, low: int, high: int | None = None) -> int:
        return self.read(key, self.check.integer, low, high)

    def number(self, key: str, ok: Callable[[float], bool], rule: str) -> float:
        return self.read(key, self.check.number, ok, rule)

    def string(self, key: str) -> str:
        return self.read(key, self.check.string)

    def boolean(self, key: str) -> bool:
        return self.read(key, self.check.boolean)


def show(value: Any) -> str:
    """A value as the TOML file spells it, short enough for a one-line error."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
