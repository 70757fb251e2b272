"""One model's step on the thermal ladder, from the device's headroom: up at once when the
headroom reaches a step's threshold (several steps at once if it jumped), down one step at a
time once the headroom has stayed `hysteresis` below that step's threshold for `hold_s`, so
a temperature hovering at a threshold does not flap between two steps."""

from __future__ import annotations

from collections.abc import Sequence

STEPS = ("normal", "cheaper", "limit", "shed")


class Ladder:
    def __init__(self, thresholds: Sequence[float], hysteresis: float, hold_s: float) -> None:
        if list(thresholds) != sorted(thresholds) or len(thresholds) != len(STEPS) - 1:
            raise ValueError(f"thresholds must be {len(STEPS) - 1} rising values: {thresholds}")
        self.thresholds = tuple(thresholds)
        self.hysteresis = hysteresis
        self.hold_s = hold_s
        self.step = 0
        self._cool_since: float | None = None

    @property
    def name(self) -> str:
        return STEPS[self.step]

    def update(self, headroom: float | None, now: float) -> int | None:
        """The new step when it changes, else None. An unknown headroom changes nothing."""
        if headroom is None:
            return None
        reached = sum(headroom >= t for t in self.thresholds)
        if reached > self.step:
            self.step, self._cool_since = reached, None
            return self.step
        if self.step and headroom < self.thresholds[self.step - 1] - self.hysteresis:
            if self._cool_since is None:
                self._cool_since = now
            if now - self._cool_since >= self.hold_s:
                self.step -= 1
                self._cool_since = now  # the next step down waits its own hold
                return self.step
            return None
        self._cool_since = None
        return None
