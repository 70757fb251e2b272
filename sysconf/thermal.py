"""Thermals and system load: what telemetry needs to explain a latency outlier by heat.

Thermal zones and their trip points, cooling devices, cpufreq per core, the Raspberry Pi
firmware's throttle bits, and (only live, only when the kernel has no thermal zones) psutil's
hwmon sensors; plus per-core CPU use, memory, load and the daemon's RSS. Everything is read
through a `SysRoot`, so the same code runs on this machine and on a fixture tree. A file that
is missing, unreadable or answers EIO/EAGAIN (some sensors do while their device sleeps) is
"not known" (None or an empty list), never an exception: telemetry must keep publishing.

Temperatures leave in degrees Celsius and frequencies in hertz (`to_dict`), the base units of
our /metrics and MQTT payloads.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

import psutil

from sysconf.sysroot import SysRoot

THERMAL_DIR = "/sys/class/thermal"
CPU_DIR = "/sys/devices/system/cpu"

# Where the Raspberry Pi firmware driver puts get_throttled: under the DT's `soc` bus on the
# Pi 1-4. The device name follows the DT node names, so a bus with a unit address
# (soc@...) or a firmware node outside the bus is found by the globs.
THROTTLED_PATH = "/sys/devices/platform/soc/soc:firmware/get_throttled"
THROTTLED_GLOBS = (
    "/sys/devices/platform/*soc*/*firmware*/get_throttled",
    "/sys/devices/platform/*firmware*/get_throttled",
)

# Bits of the firmware's get_throttled word (vcgencmd get_throttled). The "since boot" bits
# are the same conditions shifted by 16 and stay set until reboot.
THROTTLE_BITS = {
    0: "under_voltage",
    1: "arm_freq_capped",
    2: "throttled",
    3: "soft_temp_limit",
}
SINCE_BOOT_SHIFT = 16
# The "now" bits that mean the ARM cores run slower than asked; under-voltage alone does not
# (the firmware sets bit 2 as well when it actually throttles for it).
_SLOWING_BITS = (1, 2, 3)

# Trip types that mean the kernel is already cutting performance, by severity. Crossing an
# `active` trip only turns a fan on, which costs no latency, so it leaves a zone "ok".
_SEVERITY = {"passive": 1, "hot": 2, "critical": 3}
_STATES = ("ok", "passive", "hot", "critical")

# Cooling devices that lower a CPU policy's maximum frequency: the cpufreq cooling device
# ("cpufreq-cpuN" since Linux 5.x, "thermal-cpufreq-N" before) and ACPI processor throttling.
_CPUFREQ_COOLING = re.compile(r"cpufreq-cpu(\d+)")
_TRIP_FILE = re.compile(r"trip_point_(\d+)_type")
_BINDING_FILE = re.compile(r"cdev\d+_trip_point")


@dataclass(frozen=True)
class Trip:
    type: str  # passive, active, hot, critical
    temp_c: float
    # A cooling device is bound to this trip (the zone's cdevN_trip_point files); None when the
    # zone lists no bindings at all, so nothing is known.
    cooled: bool | None = None


@dataclass(frozen=True)
class ThermalZone:
    name: str  # thermal_zoneN
    type: str  # the driver's or DT's name: cpu-thermal, bigcore0-thermal, x86_pkg_temp, acpitz
    temp_c: float | None
    trips: list[Trip] = field(default_factory=list)
    policy: str | None = None  # the thermal governor: step_wise, power_allocator, ...

    @property
    def state(self) -> str:
        """The most severe passive/hot/critical trip the temperature has reached ("ok" when
        none has, or when the temperature is not known)."""
        if self.temp_c is None:
            return "ok"
        level = 0
        for trip in self.trips:
            if self.temp_c >= trip.temp_c:  # the kernel's own test for a crossed trip
                level = max(level, _SEVERITY.get(trip.type, 0))
        return _STATES[level]

    @property
    def cooling_engaged(self) -> bool:
        """The zone is past a trip at which the kernel cuts performance: a hot or critical
        trip, or a passive trip with a cooling device bound to it (or bindings not known).
        A passive trip with nothing bound is only a threshold (mainline RK3588's 75 °C
        "alert0" starts the power allocator's bookkeeping), so it does not count."""
        if self.temp_c is None:
            return False
        return any(
            self.temp_c >= t.temp_c
            and (t.type in ("hot", "critical") or (t.type == "passive" and t.cooled is not False))
            for t in self.trips
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "type": self.type,
            "temp_c": self.temp_c,
            "state": self.state,
            "cooling_engaged": self.cooling_engaged,
            "policy": self.policy,
            "trips": [{"type": t.type, "temp_c": t.temp_c, "cooled": t.cooled} for t in self.trips],
        }


@dataclass(frozen=True)
class CoolingDevice:
    name: str  # cooling_deviceN
    type: str  # cpufreq-cpu0, pwm-fan, gpio-fan, Processor, intel_powerclamp, ...
    cur_state: int | None
    max_state: int | None
    cpus: list[int] = field(default_factory=list)  # CPUs a cpufreq cooling device limits

    @property
    def active(self) -> bool:
        # > 0, not truthiness: intel_powerclamp reports -1 while it is not injecting idle
        return self.cur_state is not None and self.cur_state > 0

    @property
    def limits_cpufreq(self) -> bool:
        """True for cooling devices that work by lowering a CPU's maximum frequency."""
        return self.type.startswith(("cpufreq-", "thermal-cpufreq-")) or self.type == "Processor"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "type": self.type,
            "cur_state": self.cur_state,
            "max_state": self.max_state,
            "active": self.active,
            "cpus": self.cpus,
        }


