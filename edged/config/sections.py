"""The checks of [server], [selection], [telemetry] with [telemetry.mqtt], [audit] and [trace]; the
[[models]] tables have theirs in `edged.config.models`."""

from __future__ import annotations

import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from edged.config.checks import Checker, Table, show
from edged.config.schema import (
    LOG_LEVELS,
    MAX_SOCKET_PATH,
    MODEL_CONTROL,
    MQTT_PROTOCOLS,
    AuditConfig,
    FrigateConfig,
    ModelConfig,
    MqttSettings,
    ServerConfig,
    TelemetryConfig,
)
from edged.selection.policy import Policy
from edged.telemetry.topics import is_level
from edged.tracing.settings import MODES, TraceConfig, TraceSettingError, read_level

MQTT_FILES = ("ca_file", "cert_file", "key_file", "password_file")


def server(check: Checker, data: Mapping[str, Any]) -> ServerConfig:
    t = Table(check, data, "server", ServerConfig)
    d = ServerConfig()
    host, port = (
        (d.listen_host, d.listen_port) if "listen" not in t else listen(check, t.string("listen"))
    )
    raw_socket = t.string("socket")
    socket = check.path(raw_socket, "server.socket") if raw_socket else None
    _check_socket_path(check, socket, "server.socket")
    if host is None and socket is None:
        raise check.fail(
            "server.listen", 'is "" and so is server.socket: nothing could reach the daemon'
        )
    grpc_host, grpc_port = grpc_listen(check, t, host, port)
    if "grpc_socket" in t:
        raw_grpc = t.string("grpc_socket")
        grpc_socket = check.path(raw_grpc, "server.grpc_socket") if raw_grpc else None
    else:
        grpc_socket = socket.parent / "grpc.sock" if socket is not None else None
    _check_socket_path(check, grpc_socket, "server.grpc_socket")
    if grpc_socket is not None and grpc_socket == socket:
        raise check.fail("server.grpc_socket", f"{grpc_socket} is server.socket too")
    mode = d.socket_mode
    if "socket_mode" in t:
        raw_mode = t.get("socket_mode")
        if not (
            isinstance(raw_mode, str)
            and re.fullmatch(r"(0o)?[0-7]{1,4}", raw_mode)
            and int(raw_mode.removeprefix("0o"), 8) <= 0o777
        ):
            raise check.fail(
                "server.socket_mode",
                f'must be an octal string such as "0660", got {show(raw_mode)}',
            )
        mode = int(raw_mode.removeprefix("0o"), 8)
    raw_state = t.string("state_dir")
    if not raw_state:
        raise check.fail("server.state_dir", "must not be empty")
    level = t.string("log_level")

    def seconds(key: str) -> float:  # finite, and not a typo'd forever
        return t.number(key, lambda x: 0 < x <= 3600, "a number of seconds > 0 and at most 3600")

    if level.lower() not in LOG_LEVELS:
        raise check.fail(
            "server.log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {level!r}"
        )
    return ServerConfig(
        listen_host=host,
        listen_port=port,
        socket=socket,
        socket_mode=mode,
        state_dir=check.path(raw_state, "server.state_dir"),
        max_body_bytes=t.integer("max_body_bytes", 1),
        log_level=level.lower(),
        housekeeping_cpus=t.read("housekeeping_cpus", check.cpus),
        mlockall=t.boolean("mlockall"),
        max_connections=t.integer("max_connections", 1),
        socket_max_connections=t.integer("socket_max_connections", 1, 65536),
        header_timeout_s=seconds("header_timeout_s"),
        body_timeout_s=seconds("body_timeout_s"),
        idle_timeout_s=seconds("idle_timeout_s"),
        max_header_bytes=t.integer("max_header_bytes", 1024, 2**24),
        max_decode_bytes=t.integer("max_decode_bytes", 2**20, 2**36),
        grpc_listen_host=grpc_host,
        grpc_listen_port=grpc_port,
        grpc_socket=grpc_socket,
        allow_shared_memory=t.boolean("allow_shared_memory"),
        model_control=_model_control(check, t),
        metrics_names=_metrics_names(check, t.string("metrics_names")),
        tcp_control=t.boolean("tcp_control"),
        max_shm_regions=t.integer("max_shm_regions", 1, 4096),
        max_shm_regions_per_client=t.integer("max_shm_regions_per_client", 1, 4096),
        grpc_idle_timeout_s=seconds("grpc_idle_timeout_s"),
        max_models=t.integer("max_models", 1, 1024),
        max_model_bytes=t.integer("max_model_bytes", 1024, 2**40),
        load_dirs=_load_dirs(check, t),
    )


