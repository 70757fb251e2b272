"""sysconf.thermal: the live machine (read only), and roots laid out like real boards' sysfs.

The board trees mirror the kernel's layout: /sys/class/thermal/* are links into
/sys/devices/virtual/thermal, /sys/devices/system/cpu/cpuN/cpufreq links to the policy folder,
and a zone bound to a cooling device has cdevK and cdevK_trip_point. Values come from the
boards' device trees and drivers:

- Raspberry Pi 4: bcm2711.dtsi's cpu-thermal has one trip, `critical` at 90000 (Debian's 6.1
  bcm2711-rpi-4-b.dtb); the gpio-fan overlay adds an `active` trip at its default 55000. The
  firmware throttles the ARM itself, invisible to cpufreq, and reports it in get_throttled
  (printed "%x" by drivers/firmware/raspberrypi.c).
- RK3588 (mainline rk3588s.dtsi, Rock 5B fan): package-thermal (critical 115000), the CPU
  zones with passive 75000 (alert0, the power allocator's switch-on, nothing bound), passive
  85000 (alert1, bound to the cluster's cpufreq cooling device) and critical 115000; center,
  gpu and npu zones with critical 115000; cooling devices "cpufreq-cpuN" per policy.
- x86 industrial PC: acpitz, INT3400 Thermal, x86_pkg_temp (unset trips read 0 on older
  kernels and THERMAL_TEMP_INVALID, -274000, on current ones), pch_cannonlake, iwlwifi; ACPI
  "Processor" cooling devices, intel_powerclamp (-1 while idle), TCC Offset; intel_pstate.
"""

from __future__ import annotations

import json
import os
import time
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from sysconf import thermal
from sysconf.sysroot import SysRoot
from sysconf.thermal import (
    CoolingDevice,
    CpuFreq,
    CpuUseSampler,
    SystemStats,
    ThermalState,
    ThermalZone,
    Throttled,
    Trip,
    parse_proc_stat,
    read_cpufreq,
    read_system,
    read_thermal,
    read_throttled,
)

VIRTUAL = "sys/devices/virtual/thermal"
CLASS = "sys/class/thermal"
CPU = "sys/devices/system/cpu"


# -- building sysfs trees ----------------------------------------------------------------------


def _write(root: Path, path: str, text: str) -> None:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _link(root: Path, path: str, target: str) -> None:
    link = root / path
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)


def zone(
    root: Path, n: int, kind: str, temp: int | None, trips=(), policy="step_wise", bindings=()
) -> None:
    """thermal_zoneN; `temp` None makes the temp file a folder, so reading it fails the way an
    EIO/EAGAIN sensor does. `bindings` are (cooling device number, trip index)."""
    base = f"{VIRTUAL}/thermal_zone{n}"
    _write(root, f"{base}/type", f"{kind}\n")
    _write(root, f"{base}/policy", f"{policy}\n")
    if temp is None:
        (root / base / "temp").mkdir(parents=True)
    else:
        _write(root, f"{base}/temp", f"{temp}\n")
    for i, (trip_type, trip_temp) in enumerate(trips):
        _write(root, f"{base}/trip_point_{i}_type", f"{trip_type}\n")
        _write(root, f"{base}/trip_point_{i}_temp", f"{trip_temp}\n")
        _write(root, f"{base}/trip_point_{i}_hyst", "2000\n")
    for k, (cdev, trip) in enumerate(bindings):
        _link(root, f"{base}/cdev{k}", f"../cooling_device{cdev}")
        _write(root, f"{base}/cdev{k}_trip_point", f"{trip}\n")
        _write(root, f"{base}/cdev{k}_weight", "1024\n")
    _link(root, f"{CLASS}/thermal_zone{n}", f"../../devices/virtual/thermal/thermal_zone{n}")