@dataclass(frozen=True)
class CpuFreq:
    cpu: int
    cur_khz: int | None  # scaling_cur_freq
    max_khz: int | None  # cpuinfo_max_freq: what the hardware can do
    scaling_max_khz: int | None  # the policy's current ceiling (user limit and thermal QoS)
    governor: str | None

    @property
    def capped(self) -> bool:
        """The policy's ceiling is below the hardware maximum (by a user, or by a cooling
        device: `ThermalState.thermally_capped_cpus` tells which)."""
        return (
            self.scaling_max_khz is not None
            and self.max_khz is not None
            and self.scaling_max_khz < self.max_khz
        )

    @property
    def ratio(self) -> float | None:
        """Current frequency as a fraction of the hardware maximum."""
        if self.cur_khz is None or not self.max_khz:
            return None
        return self.cur_khz / self.max_khz

    def to_dict(self) -> dict:
        # cpufreq counts kHz; payloads leave in hertz, the base unit (node_exporter does too)
        return {
            "cpu": self.cpu,
            "freq_hz": _hz(self.cur_khz),
            "max_hz": _hz(self.max_khz),
            "scaling_max_hz": _hz(self.scaling_max_khz),
            "governor": self.governor,
            "capped": self.capped,
            "ratio": self.ratio,
        }


def _hz(khz: int | None) -> int | None:
    return None if khz is None else khz * 1000


@dataclass(frozen=True)
class Throttled:
    """The Raspberry Pi firmware's throttle word (the VideoCore throttles the ARM itself,
    invisible to Linux cpufreq, so this is the only way to see it)."""

    raw: int

    def flags(self) -> dict[str, bool]:
        out = {name: bool(self.raw >> bit & 1) for bit, name in THROTTLE_BITS.items()}
        for bit, name in THROTTLE_BITS.items():
            out[f"{name}_since_boot"] = bool(self.raw >> (bit + SINCE_BOOT_SHIFT) & 1)
        return out

    @property
    def now(self) -> list[str]:
        return [name for bit, name in THROTTLE_BITS.items() if self.raw >> bit & 1]

    @property
    def since_boot(self) -> list[str]:
        return [
            name for bit, name in THROTTLE_BITS.items() if self.raw >> (bit + SINCE_BOOT_SHIFT) & 1
        ]

    @property
    def slowing_now(self) -> bool:
        """The ARM runs slower than asked right now (capped, throttled or soft limit)."""
        return any(self.raw >> bit & 1 for bit in _SLOWING_BITS)

    def to_dict(self) -> dict:
        return {
            "raw": self.raw,
            "now": self.now,
            "since_boot": self.since_boot,
            "flags": self.flags(),
        }


