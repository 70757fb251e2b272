"""A model loaded and stopped again and again (repository load/unload, reload) leaves nothing
behind for the garbage collector: every object of a served model is freed by reference counts
when it is dropped. Garbage in reference cycles waits for the collector's oldest generation,
tens of seconds on a busy daemon; with native buffers in it (hdrh's 139 KB counts arrays),
the heap's high-water mark crept up with every load (the soak's RSS growth)."""

from __future__ import annotations

import collections
import gc
from pathlib import Path

from backends import probe_hardware
from edged.config import BatchingConfig
from edged.selection.policy import Policy
from edged.serving.model_set import stop_workers
from edged.serving.models import load_model

FAST = Policy(runs=10, warmup=1, time_budget_s=1.0, threads=1, shapes={"x": (1, 3, 48, 192)})
CYCLES = 3


def test_load_and_stop_leave_no_reference_cycles(models_dir: Path, tmp_path: Path) -> None:
    hw = probe_hardware()

    def cycle() -> None:
        served = load_model(
            "cls", models_dir / "ppocr_cls.onnx", FAST, BatchingConfig(), hw, tmp_path / "state"
        )
        stop_workers([served], 1.0)

    cycle()  # the first load imports and caches what a process keeps for its life
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(CYCLES):
            cycle()
        gc.collect()
        kinds = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    per_cycle = {kind: n for kind, n in kinds.items() if n >= CYCLES}
    assert not per_cycle, f"each load/stop left objects in reference cycles: {per_cycle}"
