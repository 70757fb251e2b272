"""Hostile and careless HTTP clients against the real edged process (issue 16): idle
connections, stalled uploads, huge headers, huge JSON bodies, and SIGTERM while such
connections are open. Timeouts are small in the config so the tests are quick; all traffic
goes to 127.0.0.1 or the daemon's Unix socket, and every loop is bounded."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.daemon_harness import (
    CLS_BODY,
    Daemon,
    PeakRss,
    binary_request,
    post,
    wait_idle,
    write_config,
)

MAX_CONNECTIONS = 6
SOCKET_MAX_CONNECTIONS = 3
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
IDLE_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 16 * 1024
DECODE_BUDGET = 512 * 2**20
DET = 960  # 1x3x960x960: 2.76 M values, ≈56 MB as JSON
GET_LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: edged\r\n\r\n"
# The real daemon. The wall-clock bounds (tests marked timing) are loose for a loaded 2-core
# CI machine and still far from the failures they guard against ("before").
pytestmark = pytest.mark.integration


def models_toml(models_dir: Path) -> str:
    return f"""
[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
threads = 1
shapes = {{ x = [1, 3, 48, 192] }}
max_queue_size = 2
timeout_ms = 20000

[[models]]
name = "det"
path = "{models_dir / "ppocrv4_det.onnx"}"
threads = 1
shapes = {{ x = [1, 3, {DET}, {DET}] }}
timeout_ms = 60000
"""


SERVER = f"""
max_connections = {MAX_CONNECTIONS}
socket_max_connections = {SOCKET_MAX_CONNECTIONS}
header_timeout_s = {HEADER_TIMEOUT_S}
body_timeout_s = {BODY_TIMEOUT_S}
idle_timeout_s = {IDLE_TIMEOUT_S}
max_header_bytes = {MAX_HEADER_BYTES}
max_decode_bytes = {DECODE_BUDGET}
"""


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("hostile")
    d = Daemon(write_config(folder, models_toml(models_dir), server_extra=SERVER)).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()
    assert "Traceback" not in d.log_text(), d.log_text()


def unix_path(d: Daemon) -> str:
    return str(d.config.parent / "edged.sock")


def connect(d: Daemon, unix: bool = False, timeout: float = 10.0) -> socket.socket:
    if unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(unix_path(d))
        return sock
    return socket.create_connection(("127.0.0.1", d.port), timeout=timeout)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response from a raw socket: status, headers, body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def exchange(d: Daemon, request: bytes, unix: bool = False) -> tuple[int, bytes, float]:
    """Send `request` on a new connection; (status, body, seconds to the answer)."""
    start = time.monotonic()
    with connect(d, unix) as sock:
        # Answered and closed before all of it went out: the answer is what counts.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        status, _, body = read_response(sock)
    return status, body, time.monotonic() - start


def status_of(d: Daemon) -> dict:
    return json.loads(
        exchange(
            d, b"GET /edged/status HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n", unix=True
        )[1]
    )


def model_status(d: Daemon, name: str) -> dict:
    [entry] = [m for m in status_of(d)["models"] if m["name"] == name]
    return entry


def metrics_text(d: Daemon) -> str:
    return exchange(d, b"GET /metrics HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n", unix=True)[
        1
    ].decode()


class Prober:
    """Another client, on its own kept-alive connection, timing its requests until stopped
    (bounded: it stops by itself after `limit_s`)."""

    def __init__(self, d: Daemon, request, limit_s: float = 120.0) -> None:
        self.d, self.request, self.limit_s = d, request, limit_s
        self.latencies: list[float] = []
        self.codes: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        end = time.monotonic() + self.limit_s
        try:
            conn = http.client.HTTPConnection(self.d.address, timeout=30)
            while not self._stop.is_set() and time.monotonic() < end:
                start = time.perf_counter()
                code = self.request(conn)
                self.latencies.append(time.perf_counter() - start)
                self.codes.append(code)
                time.sleep(0.005)
            conn.close()
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def get_live(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/v2/health/live")
    response = conn.getresponse()
    response.read()
    return response.status


def infer_cls(conn: http.client.HTTPConnection) -> int:
    return post(conn, "cls", CLS_BODY)[0]


# -- connections ---------------------------------------------------------------------------
@pytest.mark.timing
def test_idle_connections_lock_nobody_out(daemon: Daemon) -> None:
    """max_connections TCP connections that send nothing: one more TCP client gets a JSON 503
    at once (not uvicorn's plain text), a Unix-socket client is served at once (its own
    budget), and once the header timeout closes the idle ones TCP serves again. Before:
    every client got 503, on both listeners, for as long as the idle ones stayed open."""
    opened = time.monotonic()
    idle = [connect(daemon) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # accepted by the daemon
        status, body, took = exchange(daemon, GET_LIVE)
        assert status == 503 and took < 5.0, (status, body)  # before: never
        assert "[server] max_connections" in json.loads(body)["error"]
        status, body, took = exchange(daemon, GET_LIVE, unix=True)
        assert (status, body) == (200, b'{"live":true}') and took < 5.0
        deadline = opened + HEADER_TIMEOUT_S + 3.0
        while True:
            status, body, _ = exchange(daemon, GET_LIVE)
            if status == 200:
                break
            assert time.monotonic() < deadline, "idle connections still hold the budget"
            time.sleep(0.05)
        served_after = time.monotonic() - opened
        for sock in idle:  # the daemon closed them: end of stream, no answer to nothing
            sock.settimeout(2.0)
            assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
    print(
        f"TCP served again {served_after:.2f} s after {MAX_CONNECTIONS} idle connections "
        f"opened (header timeout {HEADER_TIMEOUT_S} s)"
    )
    assert served_after < HEADER_TIMEOUT_S + 2.5


def test_unix_socket_budget_is_its_own(daemon: Daemon) -> None:
    held = [connect(daemon, unix=True) for _ in range(SOCKET_MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        status, body, _ = exchange(daemon, GET_LIVE, unix=True)
        assert status == 503
        assert "[server] socket_max_connections" in json.loads(body)["error"]
        assert exchange(daemon, GET_LIVE)[0] == 200  # TCP is not affected
    finally:
        for sock in held:
            sock.close()


@pytest.mark.timing
def test_kept_alive_connection_idle_past_idle_timeout_is_closed(daemon: Daemon) -> None:
    with connect(daemon) as sock:
        for _ in range(2):
            sock.sendall(GET_LIVE)
            assert read_response(sock)[0] == 200
        start = time.monotonic()
        sock.settimeout(IDLE_TIMEOUT_S + 3.0)
        assert sock.recv(1) == b""  # closed by the daemon, without an answer
    assert IDLE_TIMEOUT_S - 0.1 < time.monotonic() - start < IDLE_TIMEOUT_S + 2.5


# -- stalled bodies ------------------------------------------------------------------------
@pytest.mark.timing
def test_stalled_uploads_show_in_queue_depth_and_time_out(daemon: Daemon) -> None:
    """Three uploads that stop after 100 bytes of their body fill cls's room (2 waiting + 1
    running): queue_depth says 3 (it said 0 while "queue full" was answered), and after the
    body timeout each gets 408 and its slot is free again."""
    body, headers = CLS_BODY
    head = (
        f"POST /v2/models/cls/infer HTTP/1.1\r\nHost: edged\r\n"
        f"Content-Length: {len(body)}\r\nInference-Header-Content-Length: "
        f"{headers['Inference-Header-Content-Length']}\r\n\r\n"
    ).encode()
    stalled = []
    try:
        for _ in range(3):
            sock = connect(daemon)
            sock.sendall(head + body[:100])
            stalled.append(sock)
        sent = time.monotonic()
        deadline = sent + 1.0
        while model_status(daemon, "cls")["queue_depth"] != 3:
            assert time.monotonic() < deadline, model_status(daemon, "cls")
            time.sleep(0.02)
        assert re.search(r'edged_queue_depth\{model="cls"\} 3\.0', metrics_text(daemon))
        conn = http.client.HTTPConnection(daemon.address, timeout=10)
        code, answer = post(conn, "cls", CLS_BODY)
        conn.close()
        assert code == 503 and "queue full" in json.loads(answer)["error"]
        for sock in stalled:
            status, _, answer = read_response(sock)
            assert status == 408, answer
            assert "[server] body_timeout_s" in json.loads(answer)["error"]
        waited = time.monotonic() - sent
        assert BODY_TIMEOUT_S - 0.1 < waited < BODY_TIMEOUT_S + 2.5, waited
    finally:
        for sock in stalled:
            sock.close()
    wait_idle(daemon, "cls", timeout=2)
    conn = http.client.HTTPConnection(daemon.address, timeout=10)
    assert post(conn, "cls", CLS_BODY)[0] == 200
    conn.close()
    count = re.search(r'edged_requests_total\{code="408",model="cls"\} (\S+)', metrics_text(daemon))
    assert count and float(count.group(1)) >= 3


@pytest.mark.timing
def test_partial_headers_get_408_after_the_header_timeout(daemon: Daemon) -> None:
    start = time.monotonic()
    with connect(daemon) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: ed")
        status, _, body = read_response(sock)
    took = time.monotonic() - start
    assert status == 408 and "[server] header_timeout_s" in json.loads(body)["error"]
    assert HEADER_TIMEOUT_S - 0.1 < took < HEADER_TIMEOUT_S + 2.5


# -- huge headers --------------------------------------------------------------------------
@pytest.mark.timing
def test_huge_header_gets_431_at_once(daemon: Daemon) -> None:
    """An 8 MiB header: 431 with a JSON error, quickly, and another client is not held up.
    Before: httptools joined its pieces on the event loop (quadratic; 96 MB took 16.6 s)."""
    request = GET_LIVE[:-2] + b"X-Big: " + b"a" * (8 * 2**20) + b"\r\n\r\n"
    with Prober(daemon, get_live) as other:
        time.sleep(0.1)
        status, body, took = exchange(daemon, request)
        time.sleep(0.1)
    assert status == 431, body
    assert json.loads(body)["error"] == (
        f"request line and headers are over the limit of "
        f"{MAX_HEADER_BYTES} bytes ([server] max_header_bytes)"
    )
    assert not other.errors and set(other.codes) == {200}
    print(
        f"431 after {took * 1e3:.0f} ms; other client max {max(other.latencies) * 1e3:.1f} "
        f"ms over {len(other.latencies)}"
    )
    assert took < 3.0
    assert max(other.latencies) < 3.0  # before: up to 10 s (loose: a shared CI VM)
    # A normal-sized head on the same listener is still served.
    assert exchange(daemon, GET_LIVE)[0] == 200


# -- large JSON ----------------------------------------------------------------------------
def json_request(shape: tuple[int, ...], values: np.ndarray | None = None) -> bytes:
    count = int(np.prod(shape))
    data = values.ravel().tolist() if values is not None else [0] * count
    return json.dumps(
        {"inputs": [{"name": "x", "shape": list(shape), "datatype": "FP32", "data": data}]}
    ).encode()


@pytest.mark.timing
def test_large_json_is_decoded_off_the_event_loop(daemon: Daemon) -> None:
    """Three ≈56 MB JSON requests at once (and their 17 MB JSON answers): other clients are
    answered meanwhile (a health check, a small inference). Before: each was decoded and
    encoded on the event loop, and every client waited for them."""
    x = np.random.default_rng(0).random((1, 3, DET, DET), dtype=np.float32)
    big = json_request(x.shape, x)
    results: list[tuple[int, bytes]] = []

    def send_big() -> None:
        conn = http.client.HTTPConnection(daemon.address, timeout=120)
        results.append(post(conn, "det", (big, {})))
        conn.close()

    senders = [threading.Thread(target=send_big) for _ in range(3)]
    with Prober(daemon, get_live) as live, Prober(daemon, infer_cls) as small:
        time.sleep(0.1)
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join()
    assert not live.errors and not small.errors
    assert [code for code, _ in results] == [200] * 3, [b[:200] for _, b in results]
    assert set(live.codes) == {200} and set(small.codes) == {200}
    print(
        f"{len(big) / 1e6:.0f} MB JSON x3: health check max {max(live.latencies) * 1e3:.0f} "
        f"ms over {len(live.latencies)}, small inference max "
        f"{max(small.latencies) * 1e3:.0f} ms over {len(small.latencies)}"
    )
    # Measured: 0.1 s / 0.13 s here; 0.93 s / 1.9 s with the decode on the event loop.
    # Just under the figures before: the loosest bounds that still tell the two apart.
    assert max(live.latencies) < 0.9  # before: 0.93 s (loose: a shared CI VM)
    assert max(small.latencies) < 1.8  # before: 1.9 s


@pytest.mark.timing
def test_json_over_the_decode_budget_is_413_before_decoding(daemon: Daemon) -> None:
    """11 M values (22 MB of "0,"): decoded they would take ≈0.6 GB; refused with 413 naming
    the limit, at once, and the daemon's memory grows by little more than the body."""
    body = json_request((1, 3, 1920, 1920))
    with PeakRss(daemon.proc.pid) as rss:
        base = rss.proc.memory_info().rss
        conn = http.client.HTTPConnection(daemon.address, timeout=60)
        start = time.monotonic()
        code, answer = post(conn, "det", (body, {}))
        took = time.monotonic() - start
        conn.close()
    assert code == 413, answer[:300]
    error = json.loads(answer)["error"]
    assert "over the limit of 512 MiB ([server] max_decode_bytes)" in error, error
    assert "binary" in error
    grown = (rss.peak - base) / 2**20
    print(
        f"413 after {took * 1e3:.0f} ms, peak RSS +{grown:.0f} MiB for a "
        f"{len(body) / 2**20:.0f} MiB body"
    )
    assert grown < len(body) / 2**20 + 64
    assert took < 4.0


