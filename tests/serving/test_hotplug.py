"""Accelerator hot-plug: the real pyudev netlink monitor, and how a served model adapts when
the hardware changes. No accelerator can be plugged into this machine, so the "NPU that went
away" is a real CPU session standing in under an NPU candidate's name (the one boundary here
that cannot be real), and the "NPU that arrived" is a device root with an accel node."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from backends import probe_hardware
from backends.base import Candidate
from edged.config import BatchingConfig
from edged.hotplug import AcceleratorMonitor
from edged.selection.policy import Policy
from edged.serving.models import load_model
from sysconf import SysRoot

CLS = {"x": (1, 3, 48, 192)}
FAST = Policy(runs=10, warmup=1, time_budget_s=1.0, threads=1, shapes=CLS)


def test_monitor_runs_on_this_machine() -> None:
    monitor = AcceleratorMonitor(lambda action, path: None)
    assert monitor.start(), monitor.error
    try:
        assert monitor.running
    finally:
        monitor.stop()
    assert not monitor.running


def test_monitor_debounces_a_burst() -> None:
    import pyudev

    calls: list[tuple[str, str]] = []
    fired = threading.Event()
    monitor = AcceleratorMonitor(lambda a, p: (calls.append((a, p)), fired.set()), debounce_s=0.2)
    device = pyudev.Devices.from_path(pyudev.Context(), "/sys/class/net/lo")
    for _ in range(5):  # a USB Coral re-enumerating sends several events at once
        monitor._event(device)
    assert fired.wait(3)
    time.sleep(0.3)
    assert calls == [("change", device.sys_path)]


class StandIn:
    """A real session presented under another candidate's name."""

    def __init__(self, session, candidate: Candidate) -> None:
        self._session = session
        self.candidate = candidate
        self.inputs, self.outputs = session.inputs, session.outputs

    def run(self, feeds):
        return self._session.run(feeds)

    def info(self):
        return self._session.info()

    def close(self) -> None:
        self._session.close()


@pytest.fixture
def served(models_dir: Path, tmp_path: Path):
    model = load_model(
        "cls",
        models_dir / "ppocr_cls.onnx",
        FAST,
        BatchingConfig(),
        probe_hardware(),
        tmp_path / "state",
    )
    yield model
    model.worker.stop(1.0)


def test_removed_accelerator_fails_over_at_once(served) -> None:
    npu = Candidate("openvino", "NPU", "fp16")
    served.worker.swap_session(StandIn(served.worker.session, npu))
    outcome = served.adapt(probe_hardware())  # this machine: no NPU among OpenVINO's devices
    assert "openvino:NPU:fp16 gone, failed over" in outcome
    assert served.worker.session.candidate.key != npu.key
    assert served.worker.failovers == 1
    out = served.worker.session.run({"x": np.zeros((1, 3, 48, 192), np.float32)})
    assert next(iter(out.values())).shape == (1, 2)


def test_arrived_accelerator_triggers_a_new_selection(served, tmp_path: Path) -> None:
    live = probe_hardware()
    root = tmp_path / "root"
    (root / "dev" / "accel").mkdir(parents=True)
    (root / "dev" / "accel" / "accel0").touch()
    device = root / "sys" / "devices" / "pci0000:00" / "0000:00:0b.0"
    (device / "driver").parent.mkdir(parents=True)
    (root / "sys" / "bus" / "pci" / "drivers" / "intel_vpu").mkdir(parents=True)
    (device / "driver").symlink_to("../../../bus/pci/drivers/intel_vpu")
    (root / "sys" / "class" / "accel" / "accel0").mkdir(parents=True)
    (root / "sys" / "class" / "accel" / "accel0" / "device").symlink_to(device)
    with_npu = dataclasses.replace(live, accelerators=probe_hardware(SysRoot(root)).accelerators)
    assert [a.name for a in with_npu.accelerators] == ["Intel NPU"]
    assert with_npu.fingerprint() != live.fingerprint()
    before = served.selection
    outcome = served.adapt(with_npu)
    assert served.selection is not before
    assert not served.selection.from_cache  # measured anew for the new hardware
    assert served.selection.cache_key != before.cache_key
    assert len(list((served.state_dir / "selection").glob("*.json"))) == 2
    assert outcome.startswith(("kept", "switched to"))
    assert served.worker.session.candidate.key == served.selection.selected.candidate.key


# -- the daemon's side: Daemon._hardware_changed with the probe as the boundary ----------------


class _Lines(__import__("logging").Handler):
    def __init__(self) -> None:
        super().__init__()
        self.payloads: list[dict] = []

    def emit(self, record) -> None:
        import json

        self.payloads.append(json.loads(record.getMessage()))


