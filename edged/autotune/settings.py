"""[tuning]: whether the daemon's tuning loop reports or applies what answers its latency
outliers, and how it judges a change (edged.autotune.loop)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES = ("off", "propose", "apply")


@dataclass(frozen=True)
class TuningConfig:
    # off: nothing; propose: rank the causes and report the best change (MQTT event "tuning",
    # log, status, `edgectl tune`); apply: also apply it, verify it, keep it or revert it.
    auto: str = "off"
    # Telemetry windows of evidence before a proposal, and of verification after a change
    # (the same count, so before and after are compared like for like). At least 3: the
    # verdict's rank test cannot reach p <= 0.05 with fewer.
    windows: int = 5
    # Windows skipped after a change before verifying (caches refill, a moved thread settles).
    settle_windows: int = 1
    # At most this many changes applied in any hour (kept or reverted).
    max_changes_per_hour: int = 4
    # A cause must be among the outliers of at least this share of the evidence windows.
    min_window_share: float = 0.5
    # "Got worse": the after windows' median p50 or p99 above the before ones' by more than
    # this fraction.
    worse_tolerance: float = 0.10
    # The processes (by name, shell-style patterns: "ffmpeg*") whose threads the loop may move
    # off the inference cores. Default: any (never edged's own, never a kernel thread).
    movable: tuple[str, ...] = ("*",)
    # The system the loop changes: "/" (the device), or a test's / an image's root.
    root: Path = Path("/")
    # The journal's folder on that system: edged-tune's own (root-only), so `edgectl revert`
    # restores the loop's changes with the rest. Under another root: /var/lib/edged in it.
    state_dir: Path = Path("/var/lib/edged-tune")