def cooling(root: Path, n: int, kind: str, cur: int, maximum: int) -> None:
    base = f"{VIRTUAL}/cooling_device{n}"
    _write(root, f"{base}/type", f"{kind}\n")
    _write(root, f"{base}/cur_state", f"{cur}\n")
    _write(root, f"{base}/max_state", f"{maximum}\n")
    _link(root, f"{CLASS}/cooling_device{n}", f"../../devices/virtual/thermal/cooling_device{n}")


def policy(
    root: Path,
    cpus: list[int],
    cur: int,
    hw_max: int,
    scaling_max: int,
    hw_min: int,
    governor: str,
    per_cpu: bool = False,
) -> None:
    """One cpufreq policy (or, `per_cpu`, one per CPU as intel_pstate registers them)."""
    groups = [[c] for c in cpus] if per_cpu else [cpus]
    for group in groups:
        base = f"{CPU}/cpufreq/policy{group[0]}"
        for name, value in (
            ("scaling_cur_freq", cur),
            ("cpuinfo_max_freq", hw_max),
            ("cpuinfo_min_freq", hw_min),
            ("scaling_max_freq", scaling_max),
            ("scaling_governor", governor),
            ("related_cpus", " ".join(map(str, group))),
        ):
            _write(root, f"{base}/{name}", f"{value}\n")
        for cpu in group:
            _link(root, f"{CPU}/cpu{cpu}/cpufreq", f"../cpufreq/policy{group[0]}")
    _write(root, f"{CPU}/online", f"0-{max(cpus)}\n")


def pi4_root(tmp: Path, throttled: str = "50005", temp: int = 61234) -> SysRoot:
    """Raspberry Pi 4 on Raspberry Pi OS, official case fan (gpio-fan overlay), running from a
    weak supply: the firmware holds the ARM at 600 MHz and says so in get_throttled."""
    zone(tmp, 0, "cpu-thermal", temp, [("critical", 90000), ("active", 55000)], bindings=[(0, 1)])
    cooling(tmp, 0, "gpio-fan", 1, 1)
    policy(tmp, [0, 1, 2, 3], 600000, 1500000, 1500000, 600000, "ondemand")
    _write(tmp, "sys/devices/platform/soc/soc:firmware/get_throttled", f"{throttled}\n")
    return SysRoot(tmp)


def rk3588_root(tmp: Path, big0_temp: int = 86250, big0_state: int = 2) -> SysRoot:
    """Rock 5B under a sustained load on the first A76 pair: bigcore0 is past its bound
    passive trip and the cpufreq cooling device holds policy4 two OPPs down."""
    cpu_trips = [("passive", 75000), ("passive", 85000), ("critical", 115000)]
    zone(
        tmp,
        0,
        "package-thermal",
        79500,
        [("critical", 115000), ("active", 45000), ("active", 50000)],
        bindings=[(3, 1), (3, 2)],
    )
    zone(tmp, 1, "bigcore0-thermal", big0_temp, cpu_trips, bindings=[(1, 1)])
    zone(tmp, 2, "bigcore2-thermal", 78000, cpu_trips, bindings=[(2, 1)])
    zone(tmp, 3, "littlecore-thermal", 70000, cpu_trips, bindings=[(0, 1)])
    zone(tmp, 4, "center-thermal", 76000, [("critical", 115000)])
    zone(tmp, 5, "gpu-thermal", 72000, [("critical", 115000)])
    zone(tmp, 6, "npu-thermal", 71000, [("critical", 115000)])
    cooling(tmp, 0, "cpufreq-cpu0", 0, 7)
    cooling(tmp, 1, "cpufreq-cpu4", big0_state, 11)
    cooling(tmp, 2, "cpufreq-cpu6", 0, 11)
    cooling(tmp, 3, "pwm-fan", 4, 4)
    cooling(tmp, 4, "devfreq-fb000000.gpu", 0, 4)
    policy(tmp, [0, 1, 2, 3], 1800000, 1800000, 1800000, 408000, "schedutil")
    big0_max = 2304000 if big0_state else 2400000
    policy(tmp, [4, 5], big0_max, 2400000, big0_max, 408000, "schedutil")
    policy(tmp, [6, 7], 2400000, 2400000, 2400000, 408000, "schedutil")
    return SysRoot(tmp)