@dataclass(frozen=True)
class ThermalState:
    zones: list[ThermalZone] = field(default_factory=list)
    cooling: list[CoolingDevice] = field(default_factory=list)
    cpufreq: list[CpuFreq] = field(default_factory=list)
    throttled: Throttled | None = None
    # psutil hwmon readings, name -> [(label, celsius)]; only live and without thermal zones
    sensors: dict[str, list[tuple[str, float]]] = field(default_factory=dict)

    def hottest(self) -> tuple[str, float] | None:
        """(label, celsius) of the hottest reading: a zone's type (its name when the type is
        empty), or "chip/label" of a psutil sensor. None when nothing reports a temperature."""
        readings = [(z.type or z.name, z.temp_c) for z in self.zones if z.temp_c is not None]
        for chip, entries in self.sensors.items():
            readings += [(f"{chip}/{label}" if label else chip, temp) for label, temp in entries]
        return max(readings, key=lambda r: r[1], default=None)

    def thermally_capped_cpus(self) -> list[int]:
        """CPUs whose ceiling is below the hardware maximum while a frequency-limiting cooling
        device is engaged for them (a user's scaling_max_freq alone does not count). A device
        whose CPUs are not known (ACPI "Processor", old "thermal-cpufreq-N") counts for all."""
        capped = {f.cpu for f in self.cpufreq if f.capped}
        hit: set[int] = set()
        for dev in self.cooling:
            if dev.active and dev.limits_cpufreq:
                hit |= (capped & set(dev.cpus)) if dev.cpus else capped
        return sorted(hit)

    def throttling(self) -> bool:
        """Performance is being cut for heat or power right now: a CPU thermally capped, the
        Pi firmware slowing the ARM, or a zone past a passive (or worse) trip that has cooling
        bound to it (`ThermalZone.cooling_engaged`)."""
        return (
            bool(self.thermally_capped_cpus())
            or (self.throttled is not None and self.throttled.slowing_now)
            or any(z.cooling_engaged for z in self.zones)
        )

    def to_dict(self) -> dict:
        hottest = self.hottest()
        return {
            "zones": [z.to_dict() for z in self.zones],
            "cooling": [c.to_dict() for c in self.cooling],
            "cpufreq": [f.to_dict() for f in self.cpufreq],
            "throttled": None if self.throttled is None else self.throttled.to_dict(),
            "sensors": {
                chip: [{"label": label, "temp_c": temp} for label, temp in entries]
                for chip, entries in self.sensors.items()
            },
            "hottest": None if hottest is None else {"name": hottest[0], "temp_c": hottest[1]},
            "thermally_capped_cpus": self.thermally_capped_cpus(),
            "throttling": self.throttling(),
        }


def read_thermal(root: SysRoot | None = None) -> ThermalState:
    """One snapshot. Some sensors (I2C, ACPI methods) take milliseconds to read: call it from
    the telemetry thread, never from the inference path."""
    root = root or SysRoot()
    zones = read_zones(root)
    sensors = _psutil_sensors() if not zones and root.is_live else {}
    return ThermalState(
        zones=zones,
        cooling=_read_cooling(root),
        cpufreq=read_cpufreq(root),
        throttled=read_throttled(root),
        sensors=sensors,
    )


