"""Energy from the board's own meters on fake sysfs roots: RAPL counters with their wrap,
hwmon energy counters and power readings integrated, Jetson INA3221 rails (mainline hwmon
and L4T's IIO driver), a counter that cannot be read or is root-only; and the telemetry
payload that carries it, energy per inference by model, checked against the schema."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from backends import probe_hardware
from edged.config import BatchingConfig
from edged.selection.policy import Policy
from edged.serving.models import load_model
from edged.telemetry.energy_share import per_inference_mj
from edged.telemetry.loop import TelemetryLoop
from sysconf.energy import EnergyMeter
from sysconf.sysroot import SysRoot
from tests.support.schema import check

RAPL = "sys/class/powercap"
WRAP_UJ = 262143328850  # a package domain's max_energy_range_uj


def write(root: Path, files: dict[str, object]) -> Path:
    for relative, value in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    return root


def rapl_root(root: Path) -> Path:
    return write(
        root,
        {
            f"{RAPL}/intel-rapl:0/name": "package-0",
            f"{RAPL}/intel-rapl:0/energy_uj": WRAP_UJ - 1_000_000,
            f"{RAPL}/intel-rapl:0/max_energy_range_uj": WRAP_UJ,
            f"{RAPL}/intel-rapl:0:0/name": "core",
            f"{RAPL}/intel-rapl:0:0/energy_uj": 5_000_000,
            f"{RAPL}/intel-rapl:0:0/max_energy_range_uj": WRAP_UJ,
        },
    )


def test_rapl_counters_with_their_wrap(tmp_path: Path) -> None:
    root = rapl_root(tmp_path)
    meter = EnergyMeter(SysRoot.at(root))
    assert [(d.name, d.device) for d in meter.domains] == [
        ("package-0", True),
        ("core (intel-rapl:0:0)", False),  # a part of the package: not added to it
    ]
    first = meter.read(100.0)
    assert first.joules is None and first.watts is None  # a first reading has no interval
    write(root, {f"{RAPL}/intel-rapl:0/energy_uj": 3_000_000})  # wrapped: 1 J + 3 J
    write(root, {f"{RAPL}/intel-rapl:0:0/energy_uj": 7_000_000})
    second = meter.read(102.0)
    assert second.joules == pytest.approx(4.0) and second.watts == pytest.approx(2.0)
    core = second.domains[1]
    assert core.joules == pytest.approx(2.0) and core.watts == pytest.approx(1.0)
    write(root, {f"{RAPL}/intel-rapl:0/energy_uj": 8_000_000})
    assert meter.read(104.0).joules == pytest.approx(5.0)
    assert meter.domains[0].joules == pytest.approx(9.0)  # since the meter started
    assert EnergyMeter(SysRoot.at(tmp_path / "nothing")).domains == []


def test_a_counter_that_cannot_be_read_or_is_root_only(tmp_path: Path) -> None:
    root = rapl_root(tmp_path)
    counter = root / RAPL / "intel-rapl:0/energy_uj"
    counter.chmod(0o400)
    meter = EnergyMeter(SysRoot.at(root))
    if os.geteuid() == 0:  # the file is root's: the unprivileged edged user could not read it
        assert meter.notes and "package-0" in meter.notes[0]
        assert "readable by root only" in meter.notes[0]
        assert f"z {RAPL.replace('sys', '/sys', 1)}/intel-rapl:0/energy_uj 0444" in meter.notes[0]
    meter.read(1.0)
    counter.unlink()
    counter.mkdir()  # unreadable whoever reads it
    reading = meter.read(2.0)
    package = reading.domains[0]
    assert "cannot read /sys/class/powercap/intel-rapl:0/energy_uj" in package.problem
    assert package.watts is None and reading.to_dict()["domains"][0]["problem"]
    counter.rmdir()
    write(root, {f"{RAPL}/intel-rapl:0/energy_uj": 1_000_000})
    assert meter.read(3.0).domains[0].problem == ""  # readable again: a fresh baseline
    write(root, {f"{RAPL}/intel-rapl:0/energy_uj": 1_500_000})
    assert meter.read(4.0).joules == pytest.approx(0.5)


def test_hwmon_power_is_integrated_and_ina3221_rails_are_volts_times_amps(tmp_path: Path):
    hwmon = "sys/class/hwmon"
    root = write(
        tmp_path,
        {
            f"{hwmon}/hwmon0/name": "ina3221",
            f"{hwmon}/hwmon0/in1_label": "VDD_IN",
            f"{hwmon}/hwmon0/in1_input": 5000,  # mV
            f"{hwmon}/hwmon0/curr1_input": 1000,  # mA: 5 W
            f"{hwmon}/hwmon0/in2_label": "VDD_CPU_GPU_CV",
            f"{hwmon}/hwmon0/in2_input": 5000,
            f"{hwmon}/hwmon0/curr2_input": 400,
            f"{hwmon}/hwmon1/name": "pac1934",
            f"{hwmon}/hwmon1/power1_input": 2_000_000,  # µW
            f"{hwmon}/hwmon2/name": "amd_energy",
            f"{hwmon}/hwmon2/energy1_input": 10_000_000,  # µJ
            f"{hwmon}/hwmon2/energy1_label": "Esocket0",
        },
    )
    meter = EnergyMeter(SysRoot.at(root))
    names = {d.name: d for d in meter.domains}
    assert set(names) == {
        "ina3221/VDD_IN",
        "ina3221/VDD_CPU_GPU_CV",
        "pac1934/power1_input",
        "amd_energy/Esocket0",
    }
    # VDD_IN feeds the other rails: the device's total is it (and the energy counter), once
    assert [d.name for d in meter.domains if d.device] == ["ina3221/VDD_IN", "amd_energy/Esocket0"]
    meter.read(0.0)
    write(root, {f"{hwmon}/hwmon0/curr1_input": 1400, f"{hwmon}/hwmon2/energy1_input": 16_000_000})
    reading = meter.read(2.0)
    vdd_in = names["ina3221/VDD_IN"]
    assert vdd_in.joules == pytest.approx((5 + 7) / 2 * 2)  # the trapezoid: 12 J
    assert names["pac1934/power1_input"].watts == pytest.approx(2.0)
    assert reading.joules == pytest.approx(12 + 6)


def test_jetson_l4t_iio_rails(tmp_path: Path) -> None:
    iio = "sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0"
    root = write(
        tmp_path,
        {
            f"{iio}/rail_name_0": "VDD_IN",
            f"{iio}/in_power0_input": 4000,  # mW
            f"{iio}/rail_name_1": "VDD_SYS_GPU",
            f"{iio}/in_power1_input": 1000,
        },
    )
    meter = EnergyMeter(SysRoot.at(root))
    assert [(d.name, d.device) for d in meter.domains] == [
        ("ina3221/VDD_IN", True),
        ("ina3221/VDD_SYS_GPU", False),
    ]
    meter.read(10.0)
    assert meter.read(11.0).joules == pytest.approx(4.0)


def test_an_npu_runtimes_own_power_is_a_domain(tmp_path: Path) -> None:
    """A Raspberry Pi with a Hailo measures no energy itself; HailoRT's power reading (the
    Hailo session's `power_watts`, once per device) is integrated like a hwmon rail."""
    meter = EnergyMeter(SysRoot.at(tmp_path))
    assert meter.domains == [] and meter.read(0.0).joules is None
    meter.read(10.0, {"hailo:HAILO8": 2.5})
    reading = meter.read(12.0, {"hailo:HAILO8": 3.5})
    assert reading.joules == pytest.approx(6.0) and reading.domains[0].source == "npu"
    missed = meter.read(14.0, {})
    assert "no power reading" in missed.domains[0].problem and missed.joules is None
    check_energy = {"ts": 1.0, "seq": 1, "bdSeq": 0, "models": {}, "thermal": {}, "system": {}}
    check("telemetry", {**check_energy, "energy": reading.to_dict()})