def x86_root(
    tmp: Path, scaling_max: int = 4100000, processor_state: int = 0, kernel_6x: bool = True
) -> SysRoot:
    """Fanless industrial PC (Whiskey Lake U): ACPI and PCH zones, an iwlwifi zone whose
    sensor is asleep (reading it fails), intel_pstate with one policy per CPU."""
    unset = -274000 if kernel_6x else 0
    zone(tmp, 0, "acpitz", 27800, [("critical", 119000)])
    zone(tmp, 1, "INT3400 Thermal", 20000, policy="user_space")
    zone(tmp, 2, "x86_pkg_temp", 54000, [("passive", unset), ("passive", unset)])
    zone(tmp, 3, "pch_cannonlake", 47000, [("critical", 113000)])
    zone(tmp, 4, "iwlwifi_1", None, [("passive", -274000)] * 8)
    for n in range(4):
        cooling(tmp, n, "Processor", processor_state, 3)
    cooling(tmp, 4, "intel_powerclamp", -1, 50)
    cooling(tmp, 5, "TCC Offset", 0, 63)
    policy(tmp, [0, 1, 2, 3], 3900123, 4100000, scaling_max, 400000, "powersave", per_cpu=True)
    return SysRoot(tmp)


_BUILT: dict[tuple, SysRoot] = {}


@pytest.fixture(scope="module")
def boards(tmp_path_factory):
    """Board roots by (builder, options), each built once per module: creating sysfs files
    costs about a millisecond each here, and the tests only read them."""

    def get(builder, **options) -> SysRoot:
        key = (builder.__name__, *sorted(options.items()))
        if key not in _BUILT:
            _BUILT[key] = builder(tmp_path_factory.mktemp(builder.__name__), **options)
        return _BUILT[key]

    yield get
    _BUILT.clear()


def _zone(state: ThermalState, kind: str) -> ThermalZone:
    return next(z for z in state.zones if z.type == kind)


# -- the live machine ----------------------------------------------------------------------------


def test_live_machine_reads_without_error() -> None:
    state = read_thermal(SysRoot())
    live = Path("/sys/class/thermal")
    names = [p.name for p in live.glob("thermal_zone*")] if live.is_dir() else []
    assert sorted(z.name for z in state.zones) == sorted(names)
    hottest = state.hottest()
    assert hottest is None or (isinstance(hottest[0], str) and isinstance(hottest[1], float))
    if not state.zones and not state.sensors:
        assert hottest is None
    assert isinstance(state.throttling(), bool)
    json.dumps(state.to_dict())  # payload-ready: no tuples as keys, no dataclasses


def test_live_system_stats() -> None:
    sampler = CpuUseSampler(SysRoot())
    first = read_system(SysRoot(), sampler)
    assert first.cpu_percent == {}  # nothing to compare with yet
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:  # burn a few ticks so the delta is not empty
        pass
    stats = read_system(SysRoot(), sampler)
    online = set(parse_proc_stat(Path("/proc/stat").read_text()))
    assert set(stats.cpu_percent) <= online
    assert all(0.0 <= p <= 100.0 for p in stats.cpu_percent.values())
    assert stats.mem_total_bytes == psutil.virtual_memory().total
    assert 0 < stats.mem_available_bytes <= stats.mem_total_bytes
    assert stats.rss_bytes == pytest.approx(psutil.Process().memory_info().rss, rel=0.5)
    assert stats.load_avg is not None and len(stats.load_avg) == 3
    assert stats.uptime_s > 0
    json.dumps(stats.to_dict())


