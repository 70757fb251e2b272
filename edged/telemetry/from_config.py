"""The daemon's telemetry publisher from its settings: MQTT with its spool, with the settings
of [telemetry.mqtt] as the config checked them, or, without a broker, the log.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edged.telemetry.settings import MqttSettings

log = logging.getLogger("edged")  # the daemon's log: its lines keep their logger name


def open_telemetry(mqtt: MqttSettings | None, state_dir: Path):
    """The MQTT publisher (with its spool) when a broker is configured (`[telemetry.mqtt]`),
    else JSON lines to the log. An unusable spool file is reported and telemetry falls back
    to the log, so inference keeps serving."""
    from edged.telemetry.mqtt.log_publisher import LogPublisher
    from edged.telemetry.mqtt.publisher import open_publisher
    from edged.telemetry.spool import SpoolError

    try:
        return open_publisher(mqtt, state_dir)
    except SpoolError as exc:
        log.error("telemetry spool unusable, telemetry goes to the log instead: %s", exc)
        return LogPublisher()
