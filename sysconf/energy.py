"""Energy the board measures itself, as joules since the meter started, per domain.

Three kinds of source, each read through a `SysRoot` (a fixture tree in tests):

- **RAPL** (`/sys/class/powercap/intel-rapl:N`, also AMD Zen's package domains): a
  microjoule counter, `energy_uj`, that wraps at `max_energy_range_uj`. Only top-level zones
  are summed for the device (their `:N:M` subzones, core and dram, are parts of them).
- **hwmon** (`/sys/class/hwmon/hwmonN`): `energyK_input` counters in microjoules, and
  `powerK_input` readings in microwatts, integrated between readings (the trapezoid rule).
- **INA3221 rails** (Jetson): the mainline hwmon driver's `inK_input` (mV) and `currK_input`
  (mA), power = V x I, named by `inK_label` (VDD_IN, VDD_CPU_GPU_CV, ...); and L4T's IIO
  driver's `in_powerK_input` (mW) with `rail_name_K`.

- **an NPU runtime's own power reading** (HailoRT's power measurement, which edged's Hailo
  sessions report as `power_watts`): handed to `read` by the caller, integrated like hwmon
  power. One per device, however many models run on it.

Since Linux 5.10, `energy_uj` is readable by root only (a side channel, CVE-2020-8694): a
counter that exists but cannot be read is reported with the fix, never silently skipped.
Each read is a few small files: the telemetry loop calls `read` once per window."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from sysconf.sysroot import SysRoot

POWERCAP_DIR = "/sys/class/powercap"
HWMON_DIR = "/sys/class/hwmon"
IIO_GLOB = "/sys/bus/i2c/drivers/ina3221x"
_RAPL_ZONE = re.compile(r"intel-rapl:\d+")  # top level; intel-rapl:0:1 is a subzone
_ENERGY = re.compile(r"energy(\d+)_input")
_POWER = re.compile(r"power(\d+)_input")
_INA_VOLTS = re.compile(r"in(\d+)_input")
_IIO_POWER = re.compile(r"in_power(\d+)_input")
ROOT_ONLY_FIX = (
    "readable by root only (Linux restricts RAPL since 5.10, CVE-2020-8694); to let the edged "
    "user read it: a tmpfiles.d line `z {path} 0444 - - -`, or run edgectl as root"
)


@dataclass
class Domain:
    name: str  # package-0, VDD_IN, amd_energy/Esocket0, ...
    source: str  # rapl, hwmon-energy, hwmon-power, ina3221, ina3221-iio, npu
    kind: str  # "counter" (µJ that only grows, maybe wrapping) or "power" (µW, integrated)
    paths: tuple[str, ...]  # counter: (energy,); power: (power,) or (mV, mA)
    wrap_uj: int | None = None  # a counter's range (RAPL's max_energy_range_uj)
    device: bool = True  # counts toward the device's total (RAPL subzones do not)
    joules: float = 0.0  # since the meter started
    watts: float | None = None  # over the last interval
    last: tuple[float, float] | None = None  # (time, µJ or µW) at the last reading
    problem: str = ""  # why it was not read (the last time)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "joules": round(self.joules, 6),
            "watts": None if self.watts is None else round(self.watts, 6),
            "problem": self.problem or None,
        }


@dataclass
class EnergyReading:
    domains: list[Domain] = field(default_factory=list)
    joules: float | None = None  # the device's domains, over the last interval
    watts: float | None = None
    notes: list[str] = field(default_factory=list)  # counters there but not readable, ...

    def to_dict(self) -> dict:
        return {
            "joules": None if self.joules is None else round(self.joules, 6),
            "watts": None if self.watts is None else round(self.watts, 6),
            "domains": [d.to_dict() for d in self.domains],
            "notes": self.notes,
        }


def _read_number(root: SysRoot, path: str) -> float | None:
    text = root.read_line(path)
    try:
        return float(text) if text else None
    except ValueError:
        return None


def discover(root: SysRoot) -> list[Domain]:
    """Every energy source the board shows, RAPL first."""
    found: list[Domain] = []
    for zone in sorted(root.listdir(POWERCAP_DIR)):
        if not zone.startswith("intel-rapl:"):
            continue
        base = f"{POWERCAP_DIR}/{zone}"
        if not root.exists(f"{base}/energy_uj"):
            continue
        name = root.read_line(f"{base}/name") or zone
        wrap = _read_number(root, f"{base}/max_energy_range_uj")
        top = bool(_RAPL_ZONE.fullmatch(zone))
        label = name if top else f"{name} ({zone})"
        found.append(
            Domain(label, "rapl", "counter", (f"{base}/energy_uj",), int(wrap or 0) or None, top)
        )
    for hwmon in sorted(root.listdir(HWMON_DIR)):
        base = f"{HWMON_DIR}/{hwmon}"
        chip = root.read_line(f"{base}/name") or hwmon
        files = set(root.listdir(base))
        for entry in sorted(files):
            if m := _ENERGY.fullmatch(entry):
                label = root.read_line(f"{base}/energy{m.group(1)}_label") or entry
                found.append(
                    Domain(f"{chip}/{label}", "hwmon-energy", "counter", (f"{base}/{entry}",))
                )
            elif m := _POWER.fullmatch(entry):
                label = root.read_line(f"{base}/power{m.group(1)}_label") or entry
                found.append(
                    Domain(f"{chip}/{label}", "hwmon-power", "power", (f"{base}/{entry}",))
                )
            elif chip == "ina3221" and (m := _INA_VOLTS.fullmatch(entry)):
                k = m.group(1)
                if f"curr{k}_input" not in files:
                    continue
                label = root.read_line(f"{base}/in{k}_label") or f"channel {k}"
                paths = (f"{base}/{entry}", f"{base}/curr{k}_input")
                found.append(Domain(f"ina3221/{label}", "ina3221", "power", paths))
    for device in sorted(root.listdir(IIO_GLOB)):
        base = f"{IIO_GLOB}/{device}"
        for iio in sorted(e for e in root.listdir(base) if e.startswith("iio:device")):
            folder = f"{base}/{iio}"
            for entry in sorted(root.listdir(folder)):
                if m := _IIO_POWER.fullmatch(entry):
                    k = m.group(1)
                    label = root.read_line(f"{folder}/rail_name_{k}") or entry
                    found.append(
                        Domain(f"ina3221/{label}", "ina3221-iio", "power", (f"{folder}/{entry}",))
                    )
    # hwmon power rails of one board measure the same current several times (VDD_IN holds
    # the others on a Jetson): the device's total is its input rail when it has one.
    inputs = [d for d in found if d.kind == "power" and d.name.endswith("/VDD_IN")]
    if inputs:
        for d in found:
            d.device = d.device and (d.kind != "power" or d in inputs)
    return found


def _microunits(root: SysRoot, domain: Domain) -> float:
    """µJ (counter) or µW (power) now; raises OSError when a file cannot be read."""
    values = []
    for path in domain.paths:
        text = root.read_text(path)
        if text is None:
            raise OSError(_why(root, path))
        values.append(float(text.strip()))
    if domain.source == "ina3221":
        millivolts, milliamps = values
        return millivolts * milliamps  # mV x mA = µW
    if domain.source == "ina3221-iio":
        return values[0] * 1000.0  # mW -> µW
    return values[0]


def _why(root: SysRoot, path: str) -> str:
    """Why `path` could not be read (EACCES, EIO, gone), for the domain's problem."""
    try:
        with open(root.path(path), "rb") as f:
            f.read(1)
    except OSError as exc:
        return exc.strerror or str(exc)
    return "not readable"


