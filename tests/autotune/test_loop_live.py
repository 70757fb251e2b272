"""The tuning loop against a real served model and a real intruder the test starts: a CPU
hog pinned on the inference core is named by telemetry, moved off it by the loop
(sched_setaffinity through the journal), verified and kept; reverting the journal puts it
back. The journal lives in a temporary root; the only thread moved is the test's own hog."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from backends import probe_hardware
from edged.autotune.loop import TuningLoop
from edged.autotune.settings import TuningConfig
from edged.config import BatchingConfig
from edged.selection.policy import Policy
from edged.serving.models import load_model
from edged.telemetry.loop import IntruderWatch, TelemetryLoop
from edged.telemetry.sampler import SAMPLER_HZ, CoreSampler
from sysconf.cpusets import CpuPlan
from sysconf.journals import Journals
from sysconf.sysroot import SysRoot
from tests.support.cpu_hog import HOG_NAME, HOGS, start_hog, steady_client


class Collect:
    def __init__(self) -> None:
        self.telemetry: list[dict] = []
        self.events: list[tuple[str, dict]] = []

    def publish_telemetry(self, payload: dict) -> None:
        self.telemetry.append(payload)

    def publish_event(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))


@pytest.mark.needs_cpus(2, reason="one for the model and its hog, one for the client")
@pytest.mark.timing
@pytest.mark.alone
def test_a_pinned_hog_is_named_moved_verified_and_kept(models_dir: Path, tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    cpu, other = cpus[-1], cpus[0]
    root = tmp_path / "root"
    root.mkdir()
    model = load_model(
        "cls",
        models_dir / "ppocr_cls.onnx",
        Policy(
            runs=10,
            warmup=1,
            time_budget_s=1.0,
            threads=1,
            shapes={"x": (1, 3, 48, 192)},
            cpus=(cpu,),
        ),
        BatchingConfig(),
        probe_hardware(),
        tmp_path / "state",
    )
    sink = Collect()
    # Seven windows each side: up to ten swapped pairs still pass the rank test (p = 0.038),
    # and four hogs leave the worker a fifth of its core: on a CI machine whose other test
    # workers land on the inference core too, the hogs' effect still stands out. The moved
    # hogs share the client's core, which slows its submits a little: the "worse" tolerance
    # is wider here than the default, this test is about the loop's steps.
    settings = TuningConfig(
        auto="apply", windows=7, settle_windows=1, worse_tolerance=0.3, root=root
    )
    plan = CpuPlan(inference=(cpu,), housekeeping=(other,), source="override")
    hogs = [start_hog(cpu, seconds=120) for _ in range(HOGS)]
    # Only the test's own hogs may move (the other test workers' threads that land on the
    # inference core are named too, and are not this test's to move).
    ours = {hog.pid for hog in hogs}
    tuning = TuningLoop(
        settings, plan, tmp_path, sink, root=SysRoot.at(root), may_move=lambda t: t["pid"] in ours
    )
    loop = TelemetryLoop(
        2.0,
        lambda: {"cls": model},
        sink,
        sampler=CoreSampler([cpu], rate_hz=SAMPLER_HZ, cpu_affinity={other}),
        intruder_watch=IntruderWatch(every_s=1.5),
        observers=[tuning.observe],
    )
    os.sched_setaffinity(0, {other})  # this thread is the client: off the model's core
    try:
        time.sleep(0.2)
        loop.start()

        def settled() -> bool:
            return any(s.get("state") in ("kept", "reverted") for s in tuning.ledger.steps)

        steady_client(model, 70.0, hz=100, until=settled)
        hog_cpus = [os.sched_getaffinity(hog.pid) for hog in hogs]
        records = Journals(SysRoot.at(root), "/var/lib/edged").tuning.records()
        Journals(SysRoot.at(root), "/var/lib/edged").revert()
        hog_cpus_reverted = [os.sched_getaffinity(hog.pid) for hog in hogs]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        loop.stop()
        model.worker.stop(1.0)
        os.sched_setaffinity(0, set(cpus))
    for step in tuning.ledger.steps:
        print(f"\nstep {step['id']}: {step['state']} {step['action']} {step['reason']}")
    steps = [s for s in tuning.ledger.steps if s["action"] == "move-intruder"]
    assert steps, f"no move proposed: {tuning.ledger.to_dict()}"
    step = steps[0]
    assert step["state"] == "kept", step["reason"]
    moved = {c["path"]: c for c in step["applied"]}
    for hog in hogs:
        change = moved[f"/proc/{hog.pid}/task/{hog.pid}"]
        assert change["new"] == str(other) and HOG_NAME in change["reason"]
    assert hog_cpus == [{other}] * HOGS  # moved and kept
    assert hog_cpus_reverted == [{cpu}] * HOGS  # and the journal's revert put them back
    affinity = [r for r in records if r.get("kind") == "affinity"]
    assert len(affinity) == HOGS
    assert all(r["old"] == str(cpu) and r["started"] > 0 for r in affinity)
    kinds = [d["state"] for k, d in sink.events if k == "tuning"]
    assert kinds[:2] == ["applied", "kept"]