def _npu_root(folder: Path) -> Path:
    """A device root with an Intel NPU (accel node bound to intel_vpu), as probe sees one."""
    root = folder / "root"
    (root / "dev" / "accel").mkdir(parents=True)
    (root / "dev" / "accel" / "accel0").touch()
    device = root / "sys" / "devices" / "pci0000:00" / "0000:00:0b.0"
    (device / "driver").parent.mkdir(parents=True)
    (root / "sys" / "bus" / "pci" / "drivers" / "intel_vpu").mkdir(parents=True)
    (device / "driver").symlink_to("../../../bus/pci/drivers/intel_vpu")
    (root / "sys" / "class" / "accel" / "accel0").mkdir(parents=True)
    (root / "sys" / "class" / "accel" / "accel0" / "device").symlink_to(device)
    return root


@pytest.mark.integration
def test_daemon_hardware_change_reselects_and_fails_over(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's hot-plug path end to end below the udev monitor: the probe (the boundary
    here) reports an NPU that arrived, then one that went away; each model re-selects on the
    new hardware, or fails over at once from the backend that is gone; each change is an
    event. The same hardware again changes nothing."""
    import asyncio
    import logging

    import sysconf.hardware
    from edged.config import load_config
    from edged.daemon import DRAIN_S, Daemon
    from edged.serving.model_set import stop_workers
    from edged.telemetry.mqtt.log_publisher import LogPublisher

    config = tmp_path / "edged.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:0"
socket = ""
state_dir = "{tmp_path / "state"}"
[selection]
runs = 10
warmup = 1
time_budget_s = 1.0
[telemetry]
enabled = false
[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
threads = 1
shapes = {{ x = [1, 3, 48, 192] }}
""")
    cpus = os.sched_getaffinity(0)  # the daemon pins its thread (here: this one) to housekeeping
    daemon = Daemon(load_config(config))
    live = daemon.hw
    daemon.models, daemon.failed = daemon.load_models(daemon.config, {})
    assert not daemon.failed
    lines = _Lines()
    logger = logging.getLogger("test.hotplug.events")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    daemon.publisher = LogPublisher(logger)
    served = daemon.models["cls"]
    with_npu = dataclasses.replace(
        live, accelerators=probe_hardware(SysRoot(_npu_root(tmp_path))).accelerators
    )
    seen: list[object] = []

    def change(hw, action: str) -> None:
        def fake_probe(*args, **kwargs):
            seen.append(hw)
            return hw

        monkeypatch.setattr(sysconf.hardware, "probe", fake_probe)

        async def run() -> None:
            daemon._reload_lock = asyncio.Lock()
            await daemon._hardware_changed(action, "/dev/accel/accel0")

        asyncio.run(run())

    try:
        # 1. An NPU arrives: a fresh selection for the new hardware.
        before = served.selection
        change(with_npu, "add")
        assert daemon.hw is with_npu
        assert served.selection is not before and not served.selection.from_cache
        assert served.selection.cache_key != before.cache_key
        assert served.worker.session.candidate.key == served.selection.selected.candidate.key
        [event] = [p for p in lines.payloads if p.get("kind") == "hardware_change"]
        assert (event["model"], event["action"], event["device"]) == (
            "cls",
            "add",
            "/dev/accel/accel0",
        )
        assert event["outcome"].startswith(("kept", "switched to"))
        # 2. The same hardware again: probed, nothing else happens.
        current = served.selection
        change(with_npu, "change")
        assert len(seen) == 2 and served.selection is current
        assert len([p for p in lines.payloads if p.get("kind") == "hardware_change"]) == 1
        # 3. It goes away while a model runs on it (a real CPU session under the NPU's name,
        # as above): the model fails over at once and keeps serving.
        npu = Candidate("openvino", "NPU", "fp16")
        served.worker.swap_session(StandIn(served.worker.session, npu))
        change(live, "remove")
        assert daemon.hw is live
        assert served.worker.session.candidate.key != npu.key
        assert served.worker.failovers == 1
        last = [p for p in lines.payloads if p.get("kind") == "hardware_change"][-1]
        assert "openvino:NPU:fp16 gone, failed over" in last["outcome"]
        assert last["action"] == "remove"
        out = served.worker.session.run({"x": np.zeros((1, 3, 48, 192), np.float32)})
        assert next(iter(out.values())).shape == (1, 2)
    finally:
        logger.removeHandler(lines)
        os.sched_setaffinity(0, cpus)  # or the tests after this one run on one CPU
        stop_workers(daemon.models.values(), DRAIN_S)
