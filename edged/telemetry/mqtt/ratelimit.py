"""Rate limits for what the fleet sends: a token bucket per command kind, and one warning per
window for what they drop.

A broker-side flood (a looping script, a retained-message storm, someone with publish rights
to `cmd/#`) must cost the device a bounded amount of work, log and spool, whatever it sends.
Each kind has its own bucket, so a flood of unknown commands never starves `cmd/audit` of
its answers. What a bucket refuses is dropped unread and only counted: per drop, neither a
log line nor an event (each event is an fsync'd spool write), but one warning per window: at
the first drop, and then at the first drop after the window closed, with how many that
window dropped (the counts are in the publisher's stats at any time).

Hand-written rather than a library: a dozen lines over time.monotonic(), and the libraries
(limits, pyrate-limiter) bring storage backends and threads this needs none of.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping


class TokenBucket:
    """`burst` at once, then `rate` per second (monotonic clock)."""

    def __init__(self, burst: int, rate: float) -> None:
        self.burst, self.rate = burst, rate
        self.tokens = float(burst)
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class KindLimits:
    """One bucket per kind in `limits` ({kind: (burst, per second)}); `admit` answers whether
    one more of a kind may be handled now, and counts and reports what is dropped."""

    def __init__(
        self,
        limits: Mapping[str, tuple[int, float]],
        window_s: float,
        log: logging.Logger,
        what: str,
    ) -> None:
        self.limits = dict(limits)
        self._buckets = {kind: TokenBucket(*limit) for kind, limit in self.limits.items()}
        self._window_s = window_s
        self._log = log
        self._what = what  # "MQTT commands": how the warning names what it dropped
        self._window_ends = -1.0  # monotonic; no window open yet
        self._window: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # every drop since start, per kind

    def admit(self, kind: str) -> bool:
        """True when `kind` (a key of the limits) has a token; else the drop is counted."""
        if self._buckets[kind].take():
            return True
        self.dropped[kind] += 1
        now = time.monotonic()
        if now >= self._window_ends:
            self._report(now, first=kind)
        self._window[kind] += 1
        return False

    def _report(self, now: float, first: str) -> None:
        """One line per window: the limit met, and what the window before it dropped."""
        before = ", ".join(f"{n} {kind}" for kind, n in sorted(self._window.items()))
        burst, rate = self.limits[first]
        self._log.warning(
            "%s over their rate limit (%s: a burst of %d, then %g a second): dropped unread "
            "and unanswered, only counted%s; the next report at the first drop after %.0f s",
            self._what,
            first,
            burst,
            rate,
            f" (the previous {self._window_s:.0f} s window dropped {before})" if before else "",
            self._window_s,
        )
        self._window.clear()
        self._window_ends = now + self._window_s
