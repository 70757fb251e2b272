"""[telemetry.mqtt] as the config checked it: what the MQTT publisher connects with. The
settings are telemetry's own (edged.config composes every section's dataclass and checks
the file against it; the known keys are derived from these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from edged.telemetry.spool import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES
from edged.telemetry.topics import device_base, device_topic

MIB = 2**20  # the spool's size is configured in MiB, its age in days
DAY_S = 86400


@dataclass(frozen=True)
class MqttSettings:
    """[telemetry.mqtt], checked completely at load: what the publisher connects with."""

    url: str  # mqtt://host[:1883] or mqtts://host[:8883]
    group: str = "default"
    device_id: str | None = None  # None: /etc/machine-id, read when the publisher opens
    spool_max_mb: float = DEFAULT_MAX_BYTES / MIB
    spool_max_age_days: float = DEFAULT_MAX_AGE_S / DAY_S
    ca_file: Path | None = None  # None with mqtts://: the system's CA store
    cert_file: Path | None = None  # client certificate (with key_file)
    key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = field(default=None, repr=False)  # read at each connect
    keepalive_s: int = 30
    protocol: str = "5"  # or "3.1.1"

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "mqtts"

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or (8883 if self.tls else 1883)

    # The topics need device_id, which the publisher fills in from the machine id if unset.
    @property
    def base(self) -> str:
        return device_base(self.group, self.device_id)  # type: ignore[arg-type]

    def topic(self, kind: str) -> str:
        return device_topic(self.group, self.device_id, kind)  # type: ignore[arg-type]

    @property
    def spool_max_bytes(self) -> int:
        return int(self.spool_max_mb * MIB)

    @property
    def spool_max_age_s(self) -> float:
        return self.spool_max_age_days * DAY_S