def frigate(check: Checker, data: Mapping[str, Any], server: ServerConfig) -> FrigateConfig:
    t = Table(check, data, "frigate", FrigateConfig)
    if "socket" in t:
        raw = t.string("socket")
        socket = check.path(raw, "frigate.socket") if raw else None
    else:
        socket = server.socket.parent / "frigate.sock" if server.socket is not None else None
    _check_socket_path(check, socket, "frigate.socket")
    if socket is not None and socket in (server.socket, server.grpc_socket):
        raise check.fail("frigate.socket", f"{socket} is a [server] socket too")
    host, port = (
        listen(check, t.string("listen"), "frigate.listen") if "listen" in t else (None, None)
    )
    if host is not None and not _loopback(host):
        # ZMQ has no peer credentials and the protocol no authentication: this machine only.
        raise check.fail(
            "frigate.listen", f"must be a loopback address (127.0.0.1, [::1]), got {host}"
        )
    if (
        host is not None
        and (host, port)
        in (
            (server.listen_host, server.listen_port),
            (server.grpc_listen_host, server.grpc_listen_port),
        )
        and port != 0
    ):
        raise check.fail("frigate.listen", f"{host}:{port} is a [server] address too")
    enabled = t.boolean("enabled")
    if enabled and socket is None and host is None:
        raise check.fail(
            "frigate.socket", 'is "" and frigate.listen is unset: no peer could reach it'
        )
    return FrigateConfig(enabled, socket, host, port, t.integer("max_peers", 1, 65536))


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _load_dirs(check: Checker, t: Table) -> tuple[Path, ...]:
    if "load_dirs" not in t:
        return ()
    raw = t.get("load_dirs")
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise check.fail("server.load_dirs", f"must be an array of folder paths, got {show(raw)}")
    dirs = tuple(check.path(x, f"server.load_dirs[{i}]") for i, x in enumerate(raw))
    for i, folder in enumerate(dirs):
        if not folder.is_dir():
            raise check.fail(f"server.load_dirs[{i}]", f"not a folder: {folder}")
    return dirs


METRICS_NAMES = ("edged", "triton")


def _model_control(check: Checker, t: Table) -> str:
    value = t.string("model_control")
    if value not in MODEL_CONTROL:
        raise check.fail(
            "server.model_control", f"must be one of {', '.join(MODEL_CONTROL)}, got {show(value)}"
        )
    return value


def _metrics_names(check: Checker, value: str) -> str:
    if value not in METRICS_NAMES:
        raise check.fail("server.metrics_names", f'must be "edged" or "triton", got {show(value)}')
    return value


def _check_socket_path(check: Checker, path: Path | None, key: str) -> None:
    if path is not None and len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise check.fail(
            key,
            f"{path} is {len(os.fsencode(path))} bytes; a Unix socket path takes at most "
            f"{MAX_SOCKET_PATH}",
        )


def grpc_listen(
    check: Checker, t: Table, host: str | None, port: int | None
) -> tuple[str | None, int | None]:
    """server.grpc_listen; unset: `listen`'s host and the next port (the one before for
    65535; 0 stays 0: the kernel picks one for each), off with it."""
    if "grpc_listen" in t:
        grpc_host, grpc_port = listen(check, t.string("grpc_listen"), "server.grpc_listen")
        if grpc_host is not None and (grpc_host, grpc_port) == (host, port) and grpc_port:
            raise check.fail("server.grpc_listen", f"{host}:{port} is server.listen too")
        return grpc_host, grpc_port
    if host is None or port is None:
        return None, None
    return host, (port + 1 if port < 65535 else port - 1) if port else 0


