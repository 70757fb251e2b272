"""A [[models]] table a client sends (the repository extension's load, `parameters.config`):
checked as the file's tables are, and then held to what the operator allowed.

The config file is the operator's; a load table comes from any client that may load (the
Unix sockets, or loopback TCP with `[server] tcp_control`). So such a table:
- names only the keys in CLIENT_KEYS: not `cpus` or `rt_priority` (the daemon's CPU plan and
  SCHED_FIFO, which it holds CAP_SYS_NICE for), not `calibration` (it reads whole folders and
  starts a background quantization job);
- asks for at most as many `threads` as this machine has CPUs;
- names files only inside `[server] load_dirs` (by default the folders of the config file's
  own models), taken literally: no `$VAR` or `~` expansion, so the daemon's environment never
  reaches an error message, and a path outside those folders is refused before anything
  looks at it, so an error never tells whether a file exists elsewhere.
Every file is then held to the same bounds as the file's own (`max_model_bytes`, regular
files only; edged.config.models).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from edged.config.checks import Checker, ConfigError, show
from edged.config.models import models
from edged.config.schema import ModelConfig, ServerConfig

CLIENT_KEYS = (
    "name",
    "path",
    "variants",
    "precision",
    "backend",
    "scores",
    "threads",
    "shapes",
    "max_batch_size",
    "preferred_batch_sizes",
    "max_queue_delay_us",
    "max_queue_size",
    "timeout_ms",
    "watchdog_ms",
    "period_ms",
    "standby",
    "npu_cores",
    "backend_options",
)
OPERATOR_ONLY = {
    "cpus": "the CPU plan is the operator's (the config file's [[models]] cpus)",
    "rt_priority": "SCHED_FIFO priorities are the operator's (the config file)",
    "calibration": "it reads whole folders and starts a quantization job: set it in the file",
}


class _ClientChecker(Checker):
    """The file's checks, with paths taken literally and confined to `allowed` folders."""

    def __init__(
        self, source: Path, online: Collection[int] | None, allowed: tuple[Path, ...]
    ) -> None:
        super().__init__(source, online)
        self.allowed = allowed

    def path(self, raw: str | Path, key: str) -> Path:
        text = str(raw)
        if "\0" in text:
            raise self.fail(key, "a path must not contain NUL")
        path = Path(os.path.normpath(self.base / text))
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(folder) for folder in self.allowed):
            raise self.fail(
                key,
                f"{text!r} is outside the folders loads may name ([server] load_dirs: "
                f"{', '.join(str(f) for f in self.allowed) or 'none'})",
            )
        return path


def allowed_dirs(server: ServerConfig, models_in_file: Iterable[ModelConfig]) -> tuple[Path, ...]:
    """`[server] load_dirs`, or the folders of the file's models; each with links resolved."""
    dirs = server.load_dirs or tuple(dict.fromkeys(m.path.parent for m in models_in_file))
    return tuple(Path(os.path.realpath(d)) for d in dirs)


def client_model(
    table: Mapping[str, Any],
    name: str,
    source: Path,
    server: ServerConfig,
    allowed: tuple[Path, ...],
    online_cpus: Collection[int] | None,
) -> ModelConfig:
    """The client's table for `name` as a ModelConfig, or ConfigError naming the key (as
    `parameters.config.<key>`). Reads the model files: call it off the event loop."""
    check = _ClientChecker(source, online_cpus, allowed)
    check.max_model_bytes = server.max_model_bytes
    where = "parameters.config"
    if table.get("name", name) != name:
        raise check.fail(where, f"names {show(table.get('name'))}, not {name!r}")
    for key in table:
        if key in OPERATOR_ONLY:
            raise check.fail(f"{where}.{key}", f"not accepted from a client: {OPERATOR_ONLY[key]}")
        if key not in CLIENT_KEYS:
            raise check.fail(
                f"{where}.{key}", f"unknown key; a load table may set {', '.join(CLIENT_KEYS)}"
            )
    cpus = len(online_cpus) if online_cpus else (os.cpu_count() or 1)
    threads = table.get("threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > cpus:
        raise check.fail(
            f"{where}.threads", f"at most this machine's {cpus} CPUs from a client, got {threads}"
        )
    try:
        (mc,) = models(check, [{**table, "name": name}])
    except ConfigError as exc:
        key = (exc.key or "").removeprefix("models[0]").lstrip(".")
        raise ConfigError(source, f"{where}.{key}" if key else where, exc.problem) from None
    return mc