def test_psutil_sensors_only_live_and_without_zones(monkeypatch, tmp_path: Path) -> None:
    shwtemp = namedtuple("shwtemp", "label current high critical")
    calls = []

    def fake():
        calls.append(1)
        return {
            "coretemp": [
                shwtemp("Package id 0", 48.0, 100.0, 100.0),
                shwtemp("Core 0", 46.0, 100.0, 100.0),
            ],
            "nvme": [shwtemp("", 39.85, 84.85, 84.85)],
            "empty": [],
        }

    monkeypatch.setattr(thermal.psutil, "sensors_temperatures", fake)
    live = read_thermal(SysRoot())
    if live.zones:  # the kernel's zones win; psutil is not asked
        assert live.sensors == {} and calls == []
    else:
        assert live.sensors == {
            "coretemp": [("Package id 0", 48.0), ("Core 0", 46.0)],
            "nvme": [("", 39.85)],
        }
        assert live.hottest() == ("coretemp/Package id 0", 48.0)
        assert live.to_dict()["sensors"]["nvme"] == [{"label": "", "temp_c": 39.85}]
    calls.clear()
    assert read_thermal(SysRoot(tmp_path)).sensors == {}  # a fixture root: never the host's
    assert calls == []


def test_psutil_failure_is_no_sensors(monkeypatch) -> None:
    def broken():
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(thermal.psutil, "sensors_temperatures", broken)
    assert thermal._psutil_sensors() == {}


# -- Raspberry Pi 4 ------------------------------------------------------------------------------


def test_pi4(boards) -> None:
    state = read_thermal(boards(pi4_root))
    (cpu_zone,) = state.zones
    assert cpu_zone == ThermalZone(
        "thermal_zone0",
        "cpu-thermal",
        61.234,
        [Trip("critical", 90.0, False), Trip("active", 55.0, True)],
        "step_wise",
    )
    assert cpu_zone.state == "ok"  # past the fan's active trip only: the fan runs, no cut
    assert not cpu_zone.cooling_engaged
    assert state.cooling == [CoolingDevice("cooling_device0", "gpio-fan", 1, 1)]
    assert state.cooling[0].active and not state.cooling[0].limits_cpufreq
    assert [f.cpu for f in state.cpufreq] == [0, 1, 2, 3]
    freq = state.cpufreq[0]
    assert freq == CpuFreq(0, 600000, 1500000, 1500000, "ondemand")
    assert not freq.capped and freq.ratio == 0.4  # the firmware's cap is invisible to cpufreq
    assert state.throttled == Throttled(0x50005)
    assert state.throttled.now == ["under_voltage", "throttled"]
    assert state.throttled.since_boot == ["under_voltage", "throttled"]
    assert state.throttled.flags() == {
        "under_voltage": True,
        "arm_freq_capped": False,
        "throttled": True,
        "soft_temp_limit": False,
        "under_voltage_since_boot": True,
        "arm_freq_capped_since_boot": False,
        "throttled_since_boot": True,
        "soft_temp_limit_since_boot": False,
    }
    assert state.thermally_capped_cpus() == []
    assert state.throttling()  # from the firmware's bits alone
    assert state.hottest() == ("cpu-thermal", 61.234)
    assert state.sensors == {}


@pytest.mark.parametrize(
    ("word", "now", "since_boot", "throttling"),
    [
        ("0", [], [], False),
        ("50000", [], ["under_voltage", "throttled"], False),  # it happened, it is over
        ("80008", ["soft_temp_limit"], ["soft_temp_limit"], True),  # Pi 3B+ at 60 °C
        ("20002", ["arm_freq_capped"], ["arm_freq_capped"], True),
        ("10001", ["under_voltage"], ["under_voltage"], False),  # not (yet) throttled for it
        (
            "0xe000e",
            ["arm_freq_capped", "throttled", "soft_temp_limit"],
            ["arm_freq_capped", "throttled", "soft_temp_limit"],
            True,
        ),
    ],
)
def test_pi_throttle_words(
    boards, word: str, now: list[str], since_boot: list[str], throttling: bool
) -> None:
    state = read_thermal(boards(pi4_root, throttled=word))
    assert state.throttled.now == now
    assert state.throttled.since_boot == since_boot
    assert state.throttling() is throttling


