"""The [thermal] table (edged.thermal's settings), checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edged.config.checks import Checker, Table, show
from edged.thermal.settings import MODES as THERMAL_MODES
from edged.thermal.settings import ThermalConfig


def thermal(check: Checker, data: Mapping[str, Any]) -> ThermalConfig:
    """[thermal]: thermal admission (edged.thermal): the zones watched and the ladder's steps,
    which must rise: cheaper_at <= limit_at <= shed_at."""
    t = Table(check, data, "thermal", ThermalConfig)
    admission = t.string("admission")
    if admission not in THERMAL_MODES:
        raise check.fail(
            "thermal.admission",
            f"expected one of {', '.join(THERMAL_MODES)}, got {show(admission)}",
        )
    zones = t.get("zones")
    if not isinstance(zones, list | tuple) or not all(isinstance(z, str) and z for z in zones):
        raise check.fail("thermal.zones", "must be a list of zone types (shell patterns)")
    defaults = ThermalConfig()
    root = check.path(t.string("root"), "thermal.root") if "root" in t else defaults.root
    if not root.is_dir():
        raise check.fail("thermal.root", f"no such folder: {root}")
    cheaper, limit, shed = steps = [
        t.number(key, lambda v: 0 < v <= 2, "a headroom in (0, 2] (1.0: at the trip)")
        for key in ("cheaper_at", "limit_at", "shed_at")
    ]
    if steps != sorted(steps):
        raise check.fail(
            "thermal",
            f"cheaper_at ({steps[0]:g}), limit_at ({steps[1]:g}) and shed_at ({steps[2]:g}) "
            "must rise in that order",
        )
    return ThermalConfig(
        admission,
        tuple(zones),
        t.number("band_c", lambda v: 1 <= v <= 100, "degrees Celsius in [1, 100]"),
        t.number("interval_s", lambda v: 0.1 <= v <= 60, "seconds in [0.1, 60]"),
        cheaper,
        limit,
        shed,
        t.number("limit_share", lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
        t.number("hysteresis", lambda v: 0 <= v <= 1, "a headroom in [0, 1]"),
        t.number("hold_s", lambda v: 0 <= v <= 3600, "seconds in [0, 3600]"),
        t.integer("retry_after_s", 1, 3600),
        root,
    )
