"""The daemon's one TOML config file, validated completely at load.

A broken config must stop the daemon before it binds a socket or loads a model, with one line
that names the file, the key and the problem (`edged.toml: models[1].threads: must be an
integer >= 1, got 0`), so an operator can fix it without reading code. Unknown keys are errors
too: a misspelt `max_batch_szie` silently falling back to a default would be a latency bug that
nobody can see. After `load_config` returns, the objects are frozen and trusted everywhere.

Paths (`models[].path`, `server.socket`, `server.state_dir`) expand `$VAR`/`${VAR}` and `~`,
and a relative path is taken from the config file's folder, not the working directory, so a
config means the same thing whoever starts the daemon from wherever.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import tomllib
import urllib.parse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edged.quantize.calibration import CalibrationError, Preprocess
from edged.quantize.variants import CalibrationSpec
from edged.selection.select import Policy
from sysconf.cpulist import MAX_CPUS, parse_cpulist

DEFAULT_CONFIG_PATH = Path("/etc/edged/edged.toml")
# The test data folder's default, as in scripts/fetch_test_data.py: the demo config names
# ${EDGED_TEST_DATA} and must work on a machine where only `make data` has run.
TEST_DATA_VAR = "EDGED_TEST_DATA"
TEST_DATA_DEFAULT = "~/.cache/edged/test-data"
LOG_LEVELS = ("debug", "info", "warning", "error")
MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# sun_path is 108 bytes on Linux, one of them the terminating NUL; bind() fails beyond that.
MAX_SOCKET_PATH = 107
# Upper bounds of model settings: past these a value is a typo, and taken literally it would
# wedge the daemon (a million threads, a delay of days) instead of failing here.
MAX_THREADS = 256
MAX_BATCH = 1024
MAX_MS = 3_600_000  # one hour, for timeouts, watchdogs and periods
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")

SERVER_KEYS = ("listen", "socket", "socket_mode", "state_dir", "max_body_bytes", "log_level",
               "housekeeping_cpus", "mlockall", "max_connections", "hang_s",
               "socket_max_connections", "header_timeout_s", "body_timeout_s",
               "idle_timeout_s", "max_header_bytes", "max_decode_bytes")
SELECTION_KEYS = ("runs", "warmup", "time_budget_s", "max_drop", "min_cosine", "max_abs")
MODEL_KEYS = ("name", "path", "variants", "calibration", "precision", "backend", "threads",
              "cpus", "shapes", "max_batch_size",
              "preferred_batch_sizes", "max_queue_delay_us", "max_queue_size", "timeout_ms",
              "watchdog_ms", "rt_priority", "period_ms")
TELEMETRY_KEYS = ("enabled", "interval_s", "mqtt", "payload_file")
MQTT_KEYS = ("url", "group", "device_id", "spool_max_mb", "spool_max_age_days", "ca_file",
             "cert_file", "key_file", "username", "password_file", "keepalive_s", "protocol")
AUDIT_KEYS = ("trim", "keep")
# `calibration = { ... }`: the data, a separate evaluation set, and how images become inputs
CALIBRATION_KEYS = ("data", "eval", "resize", "multiple", "color", "scale", "mean", "std",
                    "layout")
TOP_KEYS = {"server": SERVER_KEYS, "selection": SELECTION_KEYS, "models": MODEL_KEYS,
            "telemetry": TELEMETRY_KEYS, "audit": AUDIT_KEYS}
UNIT_NAME = re.compile(r"[A-Za-z0-9:_.@\\-]+")  # a systemd unit name (no path separators)
TOPIC_PART = re.compile(r"[^/#+\x00]+")  # an MQTT topic level without wildcards or separators


class ConfigError(ValueError):
    """One line: `<file>: <key>: <problem>` (no key for file-level problems)."""

    def __init__(self, source: str | Path, key: str | None, problem: str):
        self.source, self.key, self.problem = str(source), key, problem
        super().__init__(": ".join(p for p in (self.source, key, problem) if p))


@dataclass(frozen=True)
class ServerConfig:
    listen_host: str | None = "127.0.0.1"  # None: no TCP listener
    listen_port: int | None = 8000  # 0: the kernel picks a free port
    socket: Path | None = Path("/run/edged/edged.sock")  # None: no Unix socket
    socket_mode: int = 0o660
    state_dir: Path = Path("/var/lib/edged")
    max_body_bytes: int = 64 * 1024 * 1024
    log_level: str = "info"
    # CPUs for the API, reload and telemetry threads; None: every online CPU that no model is
    # pinned to (and all of them when no model is pinned).
    housekeeping_cpus: tuple[int, ...] | None = None
    mlockall: bool = False  # lock the daemon's memory (no page faults on the inference path)
    # TCP connections served at once; one more gets a JSON 503 at once and is closed, so a
    # flood of clients cannot exhaust file descriptors or memory. The Unix socket has its own
    # budget, so idle TCP connections cannot lock out edgectl and health checks.
    max_connections: int = 64
    socket_max_connections: int = 32
    # A connection's request line and headers: complete within header_timeout_s of its
    # opening (or of a later request's first byte), at most max_header_bytes (431 beyond).
    # A connection that sends nothing is closed when the time is up; a partial head gets 408.
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    # The body within body_timeout_s of the headers (408; the request's queue slot is freed).
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0  # a kept-alive connection idle this long between requests
    # Memory that JSON tensor data of large requests may take while it is decoded, estimated
    # before decoding, for all such requests at once: one alone over it gets 413.
    max_decode_bytes: int = 256 * 1024 * 1024
    # A worker busy on one batch longer than this is hung: WATCHDOG=1 pings stop, so systemd
    # restarts the daemon. Longer than every model's watchdog_ms, so fail-over to another
    # backend gets its chance first. Default: 30 s, or twice the largest watchdog_ms.
    hang_s: float = 30.0


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path  # absolute, and the file existed at load: the original (FP32 ONNX/TFLite/IR)
    # Prebuilt versions of it (INT8 QDQ ONNX, full-integer TFLite...), each checked at load
    # to take and give the same inputs and outputs; selection picks among all of them.
    variants: tuple[Path, ...] = ()
    # Data to make INT8 variants from on the device, in the background (edged.quantize.variants).
    calibration: CalibrationSpec | None = None
    precision: str = "auto"  # "int8": serve an INT8 variant only
    backend: str = "auto"  # or "backend[:device[:precision]]", backend name canonical
    threads: int | None = None
    cpus: tuple[int, ...] | None = None  # sorted, unique
    # A plain dict (not a MappingProxyType: that breaks dataclasses.asdict, pickle and
    # deepcopy), left out of the hash so the config stays hashable. Do not mutate it.
    shapes: dict[str, tuple[int, ...]] | None = field(default=None, hash=False)
    max_batch_size: int = 1
    preferred_batch_sizes: tuple[int, ...] = ()  # sorted, each <= max_batch_size
    max_queue_delay_us: int = 0
    max_queue_size: int = 64
    timeout_ms: int = 1000
    watchdog_ms: int = 5000  # a batch running longer than this: fail over to the next backend
    rt_priority: int = 0  # SCHED_FIFO priority (1-99) of the model's worker thread; 0: off
    # The period of a periodic client (a 200 Hz control loop: 5.0); None: requests arrive
    # when they arrive. Lets latency be measured from each scheduled start (coordinated
    # omission): a stall delays the requests that should have been sent during it too.
    period_ms: float | None = None

    @property
    def period_s(self) -> float | None:
        return None if self.period_ms is None else self.period_ms / 1000.0

    def policy(self, base: Policy) -> Policy:
        """The selection policy for this model: measurement settings from `base`, what the
        model runs with (threads, cpus, shapes, backend) from the model."""
        return replace(base, threads=self.threads, cpus=self.cpus, shapes=self.shapes,
                       backend=self.backend, precision=self.precision)


@dataclass(frozen=True)
class MqttConfig:
    url: str  # mqtt://host:port or mqtts://host:port
    group: str = "default"
    device_id: str | None = None  # None: /etc/machine-id
    spool_max_mb: float = 50.0
    spool_max_age_days: float = 7.0
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None  # read at connect time, never logged
    keepalive_s: int = 30
    protocol: str = "5"  # "5" or "3.1.1"


@dataclass(frozen=True)
class TelemetryConfig:
    enabled: bool = True  # false: no telemetry thread, no counter sampling, no publisher
    interval_s: float = 10.0
    mqtt: MqttConfig | None = None  # None: telemetry goes to the log (a summary line each)
    # No broker: every full payload appended here as a JSON line (rotated to <file>.1 at
    # 10 MB); None: full payloads only at log level debug.
    payload_file: Path | None = None


@dataclass(frozen=True)
class AuditConfig:
    trim: tuple[str, ...] = ()  # extra units to trim (mask), beside the built-in candidates
    keep: tuple[str, ...] = ()  # units never to trim


@dataclass(frozen=True)
class Config:
    source: Path  # absolute
    server: ServerConfig = field(default_factory=ServerConfig)
    selection: Policy = field(default_factory=Policy)
    models: tuple[ModelConfig, ...] = ()
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def load_config(path: str | Path = DEFAULT_CONFIG_PATH,
                online_cpus: Collection[int] | str | None = "live") -> Config:
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


def parse_config(text: str, source: Path, online_cpus: Collection[int] | None = None
                 ) -> Config:
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
    v = _Validator(source, online_cpus)
    v.keys(doc, None, tuple(TOP_KEYS))
    server = v.server(v.table(doc, "server"))
    selection = v.selection(v.table(doc, "selection"))
    models = v.models(doc.get("models", []))
    telemetry = v.telemetry(v.table(doc, "telemetry"))
    audit = v.audit(v.table(doc, "audit"))
    server = v.hang_bound(v.table(doc, "server"), server, models)
    return Config(v.absolute, server, selection, models, telemetry, audit)


class _Validator:
    """Per-type checks; each takes the dotted key it is checking so errors can name it."""

    def __init__(self, source: Path, online_cpus: Collection[int] | None = None):
        self.source = source
        self.online = set(online_cpus) if online_cpus is not None else None
        # Absolute but not symlink-resolved: a model symlinked into a content-addressed
        # cache keeps its own name (and extension).
        self.absolute = Path(os.path.normpath(Path(source).absolute()))
        self.base = self.absolute.parent

    def fail(self, key: str | None, problem: str) -> ConfigError:
        return ConfigError(self.source, key, problem)

    # -- structure ------------------------------------------------------------------------

    def keys(self, table: Mapping[str, Any], prefix: str | None, allowed: tuple[str, ...]):
        for key in table:
            if key in allowed:
                continue
            hint = "".join(f"; did you mean {m!r}?"
                           for m in difflib.get_close_matches(key, allowed, n=1))
            if not hint and prefix is None:  # a section's key written above all sections
                hint = "".join(f"; it belongs in {'[[models]]' if s == 'models' else f'[{s}]'}"
                               for s, keys in TOP_KEYS.items() if key in keys)
            raise self.fail(f"{prefix}.{key}" if prefix else key,
                            f"unknown key{hint}; allowed: {', '.join(allowed)}")

    def table(self, doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        value = doc.get(key, {})
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a table ([{key}]), got {_show(value)}")
        return value

    # -- scalars --------------------------------------------------------------------------

    def integer(self, table, key: str, prefix: str, default: int, low: int,
                high: int | None = None) -> int:
        """An integer in [low, high]: every count and duration has an upper bound, so a
        value that passes cannot wedge or kill the daemon later (threads = 1000000)."""
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (
                high is not None and value > high):
            rule = f">= {low}" if high is None else f"from {low} to {high}"
            raise self.fail(f"{prefix}.{key}", f"must be an integer {rule}, "
                                               f"got {_show(value)}")
        return value

    def number(self, table, key: str, prefix: str, default: float,
               ok: Callable[[float], bool], rule: str) -> float:
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
            raise self.fail(f"{prefix}.{key}", f"must be {rule}, got {_show(value)}")
        return float(value)

    def string(self, table, key: str, prefix: str, default: str | None) -> str:
        value = table.get(key, default)
        if value is None:
            raise self.fail(f"{prefix}.{key}", "required")
        if not isinstance(value, str):
            raise self.fail(f"{prefix}.{key}", f"must be a string, got {_show(value)}")
        return value

    def int_list(self, value: Any, key: str, low: int, high: int | None = None
                 ) -> tuple[int, ...]:
        rule = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        if not isinstance(value, list):
            raise self.fail(key, f"must be an array of integers, got {_show(value)}")
        for index, item in enumerate(value):
            if (isinstance(item, bool) or not isinstance(item, int) or item < low
                    or (high is not None and item > high)):
                raise self.fail(f"{key}[{index}]", f"must be {rule}, got {_show(item)}")
        return tuple(value)

    def path(self, raw: str, key: str) -> Path:
        """`$VAR`, `${VAR}` and `~` expanded; relative to the config file's folder."""

        def var(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            value = os.environ.get(name)
            if not value and name == TEST_DATA_VAR:
                return TEST_DATA_DEFAULT
            if value is None:
                raise self.fail(key, f"environment variable {name} is not set (in {raw!r})")
            return value

        expanded = os.path.expanduser(_VAR.sub(var, raw))
        return Path(os.path.normpath(self.base / expanded))  # an absolute one stays itself

    # -- sections -------------------------------------------------------------------------

    def server(self, table: Mapping[str, Any]) -> ServerConfig:
        self.keys(table, "server", SERVER_KEYS)
        d = ServerConfig()
        host, port = self.listen(self.string(table, "listen", "server", "127.0.0.1:8000"))
        raw_socket = self.string(table, "socket", "server", str(d.socket))
        socket = self.path(raw_socket, "server.socket") if raw_socket else None
        if socket is not None and len(os.fsencode(socket)) > MAX_SOCKET_PATH:
            raise self.fail("server.socket", f"{socket} is {len(os.fsencode(socket))} bytes; "
                                             f"a Unix socket path takes at most "
                                             f"{MAX_SOCKET_PATH}")
        if host is None and socket is None:
            raise self.fail("server.listen", 'is "" and so is server.socket: nothing could '
                                             "reach the daemon")
        raw_mode = table.get("socket_mode", "0660")
        if not (isinstance(raw_mode, str) and re.fullmatch(r"(0o)?[0-7]{1,4}", raw_mode)
                and int(raw_mode.removeprefix("0o"), 8) <= 0o777):
            raise self.fail("server.socket_mode", f'must be an octal string such as "0660", '
                                                  f"got {_show(raw_mode)}")
        raw_state = self.string(table, "state_dir", "server", str(d.state_dir))
        if not raw_state:
            raise self.fail("server.state_dir", "must not be empty")
        level = self.string(table, "log_level", "server", d.log_level)

        def bounded(key: str, default: int, low: int, high: int) -> int:
            return self.integer(table, key, "server", default, low, high)

        def seconds(key: str, default: float) -> float:  # finite, and not a typo'd forever
            return self.number(table, key, "server", default, lambda x: 0 < x <= 3600,
                               "a number of seconds > 0 and at most 3600")

        if level.lower() not in LOG_LEVELS:
            raise self.fail("server.log_level", f"must be one of {', '.join(LOG_LEVELS)}, "
                                                f"got {level!r}")
        return ServerConfig(
            listen_host=host,
            listen_port=port,
            socket=socket,
            socket_mode=int(raw_mode.removeprefix("0o"), 8),
            state_dir=self.path(raw_state, "server.state_dir"),
            max_body_bytes=self.integer(table, "max_body_bytes", "server", d.max_body_bytes,
                                        1),
            log_level=level.lower(),
            housekeeping_cpus=self.cpus(table["housekeeping_cpus"], "server.housekeeping_cpus")
            if "housekeeping_cpus" in table else None,
            mlockall=self.boolean(table, "mlockall", "server", False),
            max_connections=self.integer(table, "max_connections", "server",
                                         d.max_connections, 1),
            socket_max_connections=bounded("socket_max_connections",
                                           d.socket_max_connections, 1, 65536),
            header_timeout_s=seconds("header_timeout_s", d.header_timeout_s),
            body_timeout_s=seconds("body_timeout_s", d.body_timeout_s),
            idle_timeout_s=seconds("idle_timeout_s", d.idle_timeout_s),
            max_header_bytes=bounded("max_header_bytes", d.max_header_bytes, 1024, 2**24),
            max_decode_bytes=bounded("max_decode_bytes", d.max_decode_bytes, 2**20, 2**36),
        )

    def hang_bound(self, table: Mapping[str, Any], server: ServerConfig,
                   models: tuple[ModelConfig, ...]) -> ServerConfig:
        """server.hang_s, checked against the models: a hang bound at or below a model's
        watchdog_ms would restart the daemon before that model could fail over."""
        slowest = max(models, key=lambda m: m.watchdog_ms, default=None)
        longest_s = slowest.watchdog_ms / 1000.0 if slowest is not None else 0.0
        if "hang_s" not in table:
            return replace(server, hang_s=max(ServerConfig.hang_s, 2 * longest_s))
        hang = self.number(table, "hang_s", "server", 0, lambda x: 0 < x < math.inf,
                           "a number of seconds > 0")
        if slowest is not None and hang <= longest_s:
            index = models.index(slowest)
            raise self.fail("server.hang_s", f"{hang:g} s is not longer than "
                                             f"models[{index}].watchdog_ms "
                                             f"({slowest.watchdog_ms} ms): the daemon would "
                                             f"be restarted before {slowest.name!r} could fail "
                                             f"over")
        return replace(server, hang_s=hang)

    def listen(self, text: str) -> tuple[str | None, int | None]:
        if text == "":
            return None, None
        host, sep, port = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise self.fail("server.listen", f"[{host}] is not an IPv6 address") from None
        elif ":" in host:
            raise self.fail("server.listen", f"an IPv6 address needs brackets, as in "
                                             f"[::1]:8000; got {text!r}")
        if not sep or not host or any(c.isspace() for c in host):
            raise self.fail("server.listen", f"expected HOST:PORT, got {text!r}")
        if not (port.isascii() and port.isdigit() and int(port) <= 65535):
            raise self.fail("server.listen", f"port must be 0..65535, got {text!r}")
        return host, int(port)

    def selection(self, table: Mapping[str, Any]) -> Policy:
        self.keys(table, "selection", SELECTION_KEYS)
        d = Policy()
        max_abs = self.number(table, "max_abs", "selection", math.nan,
                              lambda x: math.isnan(x) or x >= 0, "a number >= 0 (nan: not gated)")
        if "min_cosine" in table and "max_drop" in table:
            raise self.fail("selection.min_cosine", "give max_drop or min_cosine (its older "
                                                    "spelling, 1 - max_drop), not both")
        if "min_cosine" in table:  # kept from before model families: min_cosine = 1 - max_drop
            max_drop = 1.0 - self.number(table, "min_cosine", "selection", 0,
                                         lambda x: 0 < x <= 1, "a number above 0, at most 1")
        else:
            max_drop = self.number(table, "max_drop", "selection", d.max_drop,
                                   lambda x: 0 <= x < 1, "a number from 0 to below 1")
        return Policy(
            runs=self.integer(table, "runs", "selection", d.runs, 1, 1_000_000),
            warmup=self.integer(table, "warmup", "selection", d.warmup, 0, 100_000),
            time_budget_s=self.number(table, "time_budget_s", "selection", d.time_budget_s,
                                      lambda x: 0 < x <= 3600,
                                      "a number of seconds above 0, at most 3600"),
            max_drop=round(max_drop, 12),
            max_abs=None if math.isnan(max_abs) else max_abs,
        )

    def models(self, value: Any) -> tuple[ModelConfig, ...]:
        if isinstance(value, dict):
            raise self.fail("models", "expected an array of tables ([[models]]), got one "
                                      "table ([models])")
        if not isinstance(value, list):
            raise self.fail("models", f"expected an array of tables ([[models]]), "
                                      f"got {_show(value)}")
        models: list[ModelConfig] = []
        seen: dict[str, int] = {}
        for index, table in enumerate(value):
            model = self.model(table, f"models[{index}]")
            if model.name in seen:
                raise self.fail(f"models[{index}].name", f"duplicate model name "
                                                         f"{model.name!r} (also "
                                                         f"models[{seen[model.name]}])")
            seen[model.name] = index
            models.append(model)
        return tuple(models)

    def model(self, table: Any, prefix: str) -> ModelConfig:
        if not isinstance(table, dict):
            raise self.fail(prefix, f"expected a table, got {_show(table)}")
        if not table:
            raise self.fail(prefix, "empty [[models]] table; name and path are required")
        self.keys(table, prefix, MODEL_KEYS)
        name = self.string(table, "name", prefix, None)
        # Names are URL path segments (/v2/models/<name>): "." and ".." would be rewritten.
        if not MODEL_NAME.fullmatch(name) or set(name) == {"."}:
            raise self.fail(f"{prefix}.name", f"must be letters, digits, '_', '.' or '-' "
                                              f"(not only dots), got {name!r}")
        path = self.model_file(self.string(table, "path", prefix, None), f"{prefix}.path")
        self.sniff(path, f"{prefix}.path")
        variants = self.variants(table, prefix, path)
        precision = self.string(table, "precision", prefix, "auto")
        if precision not in ("auto", "int8"):
            raise self.fail(f"{prefix}.precision", f'must be "auto" or "int8", got '
                                                   f"{precision!r}")
        shapes = self.shapes(table["shapes"], f"{prefix}.shapes") if "shapes" in table else None
        threads = None
        if "threads" in table:
            threads = self.integer(table, "threads", prefix, 0, 1, MAX_THREADS)
        max_batch = self.integer(table, "max_batch_size", prefix, 1, 1, MAX_BATCH)
        preferred = self.int_list(table.get("preferred_batch_sizes", []),
                                  f"{prefix}.preferred_batch_sizes", 1, max_batch)
        if len(set(preferred)) != len(preferred):
            raise self.fail(f"{prefix}.preferred_batch_sizes",
                            f"lists a size twice: {list(preferred)}")
        return ModelConfig(
            name=name,
            path=path,
            variants=variants,
            calibration=self.calibration(table["calibration"], f"{prefix}.calibration", path,
                                         shapes) if "calibration" in table else None,
            precision=precision,
            backend=self.backend(self.string(table, "backend", prefix, "auto"),
                                 f"{prefix}.backend"),
            threads=threads,
            cpus=self.cpus(table["cpus"], f"{prefix}.cpus") if "cpus" in table else None,
            shapes=shapes,
            max_batch_size=max_batch,
            preferred_batch_sizes=tuple(sorted(preferred)),
            max_queue_delay_us=self.integer(table, "max_queue_delay_us", prefix, 0, 0,
                                            10_000_000),
            max_queue_size=self.integer(table, "max_queue_size", prefix, 64, 1, 65_536),
            timeout_ms=self.integer(table, "timeout_ms", prefix, 1000, 1, MAX_MS),
            watchdog_ms=self.integer(table, "watchdog_ms", prefix, 5000, 1, MAX_MS),
            rt_priority=self.rt_priority(table, prefix),
            period_ms=self.number(table, "period_ms", prefix, 0, lambda x: 0 < x <= MAX_MS,
                                  f"a number of milliseconds above 0, at most {MAX_MS}")
            if "period_ms" in table else None,
        )

    def model_file(self, raw: str, key: str) -> Path:
        path = self.path(raw, key)
        if not path.exists():
            raise self.fail(key, f"no such file: {path}")
        if not path.is_file():
            raise self.fail(key, f"not a file: {path}")
        if not os.access(path, os.R_OK):
            raise self.fail(key, f"permission denied: {path}")
        return path

    def sniff(self, path: Path, key: str) -> None:
        """The file is a model edged can read (format, and its whole structure: a
        truncated, random or empty file fails here, naming the key, not at serving)."""
        from backends.base import ModelError
        from backends.model_info import inspect_model

        try:
            inspect_model(path)
        except ModelError as exc:
            raise self.fail(key, str(exc)) from None

    def variants(self, table: Mapping[str, Any], prefix: str, original: Path
                 ) -> tuple[Path, ...]:
        """Each variant exists and takes and gives what the original does (read from the
        files: names, dtypes, fixed dims), so a wrong file fails here, not at serving."""
        from backends.base import ModelError
        from backends.model_info import signature, signature_mismatch

        value = table.get("variants", [])
        if not isinstance(value, list):
            raise self.fail(f"{prefix}.variants", f"must be an array of model paths, got "
                                                  f"{_show(value)}")
        if not value:
            return ()
        try:
            want = signature(original)
        except ModelError as exc:
            raise self.fail(f"{prefix}.path", str(exc)) from None
        paths = []
        for index, raw in enumerate(value):
            key = f"{prefix}.variants[{index}]"
            if not isinstance(raw, str):
                raise self.fail(key, f"must be a path, got {_show(raw)}")
            path = self.model_file(raw, key)
            self.sniff(path, key)
            try:
                got = signature(path)
            except ModelError as exc:
                raise self.fail(key, str(exc)) from None
            problem = signature_mismatch(want, got) if want and got else None
            if problem:
                raise self.fail(key, f"{path} does not match its original {original}: "
                                     f"{problem}")
            paths.append(path)
        return tuple(paths)

    def calibration(self, value: Any, key: str, original: Path,
                    shapes: dict[str, tuple[int, ...]] | None) -> CalibrationSpec:
        """A path (an .npz, a folder of .npy files or of images), or a table with `data`,
        `eval` and the image preprocessing of `edgectl quantize` (resize "HxW", multiple,
        color, scale, mean and std as numbers or arrays, layout). The data is read here
        against the original's inputs, so data that does not fit is an error at load (and
        at --check-config) naming the file and the input."""
        if isinstance(value, str):
            value = {"data": value}
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a path or a table with data = PATH, got "
                                 f"{_show(value)}")
        self.keys(value, key, CALIBRATION_KEYS)
        paths = {}
        for name in ("data", "eval"):
            if name not in value and name == "eval":
                continue
            raw = self.string(value, name, key, None)
            path = self.path(raw, f"{key}.{name}")
            if not path.exists():
                raise self.fail(f"{key}.{name}", f"no such file or folder: {path}")
            paths[name] = path
        pre: dict[str, Any] = {}
        try:
            if "resize" in value:
                from edged.quantize.calibration import parse_size

                pre["size"] = parse_size(self.string(value, "resize", key, None))
            for name in ("mean", "std"):
                if name in value:
                    raw = value[name]
                    items = raw if isinstance(raw, list) else [raw]
                    if not items or any(isinstance(x, bool) or not isinstance(x, int | float)
                                        for x in items):
                        raise self.fail(f"{key}.{name}", f"must be a number or an array of "
                                                         f"numbers, got {_show(raw)}")
                    pre[name] = tuple(float(x) for x in items)
            if "scale" in value:
                pre["scale"] = self.number(value, "scale", key, 0, lambda x: 0 < x < math.inf,
                                           "a number > 0")
            if "multiple" in value:
                pre["multiple"] = self.integer(value, "multiple", key, 32, 1)
            for name in ("color", "layout"):
                if name in value:
                    pre[name] = self.string(value, name, key, None)
            spec = CalibrationSpec(paths["data"], paths.get("eval"), Preprocess(**pre))
            self.calibration_fits(original, spec, shapes, key)
        except CalibrationError as exc:
            raise self.fail(key, str(exc)) from None
        return spec

    def calibration_fits(self, original: Path, spec: CalibrationSpec,
                         shapes: dict[str, tuple[int, ...]] | None, key: str) -> None:
        """The data read as the daemon will read it, against the inputs in the file."""
        from backends.base import ModelError
        from backends.model_info import signature
        from edged.quantize.variants import load_data

        try:
            io = signature(original)
        except ModelError as exc:
            raise self.fail(key.rsplit(".", 1)[0] + ".path", str(exc)) from None
        load_data(original, spec, shapes, io[0] if io else None)

    def telemetry(self, table: Mapping[str, Any]) -> TelemetryConfig:
        self.keys(table, "telemetry", TELEMETRY_KEYS)
        interval = self.number(table, "interval_s", "telemetry", 10.0,
                               lambda x: 0.1 <= x <= 86_400,
                               "a number of seconds from 0.1 to 86400")
        mqtt = None
        if "mqtt" in table:
            mqtt = self.mqtt(self.table(table, "mqtt"))
        payload_file = None
        if "payload_file" in table:
            raw = self.string(table, "payload_file", "telemetry", None)
            if not raw:
                raise self.fail("telemetry.payload_file", "must not be empty")
            if mqtt is not None:
                raise self.fail("telemetry.payload_file", "is for telemetry without a broker; "
                                "with [telemetry.mqtt] the payloads go to the broker")
            payload_file = self.path(raw, "telemetry.payload_file")
            if payload_file.is_dir():
                raise self.fail("telemetry.payload_file", f"is a folder: {payload_file}")
            if not payload_file.parent.is_dir():
                raise self.fail("telemetry.payload_file",
                                f"no such folder: {payload_file.parent}")
        return TelemetryConfig(self.boolean(table, "enabled", "telemetry", True), interval,
                               mqtt, payload_file)

    def audit(self, table: Mapping[str, Any]) -> AuditConfig:
        from sysconf.services import is_protected

        self.keys(table, "audit", AUDIT_KEYS)
        trim = self.unit_list(table, "trim", "audit")
        for index, unit in enumerate(trim):
            if is_protected(unit):
                raise self.fail(f"audit.trim[{index}]",
                                f"{unit!r} is a protected unit and is never trimmed")
        return AuditConfig(trim, self.unit_list(table, "keep", "audit"))

    def unit_list(self, table: Mapping[str, Any], key: str, prefix: str) -> tuple[str, ...]:
        value = table.get(key, [])
        if not isinstance(value, list):
            raise self.fail(f"{prefix}.{key}",
                            f"must be an array of unit names, got {_show(value)}")
        for index, item in enumerate(value):
            if not isinstance(item, str) or not UNIT_NAME.fullmatch(item):
                raise self.fail(f"{prefix}.{key}[{index}]",
                                f"must be a systemd unit name like 'cups.service', "
                                f"got {_show(item)}")
        return tuple(value)

    def mqtt(self, table: Mapping[str, Any]) -> MqttConfig:
        prefix = "telemetry.mqtt"
        self.keys(table, prefix, MQTT_KEYS)
        url = self.string(table, "url", prefix, None)
        parsed = urllib.parse.urlsplit(url)
        try:
            port = parsed.port
        except ValueError:
            port = -1
        if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname or port == -1:
            raise self.fail(f"{prefix}.url", f"expected mqtt://HOST:PORT or mqtts://HOST:PORT, "
                                             f"got {url!r}")
        names = {}
        for key, default in (("group", "default"), ("device_id", None)):
            value = table.get(key, default)
            if value is not None and (not isinstance(value, str)
                                      or not TOPIC_PART.fullmatch(value)):
                raise self.fail(f"{prefix}.{key}", f"must be one MQTT topic level (no '/', "
                                                   f"'+', '#'), got {_show(value)}")
            names[key] = value
        files = {}
        for key in ("ca_file", "cert_file", "key_file", "password_file"):
            if key in table:
                path = self.path(self.string(table, key, prefix, None), f"{prefix}.{key}")
                if not path.is_file():
                    raise self.fail(f"{prefix}.{key}", f"no such file: {path}")
                files[key] = path
        if ("cert_file" in files) != ("key_file" in files):
            raise self.fail(f"{prefix}.cert_file", "cert_file and key_file go together")
        protocol = self.string(table, "protocol", prefix, "5")
        if protocol not in ("5", "3.1.1"):
            raise self.fail(f"{prefix}.protocol", f'must be "5" or "3.1.1", got {protocol!r}')
        return MqttConfig(
            url=url, group=names["group"], device_id=names["device_id"],
            spool_max_mb=self.number(table, "spool_max_mb", prefix, 50.0,
                                     lambda x: 0 < x <= 1_048_576,
                                     "a number of MiB above 0, at most 1048576"),
            spool_max_age_days=self.number(table, "spool_max_age_days", prefix, 7.0,
                                           lambda x: 0 < x <= 3650,
                                           "a number of days above 0, at most 3650"),
            username=self.string(table, "username", prefix, "") or None,
            keepalive_s=self.integer(table, "keepalive_s", prefix, 30, 1, 65_535),  # MQTT's max
            protocol=protocol, **files)

    def rt_priority(self, table: Mapping[str, Any], prefix: str) -> int:
        value = self.integer(table, "rt_priority", prefix, 0, 0)
        if value > 99:
            raise self.fail(f"{prefix}.rt_priority", f"SCHED_FIFO priorities are 1-99 (0 = off), "
                                                     f"got {value}")
        return value

    def boolean(self, table: Mapping[str, Any], key: str, prefix: str, default: bool) -> bool:
        value = table.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(f"{prefix}.{key}", f"must be true or false, got {_show(value)}")
        return value

    def backend(self, spec: str, key: str) -> str:
        """"auto" or "backend[:device[:precision]]"; the backend name made canonical (so
        "ov:CPU" and "openvino:CPU" share one cached selection). Devices and precisions
        depend on the machine and are checked by selection, not here."""
        from backends import REGISTRY, canonical_name  # names only; no runtime is imported

        if spec == "auto":
            return spec
        parts = spec.split(":")
        name = canonical_name(parts[0])
        if name not in REGISTRY or len(parts) > 3 or not all(p.strip() for p in parts):
            raise self.fail(key, f'must be "auto" or BACKEND[:DEVICE[:PRECISION]] with '
                                 f"BACKEND one of {', '.join(REGISTRY)}; got {spec!r}")
        return ":".join([name, *parts[1:]])

    def cpus(self, value: Any, key: str) -> tuple[int, ...]:
        if isinstance(value, str):
            try:
                cpus = tuple(parse_cpulist(value))
            except ValueError as exc:
                raise self.fail(key, str(exc)) from None
        elif isinstance(value, list):
            cpus = tuple(sorted(set(self.int_list(value, key, 0, MAX_CPUS - 1))))
        else:
            raise self.fail(key, f'must be a CPU list string such as "0-1,3" or an array '
                                 f"of integers, got {_show(value)}")
        if not cpus:
            raise self.fail(key, "empty; leave the key out to run the model unpinned")
        missing = [c for c in cpus if self.online is not None and c not in self.online]
        if missing:
            from sysconf.cpulist import format_cpulist

            raise self.fail(key, f"CPU {missing[0]} is not online on this machine (online: "
                                 f"{format_cpulist(sorted(self.online))})")
        return cpus

    def shapes(self, value: Any, key: str) -> dict[str, tuple[int, ...]]:
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a table of input name = [dims], got "
                                 f"{_show(value)}")
        shapes = {}
        for name, dims in value.items():
            shape = self.int_list(dims, f"{key}.{name}", 1)
            if not shape:
                raise self.fail(f"{key}.{name}", "must list at least one dimension")
            shapes[name] = shape
        return shapes


def _show(value: Any) -> str:
    """A value as the TOML file spells it, short enough for a one-line error."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