def test_get_throttled_elsewhere_and_broken(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "sys/devices/platform/soc@107c000000/soc@107c000000:firmware/get_throttled",
        "50000\n",
    )
    assert read_throttled(SysRoot(tmp_path)) == Throttled(0x50000)
    other = tmp_path / "other"
    _write(other, "sys/devices/platform/soc/soc:firmware/get_throttled", "not hex\n")
    assert read_throttled(SysRoot(other)) is None
    assert read_throttled(SysRoot(tmp_path / "nothing")) is None


# -- RK3588 --------------------------------------------------------------------------------------


def test_rk3588_hot_big_cluster(boards) -> None:
    state = read_thermal(boards(rk3588_root))
    assert [z.type for z in state.zones] == [
        "package-thermal",
        "bigcore0-thermal",
        "bigcore2-thermal",
        "littlecore-thermal",
        "center-thermal",
        "gpu-thermal",
        "npu-thermal",
    ]
    big0 = _zone(state, "bigcore0-thermal")
    assert big0.trips == [
        Trip("passive", 75.0, False),
        Trip("passive", 85.0, True),
        Trip("critical", 115.0, False),
    ]
    assert big0.state == "passive" and big0.cooling_engaged
    big2 = _zone(state, "bigcore2-thermal")  # 78 °C: past alert0 only, which nothing acts on
    assert big2.state == "passive" and not big2.cooling_engaged
    assert _zone(state, "package-thermal").state == "ok"  # the fan's active trips
    assert _zone(state, "littlecore-thermal").state == "ok"
    cdev = {c.type: c for c in state.cooling}
    assert cdev["cpufreq-cpu4"].cpus == [4, 5] and cdev["cpufreq-cpu4"].active
    assert cdev["cpufreq-cpu0"].cpus == [0, 1, 2, 3] and not cdev["cpufreq-cpu0"].active
    assert cdev["pwm-fan"].active and not cdev["pwm-fan"].limits_cpufreq
    assert cdev["devfreq-fb000000.gpu"].cpus == []
    capped = [f.cpu for f in state.cpufreq if f.capped]
    assert capped == [4, 5]
    assert state.cpufreq[4].ratio == pytest.approx(0.96)
    assert state.thermally_capped_cpus() == [4, 5]
    assert state.throttling()
    assert state.hottest() == ("bigcore0-thermal", 86.25)
    assert state.throttled is None


def test_rk3588_warm_but_not_throttled(boards) -> None:
    """Below the bound 85 °C trip the CPU zones read "passive" (alert0 crossed) but nothing
    is cut: throttling() must not cry wolf on every busy RK3588."""
    state = read_thermal(boards(rk3588_root, big0_temp=84000, big0_state=0))
    assert _zone(state, "bigcore0-thermal").state == "passive"
    assert state.thermally_capped_cpus() == []
    assert not state.throttling()


def test_zone_past_critical_and_hot() -> None:
    z = ThermalZone(
        "thermal_zone0",
        "soc-thermal",
        116.0,
        [Trip("passive", 85.0), Trip("hot", 105.0), Trip("critical", 115.0)],
    )
    assert z.state == "critical" and z.cooling_engaged
    assert ThermalZone("tz", "t", 106.0, z.trips).state == "hot"
    assert ThermalZone("tz", "t", 85.0, z.trips).state == "passive"  # reached counts
    assert ThermalZone("tz", "t", 84.999, z.trips).state == "ok"
    assert ThermalZone("tz", "t", None, z.trips).state == "ok"
    assert not ThermalZone("tz", "t", None, z.trips).cooling_engaged


