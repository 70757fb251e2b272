"""The cheaper way to run a model, from the selection's evidence, on a real family (the cls
model and its INT8 variant on onnxruntime): the verified candidate costing least is loaded
and swapped in, answers, and the pick comes back; one thread when nothing verified is
cheaper. The measured latencies are set here so that which is cheaper does not depend on
this machine's ISA; the sessions, the swap and the answers are real."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np

from backends import probe_hardware
from edged.config import BatchingConfig
from edged.selection.policy import Policy
from edged.serving.cheaper import cheaper_plan
from edged.serving.models import load_model
from edged.serving.thermal_admission import ThermalGovernor
from edged.thermal.settings import ThermalConfig

CLS = {"x": (1, 3, 48, 192)}


def answer(served) -> str:
    """One request through the worker: the model file of the session that answered it."""
    done = threading.Event()
    got: dict = {}

    def finish(outputs, error, timing) -> None:
        got.update(outputs=outputs, error=error)
        done.set()

    served.worker.submit({"x": np.zeros((1, 3, 48, 192), np.float32)}, finish)
    assert done.wait(30) and got["error"] is None and got["outputs"]
    return served.worker.session.model.path.name


def with_p50(served, costs: dict[str, float]) -> None:
    """The evidence's p50 per model file name (what the selection would have measured)."""
    sel = served.selection
    sel.evidence = [
        replace(e, latency=replace(e.latency, p50_ms=costs[sel.model_of(e).path.name]))
        if e.latency is not None and sel.model_of(e).path.name in costs
        else e
        for e in sel.evidence
    ]


def test_the_cheaper_verified_candidate_serves_and_the_pick_comes_back(
    models_dir: Path, tmp_path: Path
) -> None:
    hw = probe_hardware()
    served = load_model(
        "cls",
        models_dir / "ppocr_cls.onnx",
        Policy(runs=5, warmup=1, time_budget_s=1.0, threads=1, shapes=CLS, backend="onnxruntime"),
        BatchingConfig(),
        hw,
        tmp_path / "state",
        variants=(models_dir / "ppocr_cls_int8.onnx",),
    )
    try:
        sel = served.selection
        verified = {
            sel.model_of(e).path.name for e in sel.evidence if e.status in ("passed", "selected")
        }
        assert verified == {"ppocr_cls.onnx", "ppocr_cls_int8.onnx"}, sel.why
        pick = served.worker.session.model.path.name
        other = ({"ppocr_cls.onnx", "ppocr_cls_int8.onnx"} - {pick}).pop()
        with_p50(served, {pick: 10.0, other: 9.5})  # not 10 % cheaper, and one thread already
        assert cheaper_plan(served, hw) is None
        with_p50(served, {pick: 10.0, other: 4.0})
        plan = cheaper_plan(served, hw)
        assert plan is not None and plan.model.path.name == other
        assert "p50 x cores 4 ms, against 10 ms" in plan.why
        governor = ThermalGovernor(
            ThermalConfig(), lambda: {"cls": served}, lambda: hw, lambda *a, **k: None
        )
        assert governor._cheaper(served).startswith("serving on onnxruntime:CPU")
        assert served.cooling == plan.why and answer(served) == other
        assert served.worker.standby.model.path.name == pick  # kept for the way back
        assert served.recover(hw) is None  # a cooling model is not "recovered" meanwhile
        assert "back to the pick" in governor._restore(served)
        assert served.cooling == "" and answer(served) == pick and not served.worker.degraded
    finally:
        served.worker.stop(1.0)
