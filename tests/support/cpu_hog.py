"""A CPU hog pinned to one core, and a steady client of a served model: the intruder and the
load of the tests that put preemption on an inference core."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np

HOG_NAME = "edged-test-hog"
# The tuning loop's tests pin this many on the inference core: the worker keeps a fifth of
# it, so the move stands out of a CI machine's noise (its other test workers land on that
# core too, and stay there).
HOGS = 4


def start_hog(cpu: int, seconds: float = 60.0) -> subprocess.Popen:
    """A busy loop pinned to `cpu`, named edged-test-hog (prctl, so ps and the scan say so),
    ending by itself after `seconds`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"{HOG_NAME}", 0, 0, 0)
os.sched_setaffinity(0, {{{cpu}}})
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    pass
""",
        ]
    )


def steady_client(model, seconds: float, hz: float = 50.0, until=None) -> int:
    """Requests to `model`'s worker at `hz`, each awaited, for `seconds` (or until `until()`
    is true); returns how many were sent."""
    feeds = {"x": np.zeros((1, 3, 48, 192), np.float32)}
    next_at = time.monotonic()
    deadline = next_at + seconds
    sent = 0
    while time.monotonic() < deadline and not (until is not None and until()):
        done = threading.Event()
        model.worker.submit(feeds, lambda *a, done=done: done.set())
        done.wait(5)
        sent += 1
        next_at += 1 / hz
        time.sleep(max(0.0, next_at - time.monotonic()))
    return sent
