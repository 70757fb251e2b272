"""[thermal]: what the daemon does as the device heats (edged.thermal)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES = ("off", "on")


@dataclass(frozen=True)
class ThermalConfig:
    # "off": temperatures and headroom are reported only; "on": models step down the ladder
    # as the headroom rises (0 far below the first throttling trip, 1.0 at it).
    admission: str = "off"
    # The zones watched, by type (shell patterns: "cpu*-thermal", "npu-thermal"); empty:
    # every zone that has a throttling trip.
    zones: tuple[str, ...] = ()
    band_c: float = 20.0  # headroom 0 this many degrees below the trip, 1.0 at it
    interval_s: float = 1.0  # how often the zones' temperatures are read
    cheaper_at: float = 0.8  # serve on the cheaper verified candidate from this headroom
    limit_at: float = 0.9  # then accept only limit_share of the rate seen before
    shed_at: float = 1.0  # then refuse every request (503 with Retry-After)
    limit_share: float = 0.5
    hysteresis: float = 0.1  # a step is left once the headroom is this far below where it began
    hold_s: float = 10.0  # ... and has stayed there this long
    retry_after_s: int = 5  # what a refused client is told to wait
    root: Path = Path("/")  # the system whose zones are read (a test's or a bench's root)

    @property
    def thresholds(self) -> tuple[float, float, float]:
        return (self.cheaper_at, self.limit_at, self.shed_at)
