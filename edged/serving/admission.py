"""A model's admission gate: open, limited to a rate, or shut, set from outside the request
path (edged.thermal's governor) and asked by the worker before a request is admitted
(`ModelWorker.check_room`). A refused request is a 503 with Retry-After (gRPC UNAVAILABLE),
which Triton's clients and most HTTP clients treat as "try again later"."""

from __future__ import annotations

import threading
import time

from edged.serving.requests import EngineError

MODES = ("open", "limit", "shut")


class Throttled(EngineError):
    status = 503

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after_s


class Gate:
    """A token bucket of `rate` requests a second (a burst of one second's worth) in "limit",
    every request in "open", none in "shut". `admitted` counts what passed (the governor
    reads the rate a model had before it was limited from it)."""

    def __init__(self, name: str, retry_after_s: int = 5) -> None:
        self.name = name
        self.retry_after_s = retry_after_s
        self.mode = "open"
        self.rate = 0.0
        self.reason = ""
        self.admitted = 0
        self.refused = 0
        self._tokens = 0.0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def set(self, mode: str, reason: str = "", rate: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"gate mode {mode!r} not in {MODES}")
        with self._lock:
            self.mode, self.reason, self.rate = mode, reason, rate
            self._tokens, self._last = max(rate, 1.0), time.monotonic()

    def check(self) -> None:
        """Admit one request, or raise Throttled."""
        mode = self.mode
        if mode == "open":
            self.admitted += 1
            return
        with self._lock:
            if self.mode == "limit":
                now = time.monotonic()
                burst = max(self.rate, 1.0)
                self._tokens = min(burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    self.admitted += 1
                    return
                what = f"limited to {self.rate:.3g} requests/s"
            elif self.mode == "open":
                self.admitted += 1
                return
            else:
                what = "refusing requests"
            self.refused += 1
        raise Throttled(
            f"{self.name}: {what} while the device cools ({self.reason})", self.retry_after_s
        )

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "rate": self.rate if self.mode == "limit" else None,
            "reason": self.reason or None,
            "refused": self.refused,
        }