def _numbered(root: SysRoot, directory: str, prefix: str) -> list[tuple[int, str]]:
    """(N, name) for entries `prefixN`, in numeric order (thermal_zone10 after thermal_zone9)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)")
    found = []
    for name in root.listdir(directory):
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match.group(1)), name))
    return sorted(found)


def _read_int(root: SysRoot, path: str, base: int = 10) -> int | None:
    text = root.read_line(path)
    if not text:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _millidegrees(root: SysRoot, path: str) -> float | None:
    value = _read_int(root, path)
    # sysfs thermal counts millidegrees Celsius; we leave in degrees, the base unit
    return None if value is None else value / 1000


def read_zones(root: SysRoot) -> list[ThermalZone]:
    """Every thermal zone with its type, temperature and trips, in numeric order."""
    zones = []
    for _, name in _numbered(root, THERMAL_DIR, "thermal_zone"):
        base = f"{THERMAL_DIR}/{name}"
        zones.append(
            ThermalZone(
                name=name,
                type=root.read_line(f"{base}/type") or "",
                temp_c=_millidegrees(root, f"{base}/temp"),
                trips=_read_trips(root, base),
                policy=root.read_line(f"{base}/policy") or None,
            )
        )
    return zones


def _read_trips(root: SysRoot, base: str) -> list[Trip]:
    entries = root.listdir(base)
    indices = sorted(int(m.group(1)) for m in map(_TRIP_FILE.fullmatch, entries) if m)
    # Each cooling device bound to the zone has cdevK (a link) and cdevK_trip_point (the trip
    # index it acts on).
    binding_files = [name for name in entries if _BINDING_FILE.fullmatch(name)]
    bound = {_read_int(root, f"{base}/{name}") for name in binding_files}
    trips = []
    for i in indices:
        kind = root.read_line(f"{base}/trip_point_{i}_type")
        temp = _millidegrees(root, f"{base}/trip_point_{i}_temp")
        # Unset trips read THERMAL_TEMP_INVALID (-274000) on current kernels and 0 on older
        # ones (x86_pkg_temp with no threshold programmed); no real trip is at or below 0 °C.
        if kind and temp is not None and temp > 0:
            trips.append(Trip(kind, temp, (i in bound) if binding_files else None))
    return trips


def _read_cooling(root: SysRoot) -> list[CoolingDevice]:
    devices = []
    for _, name in _numbered(root, THERMAL_DIR, "cooling_device"):
        base = f"{THERMAL_DIR}/{name}"
        kind = root.read_line(f"{base}/type") or ""
        devices.append(
            CoolingDevice(
                name=name,
                type=kind,
                cur_state=_read_int(root, f"{base}/cur_state"),
                max_state=_read_int(root, f"{base}/max_state"),
                cpus=_cooled_cpus(root, kind),
            )
        )
    return devices


def _cooled_cpus(root: SysRoot, kind: str) -> list[int]:
    """The CPUs of the cpufreq policy a "cpufreq-cpuN" cooling device limits."""
    match = _CPUFREQ_COOLING.fullmatch(kind)
    if not match:
        return []
    cpu = int(match.group(1))
    related = root.read_line(f"{CPU_DIR}/cpu{cpu}/cpufreq/related_cpus") or ""
    cpus = [int(c) for c in related.split() if c.isdecimal()]
    return cpus or [cpu]


def read_cpufreq(root: SysRoot | None = None) -> list[CpuFreq]:
    root = root or SysRoot()
    freqs = []
    for cpu, name in _numbered(root, CPU_DIR, "cpu"):
        base = f"{CPU_DIR}/{name}/cpufreq"
        if not root.exists(base):  # no cpufreq driver (VMs), or the CPU is offline
            continue
        cur = _read_int(root, f"{base}/scaling_cur_freq")
        if cur is None:
            cur = _read_int(root, f"{base}/cpuinfo_cur_freq")
        freqs.append(
            CpuFreq(
                cpu=cpu,
                cur_khz=cur,
                max_khz=_read_int(root, f"{base}/cpuinfo_max_freq"),
                scaling_max_khz=_read_int(root, f"{base}/scaling_max_freq"),
                governor=root.read_line(f"{base}/scaling_governor") or None,
            )
        )
    return freqs


def read_throttled(root: SysRoot | None = None) -> Throttled | None:
    """The Pi firmware's throttle word, or None on other boards. Some Raspberry Pi kernels
    log a one-time "deprecated, use hwmon" warning on the first read; the hwmon replacement
    (rpi_volt in0_lcrit_alarm) has only the under-voltage bit, so this file is still read."""
    root = root or SysRoot()
    paths = [THROTTLED_PATH] if root.exists(THROTTLED_PATH) else []
    if not paths:
        for pattern in THROTTLED_GLOBS:
            paths = list(root.glob(pattern))
            if paths:
                break
    for path in paths:
        value = _read_int(root, path, 16)  # the driver prints "%x"
        if value is not None and value >= 0:
            return Throttled(value)
    return None


def _psutil_sensors() -> dict[str, list[tuple[str, float]]]:
    try:
        readings = psutil.sensors_temperatures()
    except Exception:  # a broken hwmon driver must not stop telemetry
        return {}
    return {
        chip: [(entry.label or "", float(entry.current)) for entry in entries]
        for chip, entries in readings.items()
        if entries
    }


# -- system ------------------------------------------------------------------------------------

# /proc/stat columns after the name: user nice system idle iowait irq softirq steal guest
# guest_nice. guest and guest_nice are already counted in user and nice, so only the first
# eight make up the total; idle and iowait are the not-busy part.
_STAT_COLUMNS = 8
_IDLE_COLUMNS = (3, 4)


def parse_proc_stat(text: str) -> dict[int, tuple[int, int]]:
    """CPU number -> (busy, total) jiffies from /proc/stat's cpuN lines (offline CPUs have
    no line)."""
    out = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or not fields[0][3:].isdecimal():
            continue
        try:
            values = [int(v) for v in fields[1 : 1 + _STAT_COLUMNS]]
        except ValueError:
            continue
        total = sum(values)
        idle = sum(values[i] for i in _IDLE_COLUMNS if i < len(values))
        out[int(fields[0][3:])] = (total - idle, total)
    return out


class CpuUseSampler:
    """Per-core busy fraction between successive calls, from /proc/stat read through a root
    (psutil.cpu_percent only reads the live /proc). The first call has nothing to compare
    with and returns {}: call it once when telemetry starts. `read_system(root, sampler)`
    samples through its own root, so a sampler made without one follows the caller's."""

    def __init__(self, root: SysRoot | None = None) -> None:
        self.root = root or SysRoot()
        self._lock = threading.Lock()
        self._previous: dict[int, tuple[int, int]] | None = None

    def sample(self, root: SysRoot | None = None) -> dict[int, float]:
        root = root or self.root
        current = parse_proc_stat(root.read_text("/proc/stat", "") or "")
        with self._lock:
            previous, self._previous = self._previous, current
        if previous is None:
            return {}
        use = {}
        for cpu, (busy, total) in current.items():
            if cpu not in previous:  # came online since the last sample: no baseline yet
                continue
            d_busy = busy - previous[cpu][0]
            d_total = total - previous[cpu][1]
            if d_total <= 0:  # no tick passed (or the counters were reset by a hotplug)
                use[cpu] = 0.0
                continue
            # iowait may go backwards (Documentation/filesystems/proc.rst), so clamp
            use[cpu] = min(1.0, max(0.0, d_busy / d_total))
        return use


