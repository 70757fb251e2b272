"""Accelerator hot-plug: a pyudev netlink monitor on the subsystems accelerators live in.

The monitor only says "something there changed"; the daemon then re-probes the hardware and
compares fingerprints, so a keyboard plugged into USB costs one probe and nothing else. Events
are debounced: a USB Coral re-enumerates (1a6e:089a -> 18d1:9302) in one burst.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from backends import device_nodes
from sysconf.hardware import ACCELERATOR_SUBSYSTEMS

log = logging.getLogger("edged.hotplug")

# Character devices of vendor NPU drivers (galcore, ethosu, hailo) appear under "misc" or
# their own class, which the backend declaring the node names; "misc" is cheap to include
# (rare events) and the probe decides what they are.
WATCHED_SUBSYSTEMS = tuple(
    dict.fromkeys(
        [*ACCELERATOR_SUBSYSTEMS, "misc", *(n.subsystem for n in device_nodes() if n.subsystem)]
    )
)


class AcceleratorMonitor:
    def __init__(self, on_change: Callable[[str, str], None], debounce_s: float = 0.5) -> None:
        """`on_change(action, device_path)` is called from the monitor's thread, once per
        burst of events (the last one's action and path)."""
        self._on_change = on_change
        self._debounce_s = debounce_s
        self._observer = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._last: tuple[str, str] = ("", "")
        self.error: str | None = None

    def start(self) -> bool:
        """False (with `error` set) where netlink or libudev is not available, e.g. in a
        container without the capability: the daemon then runs without hot-plug."""
        try:
            import pyudev

            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context)
            for subsystem in WATCHED_SUBSYSTEMS:
                monitor.filter_by(subsystem)
            observer = pyudev.MonitorObserver(monitor, callback=self._event, name="edged-hotplug")
            observer.start()
            self._observer = observer
        except Exception as exc:  # ImportError, OSError from netlink, libudev missing
            self.error = f"{exc.__class__.__name__}: {exc}"
            log.warning("accelerator hot-plug disabled: %s", self.error)
            return False
        return True

    @property
    def running(self) -> bool:
        return self._observer is not None and self._observer.is_alive()

    def _event(self, device) -> None:
        with self._lock:
            self._last = (device.action or "change", device.sys_path)
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self._debounce_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            action, path = self._last
            self._timer = None
        log.info("device %s: %s", action, path)
        self._on_change(action, path)

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.send_stop()
            self._observer = None
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