def hang_bound(
    check: Checker, data: Mapping[str, Any], server: ServerConfig, models: tuple[ModelConfig, ...]
) -> ServerConfig:
    """server.hang_s, checked against the models: a hang bound at or below a model's
    watchdog_ms would restart the daemon before that model could fail over."""
    slowest = max(models, key=lambda m: m.watchdog_ms, default=None)
    longest_s = slowest.watchdog_ms / 1000.0 if slowest is not None else 0.0
    if "hang_s" not in data:
        return replace(server, hang_s=max(ServerConfig.hang_s, 2 * longest_s))
    hang = check.number(
        data["hang_s"], "server.hang_s", lambda x: 0 < x < math.inf, "a number of seconds > 0"
    )
    if slowest is not None and hang <= longest_s:
        index = models.index(slowest)
        raise check.fail(
            "server.hang_s",
            f"{hang:g} s is not longer than "
            f"models[{index}].watchdog_ms "
            f"({slowest.watchdog_ms} ms): the daemon would "
            f"be restarted before {slowest.name!r} could fail "
            f"over",
        )
    return replace(server, hang_s=hang)


def listen(check: Checker, text: str, key: str = "server.listen") -> tuple[str | None, int | None]:
    if text == "":
        return None, None
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise check.fail(key, f"[{host}] is not an IPv6 address") from None
    elif ":" in host:
        raise check.fail(key, f"an IPv6 address needs brackets, as in [::1]:8000; got {text!r}")
    if not sep or not host or any(c.isspace() for c in host):
        raise check.fail(key, f"expected HOST:PORT, got {text!r}")
    if not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise check.fail(key, f"port must be 0..65535, got {text!r}")
    return host, int(port)


def selection(check: Checker, data: Mapping[str, Any]) -> Policy:
    t = Table(check, data, "selection", Policy)
    max_abs = t.number(
        "max_abs", lambda x: math.isnan(x) or x >= 0, "a number >= 0 (nan: not gated)"
    )
    if "min_cosine" in t and "max_drop" in t:
        raise check.fail(
            "selection.min_cosine",
            "give max_drop or min_cosine (its older spelling, 1 - max_drop), not both",
        )
    if "min_cosine" in t:  # kept from before model families: min_cosine = 1 - max_drop
        max_drop = 1.0 - t.number("min_cosine", lambda x: 0 < x <= 1, "a number above 0, at most 1")
    else:
        max_drop = t.number("max_drop", lambda x: 0 <= x < 1, "a number from 0 to below 1")
    return Policy(
        runs=t.integer("runs", 1, 1_000_000),
        warmup=t.integer("warmup", 0, 100_000),
        time_budget_s=t.number(
            "time_budget_s", lambda x: 0 < x <= 3600, "a number of seconds above 0, at most 3600"
        ),
        max_drop=round(max_drop, 12),
        max_abs=None if max_abs is None or math.isnan(max_abs) else max_abs,
    )


def telemetry(check: Checker, data: Mapping[str, Any]) -> TelemetryConfig:
    t = Table(check, data, "telemetry", TelemetryConfig)
    interval = t.number(
        "interval_s", lambda x: 0.1 <= x <= 86_400, "a number of seconds from 0.1 to 86400"
    )
    settings = mqtt(check, check.table(data, "mqtt")) if "mqtt" in t else None
    payload_file = None
    if "payload_file" in t:
        raw = t.string("payload_file")
        if not raw:
            raise check.fail("telemetry.payload_file", "must not be empty")
        if settings is not None:
            raise check.fail(
                "telemetry.payload_file",
                "is for telemetry without a broker; "
                "with [telemetry.mqtt] the payloads go to the broker",
            )
        payload_file = check.path(raw, "telemetry.payload_file")
        if payload_file.is_dir():
            raise check.fail("telemetry.payload_file", f"is a folder: {payload_file}")
        if not payload_file.parent.is_dir():
            raise check.fail("telemetry.payload_file", f"no such folder: {payload_file.parent}")
    return TelemetryConfig(t.boolean("enabled"), interval, settings, payload_file)


