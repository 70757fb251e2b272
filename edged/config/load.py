"""Reading the config file: bytes to text to TOML to the frozen `Config`."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection
from pathlib import Path

from edged.config import sections, security_table, thermal_table, tuning_table
from edged.config.checks import Checker, ConfigError
from edged.config.models import models
from edged.config.schema import Config, toml_keys
from sysconf.cpulist import parse_cpulist

DEFAULT_CONFIG_PATH = Path("/etc/edged/edged.toml")


def load_config(
    path: str | Path = DEFAULT_CONFIG_PATH, online_cpus: Collection[int] | str | None = "live"
) -> Config:
    """Read and validate the file; every problem raises ConfigError naming it. CPU lists
    are checked against this machine's online CPUs ("live"), the ones given, or not."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(path, None, "no such file") from None
    except PermissionError:
        raise ConfigError(path, None, "permission denied") from None
    except IsADirectoryError:
        raise ConfigError(path, None, "is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(path, None, exc.strerror or str(exc)) from None
    try:
        text = data.decode("utf-8-sig")  # tolerate the BOM some editors write
    except UnicodeDecodeError as exc:
        raise ConfigError(path, None, f"not UTF-8 text (byte {exc.start})") from None
    if online_cpus == "live":
        online_cpus = live_online_cpus()
    return parse_config(text, Path(path), online_cpus)  # type: ignore[arg-type]


def live_online_cpus() -> set[int] | None:
    """This machine's online CPUs (sysfs), or None where that cannot be read."""
    try:
        return set(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text()))
    except (OSError, ValueError):
        return None


def parse_config(text: str, source: Path, online_cpus: Collection[int] | None = None) -> Config:
    """Validate TOML text; relative paths resolve against `source`'s folder. `online_cpus`:
    the CPUs the config's `cpus` lists must name (None: not checked here, e.g. a config
    for an image, whose board's CPUs the caller checks)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib says "... (at line 3, column 7)"; lead with the place, like a compiler.
        msg = str(exc)
        where = re.search(r" \(at (line \d+, column \d+|end of document)\)$", msg)
        if where:
            msg = f"{where.group(1)}: {msg[: where.start()]}"
        raise ConfigError(source, None, msg) from None
    check = Checker(source, online_cpus)
    check.keys(doc, None, toml_keys(Config))
    server = sections.server(check, check.table(doc, "server"))
    check.max_model_bytes = server.max_model_bytes
    selection = sections.selection(check, check.table(doc, "selection"))
    security = security_table.security(check, check.table(doc, "security"))
    security_table.gate(check, security)
    found = models(check, doc.get("models", []))
    telemetry = sections.telemetry(check, check.table(doc, "telemetry"))
    audit = sections.audit(check, check.table(doc, "audit"))
    server = sections.hang_bound(check, check.table(doc, "server"), server, found)
    frigate = sections.frigate(check, check.table(doc, "frigate"), server)
    trace = sections.trace(check, check.table(doc, "trace"))
    tuning = tuning_table.tuning(check, check.table(doc, "tuning"))
    security_table.checkable(check, security, found)
    thermal = thermal_table.thermal(check, check.table(doc, "thermal"))
    return Config(
        check.absolute,
        server,
        selection,
        found,
        telemetry,
        audit,
        frigate,
        trace,
        tuning,
        security,
        thermal,
    )
