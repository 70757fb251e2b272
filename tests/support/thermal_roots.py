"""A board root (tests/support/roots.py) with thermal zones, trip points and an engaged cpufreq
cooling device, in the files the kernel's thermal and cpufreq drivers show, for the thermal
audit checks."""

from __future__ import annotations

from pathlib import Path

from tests.support.roots import board_root

TRIPS = (("passive", 70000), ("hot", 85000), ("critical", 95000))


def thermal_root(root: Path, temps: dict[str, int], throttled: str | None = None) -> Path:
    """Zones with passive 70 °C, hot 85 °C, critical 95 °C trips; cpu0-3 capped by an engaged
    cpufreq cooling device. `temps`: zone type -> millidegrees; `throttled`: the Raspberry Pi
    firmware's get_throttled, when given."""
    board_root(root, cpus=4)
    files: dict[str, str] = {}
    thermal = "sys/class/thermal"
    for i, (kind, milli) in enumerate(temps.items()):
        zone = f"{thermal}/thermal_zone{i}"
        files[f"{zone}/type"] = kind
        files[f"{zone}/temp"] = str(milli)
        for n, (trip, temp) in enumerate(TRIPS):
            files[f"{zone}/trip_point_{n}_type"] = trip
            files[f"{zone}/trip_point_{n}_temp"] = str(temp)
    files |= {
        f"{thermal}/cooling_device0/type": "cpufreq-cpu0",
        f"{thermal}/cooling_device0/cur_state": "2",
        f"{thermal}/cooling_device0/max_state": "5",
    }
    for cpu in range(4):
        policy = f"sys/devices/system/cpu/cpu{cpu}/cpufreq"
        files |= {
            f"{policy}/related_cpus": "0 1 2 3",
            f"{policy}/scaling_cur_freq": "1200000",
            f"{policy}/cpuinfo_max_freq": "1800000",
            f"{policy}/scaling_max_freq": "1200000",
        }
    if throttled is not None:
        files["sys/devices/platform/soc/soc:firmware/get_throttled"] = throttled
    for relative, text in files.items():
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
    return root