def mqtt(check: Checker, data: Mapping[str, Any]) -> MqttSettings:
    """Everything the publisher needs, checked here once: a broker URL without credentials
    or a path, topic levels, readable TLS and password files that fit the scheme."""
    prefix = "telemetry.mqtt"
    t = Table(check, data, prefix, MqttSettings)
    url = t.string("url")
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname or port == -1:
        raise check.fail(
            f"{prefix}.url", f"expected mqtt://HOST:PORT or mqtts://HOST:PORT, got {url!r}"
        )
    names = {}
    for key in ("group", "device_id"):
        value = t.get(key)
        if value is not None and not is_level(value):
            raise check.fail(
                f"{prefix}.{key}",
                f"must be one MQTT topic level (no '/', '+', '#'), got {show(value)}",
            )
        names[key] = value
    files = {}
    for key in MQTT_FILES:
        if key in t:
            path = check.path(t.string(key), f"{prefix}.{key}")
            if not path.is_file():
                raise check.fail(f"{prefix}.{key}", f"no such file: {path}")
            files[key] = path
    if ("cert_file" in files) != ("key_file" in files):
        raise check.fail(f"{prefix}.cert_file", "cert_file and key_file go together")
    protocol = t.string("protocol")
    if protocol not in MQTT_PROTOCOLS:
        raise check.fail(f"{prefix}.protocol", f'must be "5" or "3.1.1", got {protocol!r}')
    settings = MqttSettings(
        url=url,
        group=names["group"],
        device_id=names["device_id"],
        spool_max_mb=t.number(
            "spool_max_mb", lambda x: 0 < x <= 1_048_576, "a number of MiB above 0, at most 1048576"
        ),
        spool_max_age_days=t.number(
            "spool_max_age_days", lambda x: 0 < x <= 3650, "a number of days above 0, at most 3650"
        ),
        username=t.string("username") or None,
        keepalive_s=t.integer("keepalive_s", 1, 65_535),  # MQTT's max
        protocol=protocol,
        **files,
    )
    _connectable(check, settings)
    return settings


def _connectable(check: Checker, s: MqttSettings) -> None:
    """What the URL must not hold beyond host and port, and what goes with what."""
    prefix = "telemetry.mqtt"
    parts = urllib.parse.urlsplit(s.url)
    if parts.username is not None or parts.password is not None:
        # A password in the URL would end up in configs, logs and process listings.
        raise check.fail(
            f"{prefix}.url", "must not carry user:password@; use username and password_file"
        )
    if parts.port == 0:
        raise check.fail(f"{prefix}.url", f"expected mqtt[s]://HOST[:PORT], got {s.url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise check.fail(
            f"{prefix}.url", f"expected mqtt[s]://HOST[:PORT] and nothing after it, got {s.url!r}"
        )
    if not s.tls and (s.ca_file or s.cert_file or s.key_file):
        raise check.fail(f"{prefix}.url", "ca_file/cert_file/key_file need an mqtts:// url")
    if s.password_file is not None and not s.username:
        raise check.fail(f"{prefix}.username", "required with password_file")


def audit(check: Checker, data: Mapping[str, Any]) -> AuditConfig:
    from sysconf.services import is_protected

    t = Table(check, data, "audit", AuditConfig)
    trim = t.read("trim", check.unit_list)
    for index, unit in enumerate(trim):
        if is_protected(unit):
            raise check.fail(
                f"audit.trim[{index}]", f"{unit!r} is a protected unit and is never trimmed"
            )
    return AuditConfig(trim, t.read("keep", check.unit_list))


def trace(check: Checker, data: Mapping[str, Any]) -> TraceConfig:
    """[trace]: the mode, the global trace settings (as the trace extension checks them)
    and where traces go."""
    t = Table(check, data, "trace", TraceConfig)
    mode = t.string("mode")
    if mode not in MODES:
        raise check.fail("trace.mode", f"expected one of {', '.join(MODES)}, got {show(mode)}")
    try:
        level = read_level(t.get("level"))
    except TraceSettingError as exc:
        raise check.fail("trace.level", str(exc)) from None
    file = None
    if "file" in t:
        file = check.path(t.string("file"), "trace.file")
        if not file.parent.is_dir():
            raise check.fail("trace.file", f"no such folder: {file.parent}")
    url = t.string("url")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise check.fail(
            "trace.url", f"expected an OTLP/HTTP URL (http://HOST:4318/v1/traces), got {show(url)}"
        )
    resource = t.data.get("resource", {})
    if not isinstance(resource, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in resource.items()
    ):
        raise check.fail("trace.resource", "must be a table of strings (resource attributes)")
    return TraceConfig(
        mode,
        level,
        t.integer("rate", 1, 2**31 - 1),
        t.integer("count", -1, 2**31 - 1),
        t.integer("log_frequency", 0, 2**31 - 1),
        file,
        url,
        tuple(sorted(resource.items())),
    )
