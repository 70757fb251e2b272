"""Thermal headroom on fake thermal roots, the ladder's steps and hysteresis, the admission
gate's token bucket, and the [thermal] table's checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import ConfigError, parse_config
from edged.serving.admission import Gate, Throttled
from edged.thermal.ladder import Ladder
from sysconf.headroom import HeadroomWatch
from sysconf.sysroot import SysRoot
from tests.support.thermal_roots import thermal_root

ZONE = "sys/class/thermal/thermal_zone{}/{}"


def heat(root: Path, zone: int, celsius: float) -> None:
    (root / ZONE.format(zone, "temp")).write_text(f"{int(celsius * 1000)}\n")


def test_headroom_by_zone_type_from_the_first_throttling_trip(tmp_path: Path) -> None:
    # passive 70, hot 85, critical 95 on each zone; band 20: 0 at 50 °C, 1.0 at 70 °C
    root = thermal_root(tmp_path, {"cpu-thermal": 60000, "npu-thermal": 45000, "gpu-thermal": 0})
    (root / ZONE.format(2, "temp")).write_text("oops\n")  # a sensor that answers nonsense
    watch = HeadroomWatch(SysRoot.at(root), ("cpu-*", "npu-thermal"))
    h = watch.read()
    assert [z.type for z in h.zones] == ["cpu-thermal", "npu-thermal"]  # gpu not watched
    assert [z.headroom for z in h.zones] == [0.5, 0.0] and h.device == 0.5
    assert h.hottest is not None and h.hottest.type == "cpu-thermal"
    assert h.to_dict()["zones"][0] == {
        "zone": "thermal_zone0",
        "type": "cpu-thermal",
        "temp_c": 60.0,
        "trip_type": "passive",
        "trip_c": 70.0,
        "headroom": 0.5,
    }
    heat(root, 1, 74)  # past the trip: above 1
    assert watch.read().device == pytest.approx(1.2)
    # After the first scan only `temp` is read: a trip moved later is seen at the next scan.
    (root / ZONE.format(1, "trip_point_0_temp")).write_text("80000\n")
    assert watch.read().device == pytest.approx(1.2)
    watch.rescan_s = 0
    assert watch.read().device == pytest.approx(0.7)  # 74 °C against the trip at 80
    every = HeadroomWatch(SysRoot.at(root), band_c=10).read()
    assert [z.headroom for z in every.zones] == [0.0, 0.4, None]  # unreadable: unknown


def test_a_passive_trip_with_nothing_bound_and_active_trips_do_not_count(tmp_path: Path) -> None:
    root = thermal_root(tmp_path, {"soc-thermal": 72000})
    zone = root / "sys/class/thermal/thermal_zone0"
    (zone / "cdev0_trip_point").write_text("1\n")  # the cooling device acts on the hot trip
    h = HeadroomWatch(SysRoot.at(root)).read()
    assert h.zones[0].trip is not None and h.zones[0].trip.type == "hot"
    assert h.device == pytest.approx((72 - 65) / 20)
    for n in (1, 2):
        (zone / f"trip_point_{n}_type").write_text("active\n")
    assert HeadroomWatch(SysRoot.at(root)).read().device is None  # nothing throttles here
    assert HeadroomWatch(SysRoot.at(tmp_path / "none")).read().device is None


def test_the_ladder_steps_up_at_once_and_down_one_step_per_hold() -> None:
    ladder = Ladder((0.8, 0.9, 1.0), hysteresis=0.1, hold_s=5)
    assert ladder.update(0.5, 0) is None and ladder.name == "normal"
    assert ladder.update(None, 1) is None  # unknown changes nothing
    assert ladder.update(0.95, 2) == 2  # jumped past cheaper straight to limit
    assert ladder.update(0.85, 3) is None  # below 0.9 but within the hysteresis
    assert ladder.update(0.75, 4) is None  # cool enough, the hold begins
    assert ladder.update(0.89, 6) is None  # back within: the hold starts over
    assert ladder.update(0.75, 7) is None
    assert ladder.update(0.75, 11.9) is None
    assert ladder.update(0.75, 12) == 1 and ladder.name == "cheaper"
    assert ladder.update(0.65, 13) is None  # the next step down waits its own hold
    assert ladder.update(0.65, 17) == 0
    assert ladder.update(1.3, 18) == 3 and ladder.name == "shed"
    with pytest.raises(ValueError):
        Ladder((0.9, 0.8, 1.0), 0.1, 5)


def test_the_gate_limits_to_a_rate_and_says_when_to_come_back() -> None:
    gate = Gate("cls", retry_after_s=7)
    for _ in range(50):
        gate.check()
    assert gate.admitted == 50
    gate.set("limit", "headroom 0.93", rate=2.0)
    passed = 0
    for _ in range(10):
        try:
            gate.check()
            passed += 1
        except Throttled as exc:
            assert exc.status == 503 and exc.retry_after == 7
            assert "limited to 2 requests/s while the device cools (headroom 0.93)" in str(exc)
    assert passed == 2 and gate.refused == 8  # a burst of one second's worth
    gate.set("shut", "headroom 1.05")
    with pytest.raises(Throttled, match="refusing requests"):
        gate.check()
    gate.set("open")
    gate.check()
    assert gate.to_dict() == {"mode": "open", "rate": None, "reason": None, "refused": 9}


def test_the_thermal_table(tmp_path: Path) -> None:
    def error(text: str) -> str:
        with pytest.raises(ConfigError) as info:
            parse_config(f"[thermal]\n{text}", tmp_path / "edged.toml")
        return str(info.value)

    assert "thermal.admission: expected one of off, on" in error('admission = "auto"\n')
    assert "must rise in that order" in error("cheaper_at = 0.95\nlimit_at = 0.9\n")
    assert "thermal.zones: must be a list of zone types" in error('zones = "cpu-thermal"\n')
    assert "thermal.root: no such folder" in error('root = "/nonexistent/board"\n')
    config = parse_config(
        f'[thermal]\nadmission = "on"\nzones = ["cpu-thermal"]\nroot = "{tmp_path}"\n',
        tmp_path / "edged.toml",
    )
    assert config.thermal.admission == "on" and config.thermal.zones == ("cpu-thermal",)
    assert config.thermal.thresholds == (0.8, 0.9, 1.0) and config.thermal.root == tmp_path
