"""Energy per inference: the device's joules over a telemetry window (sysconf.energy), shared
among the models by the compute time each spent in it, divided by its inferences.

It includes the board's idle draw over the window (a board does not measure what one
inference costs apart from the rest), so it falls as the request rate rises: compare it
between backends or variants at the same rate. None where the board measures no energy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def per_inference_mj(models: Mapping[str, Mapping[str, Any]], joules: float | None) -> dict:
    """model -> millijoules per inference in this window (models with inferences only)."""
    if joules is None:
        return {}
    busy = {}
    for name, stats in models.items():
        compute = stats.get("compute") or {}
        count, mean = compute.get("count") or 0, compute.get("mean_ms")
        if count and mean is not None:
            busy[name] = (count, count * mean)
    total = sum(ms for _, ms in busy.values())
    if total <= 0:
        return {}
    return {
        name: round(joules * (ms / total) / count * 1e3, 6) for name, (count, ms) in busy.items()
    }