# -- shutdown ------------------------------------------------------------------------------
@pytest.mark.timing
def test_sigterm_with_idle_and_stalled_connections_exits_promptly(
    models_dir: Path, tmp_path: Path
) -> None:
    """Kept-alive idle connections (TCP and Unix), one that never sent a byte, one with half
    a head and one upload stalled mid-body, with the default timeouts (10 s head, 30 s
    body): SIGTERM exits 0 within a few seconds, without a traceback. Before: the drain
    waited its whole 10 s for the stalled upload and then logged the cancelled handler."""
    d = Daemon(write_config(tmp_path, models_toml(models_dir))).wait_ready()
    held: list = []
    try:
        for unix in (False, True):  # kept alive after one request
            sock = connect(d, unix)
            sock.sendall(GET_LIVE)
            assert read_response(sock)[0] == 200
            held.append(sock)
        held.append(connect(d))  # silent
        sock = connect(d)
        sock.sendall(b"GET /v2/health/li")
        held.append(sock)
        body, headers = CLS_BODY
        stalled = connect(d)
        stalled.sendall(
            (
                f"POST /v2/models/cls/infer HTTP/1.1\r\nHost: e\r\nContent-Length: "
                f"{len(body)}\r\nInference-Header-Content-Length: "
                f"{headers['Inference-Header-Content-Length']}\r\n\r\n"
            ).encode()
            + body[:100]
        )
        held.append(stalled)
        time.sleep(0.3)
        start = time.monotonic()
        d.signal(signal.SIGTERM)
        code = d.proc.wait(30)
        took = time.monotonic() - start
        try:
            status = read_response(stalled)[0]
        except (ConnectionError, OSError):
            status = None  # closed: as good an answer while stopping
        assert status in (408, None)
    finally:
        for sock in held:
            sock.close()
        d.stop()
    log = d.log_text()
    print(f"SIGTERM to exit: {took:.2f} s")
    assert code == 0, log
    assert "Traceback" not in log and "Cancel" not in log, log
    assert took < 8.0, log  # before: the whole 10 s drain


def test_binary_request_still_served(daemon: Daemon) -> None:
    """The common path is untouched: a binary request whose body arrives with its head."""
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    x = np.zeros((1, 3, 48, 192), np.float32)
    for _ in range(3):  # kept alive
        assert post(conn, "cls", binary_request(x))[0] == 200
    conn.close()
