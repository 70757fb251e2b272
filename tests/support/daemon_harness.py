"""Runs the real `edged` process for tests: config in a temp folder, a real sd_notify datagram
socket, the port read back from the daemon's own log line; and the plain HTTP requests the
serving-fault tests send it (binary tensor bodies, status polls, its peak RSS)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from tests.support import REPO


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
    def __init__(
        self,
        config: Path,
        env: dict[str, str] | None = None,
        hang_s: float | None = None,
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ) -> None:
        """`hang_s`: run the daemon with HANG_PRELUDE, onnxruntime hanging that long on a
        request whose first value is HANG_MARK. `prefix`: a command the daemon runs under
        (`unshare --net`: no network)."""
        self.config = config
        self.log_path = config.with_suffix(".log")
        self.notify = NotifySocket(config.parent / "notify.sock")
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify.path), **(env or {})}
        start = ["-m", "edged.daemon"]
        if hang_s is not None:
            full_env["EDGED_TEST_HANG_S"] = str(hang_s)
            start = ["-c", HANG_PRELUDE]
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [*prefix, *python_argv(), *start, "--config", str(config), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
        )
        self.port: int | None = None

    def wait_ready(self, timeout: float = 180.0) -> Daemon:
        deadline = time.monotonic() + timeout
        while True:  # in short waits: a daemon that exits is not waited for
            try:
                self.notify.wait_for("READY=1", min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except TimeoutError:
                if self.proc.poll() is not None or time.monotonic() >= deadline:
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
        """SIGTERM and the exit status; a daemon that has not exited after `timeout` fails
        the test (TimeoutExpired) and is killed with its children, so none outlives it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            self.proc.wait(10)
            raise
        finally:
            self.log.close()
            self.notify.close()


def write_config(
    folder: Path, models: str, server_extra: str = "", state_dir: Path | None = None
) -> Path:
    config = folder / "edged.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:0"
socket = "{folder / "edged.sock"}"
state_dir = "{state_dir or folder / "state"}"
log_level = "info"
{server_extra}

[selection]
runs = 10
warmup = 1
time_budget_s = 1.0

{models}
""")
    return config


# -- requests to a running daemon -------------------------------------------------------------


def cls_table(models_dir: Path, **settings) -> str:
    """A [[models]] table for the PP-OCR cls model on onnxruntime at its served shape, one
    thread, with `settings` (TOML values as Python: ints, strings) after it."""
    extra = "".join(
        f"{key} = {value if isinstance(value, int) else chr(34) + str(value) + chr(34)}\n"
        for key, value in settings.items()
    )
    return f"""
[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
backend = "onnxruntime"
threads = 1
shapes = {{ x = [1, 3, 48, 192] }}
{extra}"""


def binary_request(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """An infer body for input "x" with the tensor as binary data (no JSON decoding)."""
    data = x.tobytes()
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    return head + data, {"Inference-Header-Content-Length": str(len(head))}


CLS_BODY = binary_request(np.zeros((1, 3, 48, 192), np.float32))  # the PP-OCR cls model's


def post(
    conn: http.client.HTTPConnection, model: str, request: tuple[bytes, dict[str, str]]
) -> tuple[int, bytes]:
    body, headers = request
    conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
    response = conn.getresponse()
    return response.status, response.read()


def get(daemon: Daemon, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_idle(daemon: Daemon, model: str, timeout: float = 60) -> None:
    """Until the model's queue is empty (its requests answered or dropped)."""
    deadline = time.monotonic() + timeout
    while True:
        status = json.loads(get(daemon, "/edged/status")[1])
        [entry] = [m for m in status["models"] if m["name"] == model]
        if entry["queue_depth"] == 0:
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


class PeakRss:
    """The daemon's peak RSS while the block runs, sampled every 2 ms (psutil)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# -- the cls model, as the serving tests use it ------------------------------------------------

OUT = "save_infer_model/scale_0.tmp_1"  # the cls model's output


def cls_input(seed: int = 0) -> np.ndarray:
    from edged.selection.inputs import text_like_images

    grey = next(text_like_images(48, 192, 1, seed))
    return np.repeat(grey[None, None], 3, axis=1).astype(np.float32) * 2 - 1


def grpc_port(daemon: Daemon) -> int:
    match = re.search(r"GRPCInferenceService\) on 127\.0\.0\.1:(\d+), unix:", daemon.log_text())
    assert match, daemon.log_text()
    return int(match.group(1))
