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


def python_argv() -> list[str]:
    """How to start this Python in a child process: in the isa-avx2 lane through the same
    emulator (EDGED_ISA_QEMU, set by `make test-isa-avx2`), since qemu-user does not follow
    exec and the child would otherwise run on the host's CPU."""
    return [*os.environ.get("EDGED_ISA_QEMU", "").split(), sys.executable]


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
        self.path.unlink(missing_ok=True)  # a restarted daemon binds it anew


# The one stand-in at the backend boundary for the real daemon process: onnxruntime's
# session run sleeps EDGED_TEST_HANG_S seconds when the first input value is HANG_MARK (a
# runtime that stops answering, as an NPU driver can), then runs for real. Everything else
# (the daemon, its engine, uvicorn, sd_notify) is the real code.
HANG_MARK = 12345.0
HANG_PRELUDE = f"""
import os, time
from backends.onnxruntime_backend import OrtSession
_run = OrtSession.run
def run(self, feeds):
    if any(v.size and float(v.flat[0]) == {HANG_MARK!r} for v in feeds.values()):
        time.sleep(float(os.environ["EDGED_TEST_HANG_S"]))
    return _run(self, feeds)
OrtSession.run = run
from edged.daemon import main
raise SystemExit(main())
"""


class Daemon:
    def __init__(self, config: Path, env: dict[str, str] | None = None,
                 hang_s: float | None = None) -> None:
        """`hang_s`: run the daemon with HANG_PRELUDE, onnxruntime hanging that long on a
        request whose first value is HANG_MARK."""
        self.config = config
        self.log_path = config.with_suffix(".log")
        self.notify = NotifySocket(config.parent / "notify.sock")
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify.path), **(env or {})}
        start = ["-m", "edged.daemon"]
        if hang_s is not None:
            full_env["EDGED_TEST_HANG_S"] = str(hang_s)
            start = ["-c", HANG_PRELUDE]
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen([*python_argv(), *start, "--config", str(config)],
                                     stdout=self.log, stderr=subprocess.STDOUT,
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
        if not self.log.closed:  # also readable after stop()
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
