"""sd_notify(3) spoken directly: one datagram per state change to $NOTIFY_SOCKET.

Written by hand: the protocol is a single sendto() of "KEY=VALUE" lines, and the libraries
that wrap it (systemd-python, sdnotify) need libsystemd headers or add nothing.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: a leading NUL byte on Linux.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the event loop: a full receive queue (a manager that stopped
            # reading) drops the message instead of stalling every request.
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> bool:
        """Send e.g. notify("READY=1", "STATUS=serving 2 models"); False when not under
        systemd or the socket is gone (never raises: notification is best effort)."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError:  # BlockingIOError included: dropped, see __init__
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s() -> float | None:
    """Half of WATCHDOG_USEC (systemd's advice), when the watchdog is meant for this PID."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