@dataclass(frozen=True)
class SystemStats:
    cpu_percent: dict[int, float]  # per core, since the sampler's previous call
    mem_total_bytes: int | None
    mem_available_bytes: int | None
    load_avg: tuple[float, float, float] | None
    rss_bytes: int | None  # this daemon's resident set; only live
    uptime_s: float | None

    @property
    def cpu_percent_mean(self) -> float | None:
        if not self.cpu_percent:
            return None
        return sum(self.cpu_percent.values()) / len(self.cpu_percent)

    def to_dict(self) -> dict:
        mean = self.cpu_percent_mean
        return {
            # string keys: JSON objects have no integer keys (orjson refuses them)
            "cpu_percent": {str(cpu): round(p, 2) for cpu, p in sorted(self.cpu_percent.items())},
            "cpu_percent_mean": None if mean is None else round(mean, 2),
            "mem_total_bytes": self.mem_total_bytes,
            "mem_available_bytes": self.mem_available_bytes,
            "load_avg": None if self.load_avg is None else list(self.load_avg),
            "rss_bytes": self.rss_bytes,
            "uptime_s": self.uptime_s,
        }


def read_system(root: SysRoot | None = None, sampler: CpuUseSampler | None = None) -> SystemStats:
    root = root or SysRoot()
    use = sampler.sample(root) if sampler is not None else {}
    meminfo = _meminfo(root)
    return SystemStats(
        cpu_percent={cpu: fraction * 100 for cpu, fraction in use.items()},
        mem_total_bytes=meminfo.get("MemTotal"),
        mem_available_bytes=meminfo.get("MemAvailable"),  # absent before Linux 3.14
        load_avg=_loadavg(root),
        rss_bytes=_own_rss() if root.is_live else None,
        uptime_s=_first_float(root, "/proc/uptime"),
    )


def _meminfo(root: SysRoot) -> dict[str, int]:
    out = {}
    for line in (root.read_text("/proc/meminfo", "") or "").splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdecimal():
            # meminfo counts kB (KiB); we leave in bytes, the base unit
            out[key.strip()] = int(fields[0]) * 1024
    return out


def _loadavg(root: SysRoot) -> tuple[float, float, float] | None:
    fields = (root.read_line("/proc/loadavg") or "").split()
    try:
        return float(fields[0]), float(fields[1]), float(fields[2])
    except (IndexError, ValueError):
        return None


def _first_float(root: SysRoot, path: str) -> float | None:
    fields = (root.read_line(path) or "").split()
    try:
        return float(fields[0])
    except (IndexError, ValueError):
        return None


def _own_rss() -> int | None:
    try:
        return psutil.Process().memory_info().rss
    except psutil.Error:
        return None
