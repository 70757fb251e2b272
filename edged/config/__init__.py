"""The daemon's one TOML config file, validated completely at load.

A broken config must stop the daemon before it binds a socket or loads a model, with one line
that names the file, the key and the problem (`edged.toml: models[1].threads: must be an
integer >= 1, got 0`), so an operator can fix it without reading code. Unknown keys are errors
too: a misspelt `max_batch_szie` silently falling back to a default would be a latency bug that
nobody can see. After `load_config` returns, the objects are frozen and trusted everywhere,
[telemetry.mqtt] included: the publisher takes its `MqttSettings` as they are.

Paths (`models[].path`, `server.socket`, `server.state_dir`) expand `$VAR`/`${VAR}` and `~`,
and a relative path is taken from the config file's folder, not the working directory, so a
config means the same thing whoever starts the daemon from wherever.

`schema` holds the dataclasses (each key's one default), `checks` the checks of single
values, `sections` and `models` the checks of each table, `load` the reading. Importing this
package imports neither numpy nor a runtime: edgectl's light commands load configs too.
"""

from edged.config.checks import ConfigError
from edged.config.load import DEFAULT_CONFIG_PATH, live_online_cpus, load_config, parse_config
from edged.config.schema import (
    AuditConfig,
    BatchingConfig,
    Config,
    ModelConfig,
    MqttSettings,
    ServerConfig,
    TelemetryConfig,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "AuditConfig",
    "BatchingConfig",
    "Config",
    "ConfigError",
    "ModelConfig",
    "MqttSettings",
    "ServerConfig",
    "TelemetryConfig",
    "live_online_cpus",
    "load_config",
    "parse_config",
]