# -- x86 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel_6x", [True, False])
def test_x86(boards, kernel_6x: bool) -> None:
    state = read_thermal(boards(x86_root, kernel_6x=kernel_6x))
    assert [z.type for z in state.zones] == [
        "acpitz",
        "INT3400 Thermal",
        "x86_pkg_temp",
        "pch_cannonlake",
        "iwlwifi_1",
    ]
    pkg = _zone(state, "x86_pkg_temp")
    assert pkg.temp_c == 54.0
    assert pkg.trips == []  # unset thresholds (0 or -274000) are no trips
    assert pkg.state == "ok"
    assert _zone(state, "acpitz").trips == [Trip("critical", 119.0)]  # no bindings: unknown
    assert _zone(state, "INT3400 Thermal").policy == "user_space"
    wifi = _zone(state, "iwlwifi_1")
    assert wifi.temp_c is None and wifi.trips == [] and wifi.state == "ok"
    assert wifi.to_dict()["temp_c"] is None
    powerclamp = next(c for c in state.cooling if c.type == "intel_powerclamp")
    assert powerclamp.cur_state == -1 and not powerclamp.active
    assert [c.type for c in state.cooling if c.limits_cpufreq] == ["Processor"] * 4
    assert [f.cpu for f in state.cpufreq] == [0, 1, 2, 3]
    assert not any(f.capped for f in state.cpufreq)
    assert state.hottest() == ("x86_pkg_temp", 54.0)
    assert state.throttled is None
    assert not state.throttling()


def test_x86_user_cap_is_not_thermal(boards) -> None:
    state = read_thermal(boards(x86_root, scaling_max=2000000))
    assert all(f.capped for f in state.cpufreq)
    assert state.thermally_capped_cpus() == []
    assert not state.throttling()


def test_x86_acpi_processor_throttling(boards) -> None:
    state = read_thermal(boards(x86_root, scaling_max=2000000, processor_state=2))
    assert state.thermally_capped_cpus() == [0, 1, 2, 3]  # "Processor" names no CPU: all
    assert state.throttling()


# -- failures ------------------------------------------------------------------------------------


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    zone(tmp_path, 0, "cpu-thermal", None, [("critical", 90000)])
    zone(tmp_path, 1, "gpu-thermal", 50000)
    (tmp_path / VIRTUAL / "thermal_zone1/temp").write_text("garbage\n")
    zone(tmp_path, 2, "ddr-thermal", 40000, [("passive", 80000)])
    (tmp_path / VIRTUAL / "thermal_zone2/trip_point_0_temp").unlink()
    (tmp_path / VIRTUAL / "thermal_zone2/trip_point_0_temp").mkdir()
    cooling(tmp_path, 0, "cpufreq-cpu0", 0, 4)
    (tmp_path / VIRTUAL / "cooling_device0/cur_state").write_text("")
    policy(tmp_path, [0, 1], 1200000, 1800000, 1800000, 408000, "schedutil")
    (tmp_path / CPU / "cpufreq/policy0/scaling_cur_freq").unlink()
    state = read_thermal(SysRoot(tmp_path))
    assert [z.temp_c for z in state.zones] == [None, None, 40.0]
    assert state.zones[0].trips == [Trip("critical", 90.0)]
    assert state.zones[2].trips == []
    assert state.cooling[0].cur_state is None and not state.cooling[0].active
    assert state.cooling[0].cpus == [0, 1]
    assert state.cpufreq[0].cur_khz is None and state.cpufreq[0].ratio is None
    assert state.hottest() == ("ddr-thermal", 40.0)
    assert not state.throttling()
    json.dumps(state.to_dict())