def root_only(root: SysRoot, path: str) -> bool:
    """Owned by root and not readable by anyone else (RAPL's energy_uj since Linux 5.10)."""
    try:
        st = os.stat(root.path(path))
    except OSError:
        return False
    return st.st_uid == 0 and not st.st_mode & (stat.S_IRGRP | stat.S_IROTH)


class EnergyMeter:
    def __init__(self, root: SysRoot | None = None) -> None:
        self.root = root or SysRoot()
        self.domains = discover(self.root)
        self.notes = [
            f"{d.name}: {d.paths[0]} is {ROOT_ONLY_FIX.format(path=d.paths[0])}"
            for d in self.domains
            if d.kind == "counter" and root_only(self.root, d.paths[0])
        ]

    def read(self, now: float, npu_watts: Mapping[str, float] | None = None) -> EnergyReading:
        """Each domain's joules since the last read (wrap-around and integration handled),
        added to its total; the device's joules and mean watts over the interval.
        `npu_watts`: device name -> watts now, from an NPU runtime's own power reading."""
        for name in npu_watts or {}:
            if not any(d.source == "npu" and d.name == name for d in self.domains):
                self.domains.append(Domain(name, "npu", "power", ()))
        device_j, device_dt, known = 0.0, None, False
        for d in self.domains:
            try:
                if d.source == "npu":
                    watts = (npu_watts or {}).get(d.name)
                    if watts is None:
                        raise ValueError("its runtime gave no power reading this time")
                    value = watts * 1e6
                else:
                    value = _microunits(self.root, d)
            except (OSError, ValueError) as exc:
                where = d.paths[0] if d.paths else d.name
                d.problem, d.watts, d.last = f"cannot read {where}: {exc}", None, None
                continue
            d.problem = ""
            previous, d.last = d.last, (now, value)
            if previous is None or now <= previous[0]:
                continue
            dt = now - previous[0]
            if d.kind == "counter":
                delta = value - previous[1]
                if delta < 0:  # wrapped (or reset): the range tells how far
                    delta = delta + d.wrap_uj if d.wrap_uj else value
                joules = delta / 1e6
            else:
                joules = (value + previous[1]) / 2 / 1e6 * dt  # µW x s = µJ
            d.joules += joules
            d.watts = joules / dt
            if d.device:
                device_j, device_dt, known = device_j + joules, dt, True
        watts = device_j / device_dt if known and device_dt else None
        return EnergyReading(
            list(self.domains), device_j if known else None, watts, list(self.notes)
        )
