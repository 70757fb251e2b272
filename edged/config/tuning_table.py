"""The [tuning] table (edged.autotune's settings), checked."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edged.autotune.settings import MODES as TUNING_MODES
from edged.autotune.settings import TuningConfig
from edged.config.checks import Checker, Table, show


def tuning(check: Checker, data: Mapping[str, Any]) -> TuningConfig:
    """[tuning]: the daemon's tuning loop (edged.autotune)."""
    t = Table(check, data, "tuning", TuningConfig)
    auto = t.string("auto")
    if auto not in TUNING_MODES:
        raise check.fail(
            "tuning.auto", f"expected one of {', '.join(TUNING_MODES)}, got {show(auto)}"
        )
    defaults = TuningConfig()
    root = check.path(t.string("root"), "tuning.root") if "root" in t else defaults.root
    if not root.is_dir():
        raise check.fail("tuning.root", f"no such folder: {root}")
    state_dir = defaults.state_dir
    if "state_dir" in t:
        state_dir = Path(t.string("state_dir"))
        if not state_dir.is_absolute():
            raise check.fail("tuning.state_dir", "must be an absolute path on the tuned system")
    share = t.number("min_window_share", lambda v: 0 < v <= 1, "a fraction in (0, 1]")
    movable = t.get("movable")
    if not isinstance(movable, list | tuple) or not all(isinstance(m, str) and m for m in movable):
        raise check.fail("tuning.movable", "must be a list of process-name patterns")
    return TuningConfig(
        auto,
        t.integer("windows", 3, 10),
        t.integer("settle_windows", 0, 10),
        t.integer("max_changes_per_hour", 1, 60),
        share,
        t.number("worse_tolerance", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
        tuple(movable),
        root,
        state_dir,
    )