def test_empty_root(tmp_path: Path) -> None:
    state = read_thermal(SysRoot(tmp_path))
    assert state == ThermalState()
    assert state.hottest() is None and not state.throttling()
    assert read_cpufreq(SysRoot(tmp_path)) == []
    stats = read_system(SysRoot(tmp_path), CpuUseSampler(SysRoot(tmp_path)))
    assert stats == SystemStats({}, None, None, None, None, None)


def test_cpu_numbers_sort_numerically(tmp_path: Path) -> None:
    for n in (0, 2, 10):
        zone(tmp_path, n, f"zone{n}", 30000 + n)
    policy(
        tmp_path, list(range(12)), 1000000, 1000000, 1000000, 500000, "performance", per_cpu=True
    )
    (tmp_path / CPU / "cpu11/cpufreq").unlink()  # offline: the kernel drops the link
    state = read_thermal(SysRoot(tmp_path))
    assert [z.name for z in state.zones] == ["thermal_zone0", "thermal_zone2", "thermal_zone10"]
    assert [f.cpu for f in state.cpufreq] == list(range(11))


# -- to_dict -------------------------------------------------------------------------------------


def test_to_dict_base_units(boards) -> None:
    data = read_thermal(boards(rk3588_root)).to_dict()
    assert json.loads(json.dumps(data)) == data
    big0 = data["zones"][1]
    assert big0["temp_c"] == 86.25 and big0["state"] == "passive"
    assert big0["trips"][1] == {"type": "passive", "temp_c": 85.0, "cooled": True}
    f4 = data["cpufreq"][4]
    assert f4 == {
        "cpu": 4,
        "freq_hz": 2_304_000_000,
        "max_hz": 2_400_000_000,
        "scaling_max_hz": 2_304_000_000,
        "governor": "schedutil",
        "capped": True,
        "ratio": pytest.approx(0.96),
    }
    assert data["hottest"] == {"name": "bigcore0-thermal", "temp_c": 86.25}
    assert data["throttling"] is True and data["thermally_capped_cpus"] == [4, 5]
    assert data["throttled"] is None
    pi = read_thermal(boards(pi4_root)).to_dict()["throttled"]
    assert pi["raw"] == 0x50005 and pi["now"] == ["under_voltage", "throttled"]


# -- /proc/stat ----------------------------------------------------------------------------------

STAT_HEAD = "cpu  {agg}\n"
STAT_TAIL = (
    "intr 1462899 0 9 0 0 0 0 0 0 1 0 0 0 0 0\nctxt 2961178\nbtime 1718000000\n"
    "processes 12345\nprocs_running 2\nprocs_blocked 0\nsoftirq 802119 3 145372 4 10 0\n"
)


def _stat(rows: dict[int, list[int]]) -> str:
    agg = [sum(col) for col in zip(*rows.values(), strict=True)]
    lines = [STAT_HEAD.format(agg=" ".join(map(str, agg)))]
    lines += [f"cpu{n} " + " ".join(map(str, v)) + "\n" for n, v in rows.items()]
    return "".join(lines) + STAT_TAIL


