"""Runs the real `edged` process for tests: config in a temp folder, a real sd_notify datagram
socket, the port read back from the daemon's own log line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class NotifySocket:
    """The systemd side of sd_notify: a datagram socket read by a thread, as systemd would
    (a manager that stops reading must not be what the tests measure)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_for(self, field: str, timeout: float = 120.0, after: int = 0) -> str:
        """Wait for a datagram containing line `field` (e.g. "READY=1"), past index `after`."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.messages[after:]:
                if field in message.split("\n"):
                    return message
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {field} in {self.messages[-20:]}")
            time.sleep(0.02)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self.sock.close()


class Daemon:
    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.log_path = config.with_suffix(".log")
        self.notify = NotifySocket(config.parent / "notify.sock")
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify.path), **(env or {})}
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "edged.daemon", "--config",
                                      str(config)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=REPO)
        self.port: int | None = None

    def wait_ready(self, timeout: float = 180.0) -> Daemon:
        try:
            self.notify.wait_for("READY=1", timeout)
        except TimeoutError:
            raise AssertionError(f"daemon not ready; log:\n{self.log_text()}") from None
        match = re.search(r"on http://127\.0\.0\.1:(\d+)", self.log_text())
        self.port = int(match.group(1)) if match else None
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()
            self.notify.close()


def write_config(folder: Path, models: str, server_extra: str = "",
                 state_dir: Path | None = None) -> Path:
    config = folder / "edged.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:0"
socket = "{folder / 'edged.sock'}"
state_dir = "{state_dir or folder / 'state'}"
log_level = "info"
{server_extra}

[selection]
runs = 10
warmup = 1
time_budget_s = 1.0

{models}
""")
    return config