def test_energy_per_inference_is_shared_by_compute_time() -> None:
    models = {
        "det": {"compute": {"count": 10, "mean_ms": 30.0}},  # 300 ms of compute
        "cls": {"compute": {"count": 100, "mean_ms": 1.0}},  # 100 ms
        "idle": {"compute": {"count": 0, "mean_ms": None}},
    }
    shares = per_inference_mj(models, 4.0)
    assert shares == {"det": pytest.approx(300.0), "cls": pytest.approx(10.0)}
    assert per_inference_mj(models, None) == {}


def test_the_telemetry_payload_carries_energy(models_dir: Path, tmp_path: Path) -> None:
    root = rapl_root(tmp_path / "board")
    served = load_model(
        "cls",
        models_dir / "ppocr_cls.onnx",
        Policy(runs=5, warmup=1, time_budget_s=1.0, threads=1, shapes={"x": (1, 3, 48, 192)}),
        BatchingConfig(),
        probe_hardware(),
        tmp_path / "state",
    )
    payloads: list[dict] = []

    class Sink:
        def publish_telemetry(self, payload: dict) -> None:
            payloads.append(payload)

        def publish_event(self, kind: str, detail: dict) -> None:
            pass

    loop = TelemetryLoop(60, lambda: {"cls": served}, Sink(), root=SysRoot.at(root))
    try:
        loop.start()
        feeds = {"x": np.zeros((1, 3, 48, 192), np.float32)}
        done = threading.Semaphore(0)
        for _ in range(20):
            served.worker.submit(feeds, lambda *a: done.release())
        for _ in range(20):
            assert done.acquire(timeout=30)
        write(root, {f"{RAPL}/intel-rapl:0/energy_uj": 1_000_000})  # wrapped: 2 J in all
        loop.stop()  # publishes the window
    finally:
        served.worker.stop(1.0)
    (payload,) = payloads
    assert payload["energy"]["joules"] == pytest.approx(2.0)
    assert payload["models"]["cls"]["energy_mj_per_inference"] == pytest.approx(2000 / 20)
    assert loop.energy_by_model["cls"] == pytest.approx(2.0)
    check("telemetry", {"ts": 1.0, "seq": 1, "bdSeq": 0, **payload})