def test_cpu_use_deltas(tmp_path: Path) -> None:
    #        user nice system idle iowait irq softirq steal guest guest_nice
    first = {
        0: [1000, 0, 500, 8000, 100, 0, 10, 0, 0, 0],
        1: [2000, 5, 300, 7000, 50, 20, 30, 0, 0, 0],
        2: [3000, 0, 200, 6000, 0, 0, 0, 0, 400, 0],
    }
    second = {
        0: [1030, 0, 510, 8050, 110, 0, 10, 0, 0, 0],  # busy 40 of 100
        1: [2070, 5, 300, 7025, 50, 0 + 20, 30 + 5, 0, 0, 0],  # busy 75 of 100
        2: [3050, 0, 200, 6050, 0, 0, 0, 0, 450, 0],  # guest is inside user: 50 of 100
        3: [10, 0, 10, 100, 0, 0, 0, 0, 0, 0],  # came online: no baseline
    }
    _write(tmp_path, "proc/stat", _stat(first))
    sampler = CpuUseSampler(SysRoot(tmp_path))
    assert sampler.sample() == {}
    _write(tmp_path, "proc/stat", _stat(second))
    assert sampler.sample() == {0: 0.4, 1: 0.75, 2: 0.5}
    # cpu0 and cpu3: no tick passed, 0 rather than a division by zero. cpu1: iowait went
    # backwards (proc.rst: "the iowait field ... can decrease"), the time reappearing as idle.
    # cpu2: a bogus idle drop would make busy exceed the total; clamped to 1.
    third = dict(second)
    third[1] = [2080, 5, 300, 7045, 40, 20, 35, 0, 0, 0]
    third[2] = [3060, 0, 200, 6045, 0, 0, 0, 0, 450, 0]
    _write(tmp_path, "proc/stat", _stat(third))
    assert sampler.sample() == {0: 0.0, 1: 0.5, 2: 1.0, 3: 0.0}


def test_cpu_use_old_kernel_columns(tmp_path: Path) -> None:
    """Linux 2.6.11-era /proc/stat has seven columns (no steal, guest)."""
    _write(tmp_path, "proc/stat", "cpu0 10 0 10 80 0 0 0\n")
    sampler = CpuUseSampler(SysRoot(tmp_path))
    sampler.sample()
    _write(tmp_path, "proc/stat", "cpu0 20 0 20 140 0 0 0\n")
    assert sampler.sample() == {0: 0.25}


def test_read_system_from_root(tmp_path: Path) -> None:
    _write(tmp_path, "proc/stat", _stat({0: [0] * 10, 1: [0] * 10}))
    _write(
        tmp_path,
        "proc/meminfo",
        "MemTotal:        3884096 kB\nMemFree:          301236 kB\n"
        "MemAvailable:    2461832 kB\nBuffers:           81220 kB\n",
    )
    _write(tmp_path, "proc/loadavg", "1.52 0.98 0.61 3/412 28931\n")
    _write(tmp_path, "proc/uptime", "354102.37 1311459.80\n")
    root = SysRoot(tmp_path)
    sampler = CpuUseSampler()  # made without a root: read_system samples through its own
    read_system(root, sampler)
    _write(
        tmp_path,
        "proc/stat",
        _stat({0: [30, 0, 10, 60, 0, 0, 0, 0, 0, 0], 1: [0, 0, 0, 100, 0, 0, 0, 0, 0, 0]}),
    )
    stats = read_system(root, sampler)
    assert stats.cpu_percent == {0: pytest.approx(40.0), 1: 0.0}
    assert stats.mem_total_bytes == 3884096 * 1024
    assert stats.mem_available_bytes == 2461832 * 1024
    assert stats.load_avg == (1.52, 0.98, 0.61)
    assert stats.uptime_s == 354102.37
    assert stats.rss_bytes is None  # not live: whose RSS would it be?
    assert stats.to_dict() == {
        "cpu_percent": {"0": 40.0, "1": 0.0},
        "cpu_percent_mean": 20.0,
        "mem_total_bytes": 3884096 * 1024,
        "mem_available_bytes": 2461832 * 1024,
        "load_avg": [1.52, 0.98, 0.61],
        "rss_bytes": None,
        "uptime_s": 354102.37,
    }
    assert read_system(root).cpu_percent == {}  # no sampler: no CPU use


def test_read_system_old_meminfo(tmp_path: Path) -> None:
    _write(tmp_path, "proc/meminfo", "MemTotal:  1000 kB\nMemFree:  10 kB\n")  # before 3.14
    _write(tmp_path, "proc/loadavg", "\n")
    stats = read_system(SysRoot(tmp_path))
    assert stats.mem_total_bytes == 1024000 and stats.mem_available_bytes is None
    assert stats.load_avg is None and stats.uptime_s is None
