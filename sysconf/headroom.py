"""Thermal headroom: how near each thermal zone is to the trip at which the kernel starts
cutting performance, as one figure per zone and one for the device.

The figure has the shape of Android's thermal headroom: 0 while the zone is `band_c` degrees
or more below its first throttling trip, rising linearly to 1.0 at that trip, and above 1.0
past it. A throttling trip is a hot or critical one, or a passive one with a cooling device
bound to it (or bindings not known): an `active` trip only starts a fan, and a passive trip
with nothing bound is only a threshold (sysconf.thermal says why). Zones are chosen by their
type (`cpu-thermal`, `npu-thermal`, `x86_pkg_temp`: shell patterns), never by index, which
changes with the kernel and the device tree. The device's figure is the highest of the
chosen zones'.

`HeadroomWatch` reads the zones and their trips once (and again every `rescan_s`, as a
hot-plugged sensor or a changed trip may appear) and then only each chosen zone's `temp`
file per reading: one small read per zone, cheap enough to poll every second."""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sysconf.sysroot import SysRoot
from sysconf.thermal import THERMAL_DIR, ThermalZone, Trip, read_zones

DEFAULT_BAND_C = 20.0


@dataclass(frozen=True)
class ZoneHeadroom:
    zone: str  # thermal_zoneN
    type: str
    temp_c: float | None
    trip: Trip | None  # the first throttling trip
    headroom: float | None  # None: temperature or trip not known

    def to_dict(self) -> dict:
        return {
            "zone": self.zone,
            "type": self.type,
            "temp_c": self.temp_c,
            "trip_type": self.trip.type if self.trip else None,
            "trip_c": self.trip.temp_c if self.trip else None,
            "headroom": None if self.headroom is None else round(self.headroom, 4),
        }


def throttling_trip(zone: ThermalZone) -> Trip | None:
    """The lowest trip at which the kernel cuts performance (module docstring)."""
    cutting = [
        t
        for t in zone.trips
        if t.type in ("hot", "critical") or (t.type == "passive" and t.cooled is not False)
    ]
    return min(cutting, key=lambda t: t.temp_c, default=None)


def figure(temp_c: float | None, trip: Trip | None, band_c: float = DEFAULT_BAND_C) -> float | None:
    """0 at `band_c` below the trip or cooler, 1.0 at the trip, above 1 past it."""
    if temp_c is None or trip is None:
        return None
    return max(0.0, (temp_c - (trip.temp_c - band_c)) / band_c)


def chosen(zone_type: str, patterns: Sequence[str]) -> bool:
    """No patterns: every zone; else a zone whose type matches one of them."""
    return not patterns or any(fnmatch.fnmatchcase(zone_type, p) for p in patterns)


@dataclass(frozen=True)
class Headroom:
    device: float | None  # the highest of the zones' (None: no zone with a trip and a reading)
    zones: tuple[ZoneHeadroom, ...]

    @property
    def hottest(self) -> ZoneHeadroom | None:
        known = [z for z in self.zones if z.headroom is not None]
        return max(known, key=lambda z: z.headroom or 0.0, default=None)

    def to_dict(self) -> dict:
        hottest = self.hottest
        return {
            "device": None if self.device is None else round(self.device, 4),
            "zone": hottest.type or hottest.zone if hottest else None,
            "zones": [z.to_dict() for z in self.zones],
        }


class HeadroomWatch:
    def __init__(
        self,
        root: SysRoot | None = None,
        types: Sequence[str] = (),
        band_c: float = DEFAULT_BAND_C,
        rescan_s: float = 60.0,
    ) -> None:
        self.root = root or SysRoot()
        self.types = tuple(types)
        self.band_c = band_c
        self.rescan_s = rescan_s
        self._zones: list[tuple[ThermalZone, Trip | None]] = []
        self._scanned = -float("inf")

    def _scan(self) -> None:
        self._zones = [
            (zone, throttling_trip(zone))
            for zone in read_zones(self.root)
            if chosen(zone.type, self.types)
        ]
        self._scanned = time.monotonic()

    def read(self) -> Headroom:
        fresh = time.monotonic() - self._scanned >= self.rescan_s
        if fresh:
            self._scan()
        zones = []
        for zone, trip in self._zones:
            temp = zone.temp_c if fresh else _temp(self.root, zone.name)
            zones.append(
                ZoneHeadroom(zone.name, zone.type, temp, trip, figure(temp, trip, self.band_c))
            )
        known = [z.headroom for z in zones if z.headroom is not None]
        return Headroom(max(known) if known else None, tuple(zones))


def _temp(root: SysRoot, zone: str) -> float | None:
    text = root.read_line(f"{THERMAL_DIR}/{zone}/temp")
    try:
        return int(text) / 1000 if text else None
    except ValueError:
        return None
