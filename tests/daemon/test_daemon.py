"""The real edged process: unmodified tritonclient, the Unix socket client, bad requests,
sd_notify on a real datagram socket, SIGHUP reload and SIGTERM drain."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from edged.client import Client, EdgedError
from tests.support import REPO
from tests.support.daemon_harness import Daemon, write_config

CLS = "[1, 3, 48, 192]"


def models_toml(models_dir: Path, queue: int = 64, extra: str = "") -> str:
    return f"""
[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
threads = 1
shapes = {{ x = {CLS} }}
max_batch_size = 4
max_queue_delay_us = 200
max_queue_size = {queue}

[[models]]
name = "face"
path = "{models_dir / "face_detection_short_range.tflite"}"
threads = 1
{extra}
"""


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("daemon")
    config = write_config(folder, models_toml(models_dir), server_extra="max_body_bytes = 1000000")
    d = Daemon(config, env={"WATCHDOG_USEC": "300000"}).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def cls_input(seed: int = 0) -> np.ndarray:
    from edged.selection.inputs import text_like_images

    grey = next(text_like_images(48, 192, 1, seed))
    return np.repeat(grey[None, None], 3, axis=1).astype(np.float32) * 2 - 1


@pytest.mark.integration
def test_the_date_header_is_current_though_the_server_never_ticks(daemon: Daemon) -> None:
    """The HTTP server's main loop has no timer (an idle daemon lets the core sleep): the
    Date header is made when a response asks for it."""
    import time
    from email.utils import parsedate_to_datetime

    dates = []
    for _ in range(2):
        conn = http.client.HTTPConnection(daemon.address, timeout=10)
        conn.request("GET", "/v2/health/ready")
        response = conn.getresponse()
        response.read()
        conn.close()
        dates.append(parsedate_to_datetime(response.getheader("date")).timestamp())
        time.sleep(1.1)
    assert abs(dates[0] - time.time()) < 5 and dates[1] > dates[0]


def test_the_supervisor_looks_often_only_while_a_batch_runs() -> None:
    """A stall is seen at most a tenth of watchdog_ms late while a batch runs; with none
    running, nothing can stall before a whole watchdog_ms, so it looks that far off."""
    from types import SimpleNamespace

    from edged.supervision import Supervision

    def care(*models: tuple[bool, int]) -> float:
        looker = Supervision()
        looker.models = {
            str(i): SimpleNamespace(
                worker=SimpleNamespace(busy=busy, batching=SimpleNamespace(watchdog_ms=ms))
            )
            for i, (busy, ms) in enumerate(models)
        }
        return looker._supervise_interval()

    assert care((False, 5000)) == 5.0  # idle: one look per watchdog_ms, not two a second
    assert care((True, 5000)) == 0.5
    assert care((False, 5000), (True, 200)) == pytest.approx(0.1)  # the shortest bound rules
    assert care((False, 200), (False, 5000)) == pytest.approx(0.2)
    assert care((False, 600_000)) == 30.0  # at most RECOVER_S (a fall-back tries its pick)
    assert care() == 10.0


@pytest.mark.integration
def test_tritonclient_health_and_metadata(daemon: Daemon) -> None:
    import tritonclient.http as th

    client = th.InferenceServerClient(daemon.address)
    assert client.is_server_live() and client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    assert client.is_model_ready("cls") and client.is_model_ready("cls", "1")
    meta = client.get_model_metadata("cls")
    [inp] = meta["inputs"]
    # OpenVINO compiles the configured shape with a dynamic batch; onnxruntime keeps the
    # model's own dynamic dims. Either way: batch dynamic, 3 channels.
    assert (inp["name"], inp["datatype"]) == ("x", "FP32")
    assert inp["shape"][:2] == [-1, 3] and inp["shape"][2:] in ([48, 192], [-1, -1])
    assert meta["platform"] == "onnxruntime_onnx"
    face = client.get_model_metadata("face")
    assert face["inputs"][0]["shape"] == [1, 128, 128, 3]


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.integration
def test_tritonclient_infer_matches_in_process(
    daemon: Daemon, models_dir: Path, binary: bool
) -> None:
    import onnxruntime as ort
    import tritonclient.http as th

    x = cls_input()
    expected = ort.InferenceSession(str(models_dir / "ppocr_cls.onnx")).run(None, {"x": x})[0]
    client = th.InferenceServerClient(daemon.address)
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out_name = "save_infer_model/scale_0.tmp_1"
    result = client.infer(
        "cls", [inp], outputs=[th.InferRequestedOutput(out_name, binary_data=binary)]
    )
    got = result.as_numpy(out_name)
    assert got.shape == (1, 2)
    # Whatever backend was selected, it was verified against the float32 reference.
    assert np.allclose(got, expected, atol=0.02), (got, expected)
    # No outputs named: tritonclient asks for binary_data_output, all outputs come back.
    assert client.infer("cls", [inp]).as_numpy(out_name).shape == (1, 2)


@pytest.mark.integration
def test_tritonclient_errors(daemon: Daemon) -> None:
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    client = th.InferenceServerClient(daemon.address)
    x = cls_input()
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as err:
        client.infer("nope", [inp])
    assert err.value.status() == "404"
    with pytest.raises(InferenceServerException, match="no version '2'"):
        client.infer("cls", [inp], model_version="2")
    wrong = th.InferInput("x", [1, 3, 48], "FP32")
    wrong.set_data_from_numpy(x[:, :, :, 0])
    with pytest.raises(InferenceServerException, match="input 'x' has shape 1x3x48") as err:
        client.infer("cls", [wrong])
    assert err.value.status() == "400"
    ints = th.InferInput("x", list(x.shape), "INT32")
    ints.set_data_from_numpy(x.astype(np.int32))
    with pytest.raises(InferenceServerException, match="dtype int32, expected float32"):
        client.infer("cls", [ints])


@pytest.mark.integration
def test_unix_socket_client(daemon: Daemon, models_dir: Path) -> None:
    sock = daemon.config.parent / "edged.sock"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660
    with Client(f"unix:{sock}") as client:
        assert client.ready()
        outputs = client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
        assert outputs["regressors"].shape == (1, 896, 16)
        batch_of_one = client.infer("cls", {"x": cls_input()})
        assert next(iter(batch_of_one.values())).shape == (1, 2)
        with pytest.raises(EdgedError, match=r"\[404\] unknown model"):
            client.infer("missing", {"x": cls_input()})
        status = client.status()
    names = {m["name"]: m for m in status["models"]}
    assert set(names) == {"cls", "face"}
    assert names["cls"]["batching"] is True and names["face"]["batching"] is False
    assert any(t["name"] == "infer-cls" for t in status["threads"])


def _post(
    daemon: Daemon, body: bytes, headers: dict[str, str], path: str = "/v2/models/cls/infer"
) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data) if data else {}


def _binary_request(
    x: np.ndarray, size: int | None = None, extra: bytes = b""
) -> tuple[bytes, dict[str, str]]:
    data = x.tobytes()
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": size or len(data)},
                }
            ]
        }
    )
    return head.encode() + data + extra, {"Inference-Header-Content-Length": str(len(head))}


@pytest.mark.integration
def test_bad_requests(daemon: Daemon) -> None:
    x = cls_input()
    assert _post(daemon, b"{not json", {}) == (400, _post(daemon, b"{not json", {})[1])
    status, doc = _post(daemon, b"{not json", {})
    assert status == 400 and "not valid JSON" in doc["error"]
    body, headers = _binary_request(x)
    status, doc = _post(daemon, body, {})  # binary body, header length header missing
    assert status == 400 and "Inference-Header-Content-Length" in doc["error"]
    body, headers = _binary_request(x, size=100)
    status, doc = _post(daemon, body, headers)
    assert status == 400 and "binary_data_size 100 does not match" in doc["error"]
    body, headers = _binary_request(x, extra=b"\0" * 8)
    status, doc = _post(daemon, body, headers)
    assert status == 400 and "8 bytes of binary data after the last input" in doc["error"]
    status, doc = _post(daemon, b"{}", {"Inference-Header-Content-Length": "99"})
    assert status == 400 and "outside the 2-byte body" in doc["error"]
    big = np.zeros((1, 3, 48, 2000), np.float32)  # 1.15 MB, over this daemon's 1 MB limit
    body, headers = _binary_request(big)
    status, doc = _post(daemon, body, headers)
    assert status == 413 and "over the limit" in doc["error"]
    status, doc = _post(daemon, b"{}", {}, path="/v2/models/cls/versions/7/infer")
    assert status == 404
    # The daemon still serves after all that.
    body, headers = _binary_request(x)
    assert _post(daemon, body, headers)[0] == 200


@pytest.mark.integration
def test_client_disconnects_mid_request(daemon: Daemon) -> None:
    body, headers = _binary_request(cls_input())
    with socket.create_connection(("127.0.0.1", daemon.port)) as raw:
        raw.sendall(
            b"POST /v2/models/cls/infer HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {len(body)}\r\n".encode()
            + f"Inference-Header-Content-Length: "
            f"{headers['Inference-Header-Content-Length']}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )
    body, headers = _binary_request(cls_input())
    assert _post(daemon, body, headers)[0] == 200


@pytest.mark.integration
def test_deadline_passed_is_504(daemon: Daemon) -> None:
    with (
        Client(daemon.address) as client,
        pytest.raises(
            EdgedError,
            match=r"\[504\] cls: "
            r"deadline passed",
        ),
    ):
        client.infer("cls", {"x": cls_input()}, timeout_ms=0.001)


@pytest.mark.integration
def test_concurrent_requests_are_batched_and_answered(daemon: Daemon) -> None:
    results: list[np.ndarray] = []
    errors: list[Exception] = []
    inputs = [cls_input(seed) for seed in range(4)]

    def worker(seed: int) -> None:
        try:
            with Client(daemon.address) as client:
                for _ in range(15):
                    out = client.infer("cls", {"x": inputs[seed]})
                    results.append((seed, next(iter(out.values()))))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 60
    # Each answer belongs to its own request, batched or not.
    first = {}
    for seed, out in results:
        first.setdefault(seed, out)
        assert np.allclose(out, first[seed], atol=1e-4)
    metrics = http.client.HTTPConnection(daemon.address)
    metrics.request("GET", "/metrics")
    text = metrics.getresponse().read().decode()
    assert 'edged_request_duration_seconds_bucket{le="0.001",model="cls",phase="queue"}' in text
    assert 'edged_requests_total{code="200",model="cls"}' in text
    assert 'edged_batch_size_count{model="cls"}' in text
    assert 'edged_queue_depth{model="cls"}' in text
    assert "edged_backend_info{backend=" in text
    # Intrusion counters, read from the kernel at scrape time.
    assert 'edged_cpu_interrupts_total{cpu="0",role=' in text
    assert 'edged_cpu_softirqs_total{cpu="0",kind="TIMER",role=' in text
    assert 'edged_worker_involuntary_switches_total{model="cls"}' in text


@pytest.mark.integration
def test_watchdog_pings_while_workers_live(daemon: Daemon) -> None:
    daemon.notify.wait_for("WATCHDOG=1", timeout=5)
    ready = daemon.notify.wait_for("READY=1")
    assert "STATUS=serving 2 model(s)" in ready


@pytest.mark.integration
def test_queue_full_is_503_and_others_keep_serving(models_dir: Path, tmp_path: Path) -> None:
    models = f"""
[[models]]
name = "det"
path = "{models_dir / "ppocrv4_det.onnx"}"
threads = 1
shapes = {{ x = [1, 3, 320, 320] }}
max_queue_size = 1
""" + models_toml(models_dir)
    d = Daemon(write_config(tmp_path, models)).wait_ready()
    try:
        codes: list[int] = []
        x = np.zeros((1, 3, 320, 320), np.float32)

        def flood() -> None:
            with Client(d.address) as client:
                for _ in range(4):
                    try:
                        client.infer("det", {"x": x})
                        codes.append(200)
                    except EdgedError as exc:
                        codes.append(exc.status)

        threads = [threading.Thread(target=flood) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 503 in codes and 200 in codes, codes
        assert set(codes) <= {200, 503}
        with Client(d.address) as client:  # another model is unaffected
            assert client.infer("cls", {"x": cls_input()})
    finally:
        assert d.stop() == 0


@pytest.mark.integration
def test_reload_swaps_models_and_keeps_old_on_errors(models_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, models_toml(models_dir))
    d = Daemon(config).wait_ready()
    try:
        with Client(d.address) as client:
            assert {m["name"] for m in client.status()["models"]} == {"cls", "face"}
        # 1. A broken config: the running one stays.
        text = config.read_text()
        config.write_text(text.replace("threads = 1", "threads = 0", 1))
        mark = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("RELOADING=1", after=mark)
        d.notify.wait_for("READY=1", after=mark)
        with Client(d.address) as client:
            status = client.status()
            assert "models[0].threads" in status["last_reload_error"]
            assert client.infer("cls", {"x": cls_input()})
        # 2. A model whose new file is corrupt: the config names it (the file is read at
        # load), and the running version keeps serving.
        broken = tmp_path / "broken.onnx"
        broken.write_bytes((models_dir / "ppocr_cls.onnx").read_bytes()[:5000])
        config.write_text(text.replace(str(models_dir / "ppocr_cls.onnx"), str(broken)))
        mark = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY=1", after=mark)
        with Client(d.address) as client:
            status = client.status()
            assert "models[0].path" in status["last_reload_error"]
            assert "broken.onnx" in status["last_reload_error"]
            assert client.infer("cls", {"x": cls_input()})  # old version still serves
        # 3. Remove one model, add another: swapped in (this time via `edgectl reload`).
        config.write_text(text.replace('name = "face"', 'name = "face2"'))
        mark = len(d.notify.messages)
        with Client(d.address) as client, pytest.raises(EdgedError, match="403"):
            client.reload()  # not over TCP
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "edged.cli.main",
                "reload",
                "--address",
                f"unix:{tmp_path / 'edged.sock'}",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stderr
        d.notify.wait_for("READY=1", after=mark)
        with Client(d.address) as client:
            assert {m["name"] for m in client.status()["models"]} == {"cls", "face2"}
            with pytest.raises(EdgedError, match="404"):
                client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
            assert client.infer("face2", {"input": np.zeros((1, 128, 128, 3), np.float32)})
    finally:
        assert d.stop() == 0


@pytest.mark.integration
def test_sigterm_drains_in_flight_and_exits_0(models_dir: Path, tmp_path: Path) -> None:
    models = f"""
[[models]]
name = "det"
path = "{models_dir / "ppocrv4_det.onnx"}"
threads = 1
shapes = {{ x = [1, 3, 640, 640] }}
"""
    d = Daemon(write_config(tmp_path, models)).wait_ready()
    results: list[object] = []

    def slow_request() -> None:
        try:
            with Client(d.address) as client:
                results.append(client.infer("det", {"x": np.zeros((1, 3, 640, 640), np.float32)}))
        except Exception as exc:
            results.append(exc)

    thread = threading.Thread(target=slow_request)
    thread.start()
    import time

    time.sleep(0.02)
    assert d.stop() == 0
    thread.join()
    assert any("STOPPING=1" in m.split("\n") for m in d.notify.messages)
    assert len(results) == 1 and isinstance(results[0], dict), results
    assert not (tmp_path / "edged.sock").exists()


@pytest.mark.integration
def test_bad_config_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text('[server]\nlisten = "localhost"\n')
    for extra in ([], ["--check-config"]):
        proc = subprocess.run(
            [sys.executable, "-m", "edged.daemon", "--config", str(config), *extra],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert proc.returncode == 2
        assert f"{config}: server.listen" in proc.stderr


@pytest.mark.integration
def test_check_config_ok(models_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, models_toml(models_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "edged.daemon", "--config", str(config), "--check-config"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0 and "OK (2 model(s))" in proc.stdout


@pytest.mark.integration
def test_edgectl_status(daemon: Daemon) -> None:
    with Client(daemon.address) as client:
        client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
    sock = daemon.config.parent / "edged.sock"
    proc = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", "status", "--address", f"unix:{sock}", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    face = next(m for m in status["models"] if m["name"] == "face")
    assert face["ready"] and face["backend"] in ("litert", "openvino")
    assert status["latency_ms"]["face"]["requests"] >= 1
    assert status["latency_ms"]["face"]["p99_ms_le"] >= status["latency_ms"]["face"]["p50_ms_le"]
    text = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", "status", "--address", daemon.address],
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout
    assert "face" in text and "infer-face" in text
    gone = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", "status", "--address", "unix:/nonexistent.sock"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert gone.returncode == 1 and "no edged answers" in gone.stderr


@pytest.mark.needs_cpus(2)
@pytest.mark.integration
def test_pinning_fifo_and_mlockall(models_dir: Path, tmp_path: Path) -> None:
    """Checked for real on this machine, on the daemon's own threads: the worker and the
    runtime's pool on the model's CPU, everything else on housekeeping."""
    models = f"""
[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
backend = "onnxruntime"
threads = 2
cpus = "1"
rt_priority = 10
shapes = {{ x = {CLS} }}
"""
    d = Daemon(write_config(tmp_path, models, server_extra="mlockall = true")).wait_ready()
    try:
        with Client(d.address) as client:
            client.infer("cls", {"x": cls_input()})
            status = client.status()
        threads = status["threads"]
        worker = next(t for t in threads if t["name"] == "infer-cls")
        assert worker["cpus"] == "1"
        assert worker["policy"] == "fifo:10"  # root here; without CAP_SYS_NICE: a warning
        assert status["models"][0]["scheduling"] == "fifo:10"
        on_inference = [t for t in threads if t["cpus"] == "1"]
        assert len(on_inference) >= 2  # the worker and onnxruntime's pool thread
        assert {t["cpus"] for t in threads} == {"0", "1"}, threads
        assert all(t["cpus"] == "0" for t in threads if t["tid"] == status["pid"])
        assert status["housekeeping_cpus"] == [0]
        assert status["memory_locked"] is True
    finally:
        assert d.stop() == 0


def _get(
    address: str, conn: http.client.HTTPConnection | None = None, path: str = "/v2/health/live"
) -> tuple[int, http.client.HTTPConnection]:
    conn = conn or http.client.HTTPConnection(address, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    return response.status, conn


@pytest.mark.integration
def test_connection_limit_answers_503(models_dir: Path, tmp_path: Path) -> None:
    """[server] max_connections = 2: two kept-alive connections are served, a request on a
    third gets 503 at once, and once one closes a new connection is served again."""
    d = Daemon(
        write_config(tmp_path, models_toml(models_dir), server_extra="max_connections = 2")
    ).wait_ready()
    held: list[http.client.HTTPConnection] = []
    try:
        for _ in range(2):
            status, conn = _get(d.address)
            assert status == 200
            held.append(conn)
        assert _get(d.address, held[0])[0] == 200  # kept alive, still served
        status, extra = _get(d.address)
        extra.close()
        assert status == 503
        held.pop().close()
        import time

        deadline = time.monotonic() + 10
        while True:  # the server sees the close a moment later
            status, conn = _get(d.address)
            conn.close()
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
    finally:
        for conn in held:
            conn.close()
        assert d.stop() == 0
    assert "Exceeded concurrency limit" in d.log_text()


@pytest.mark.integration
def test_watchdog_pings_stop_while_a_worker_hangs(models_dir: Path, tmp_path: Path) -> None:
    """A runtime that stops answering (the stand-in: onnxruntime's run sleeps), pinned so no
    other backend can take over: past [server] hang_s the WATCHDOG=1 pings stop (systemd
    would restart the daemon) while the HTTP side still answers; they resume once it
    returns."""
    from tests.support.daemon_harness import HANG_MARK

    models = f"""
[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
backend = "onnxruntime"
threads = 1
shapes = {{ x = {CLS} }}
watchdog_ms = 200
timeout_ms = 20000
"""
    config = write_config(tmp_path, models, server_extra="hang_s = 1.0")
    d = Daemon(config, env={"WATCHDOG_USEC": "200000"}, hang_s=6.0).wait_ready()
    try:
        d.notify.wait_for("WATCHDOG=1", timeout=5)
        with Client(d.address) as client:  # a normal request does not stop the pings
            client.infer("cls", {"x": cls_input()})
        mark = len(d.notify.messages)
        d.notify.wait_for("WATCHDOG=1", timeout=5, after=mark)
        hung = np.full((1, 3, 48, 192), HANG_MARK, np.float32)
        results: list[object] = []

        def hang() -> None:
            try:
                with Client(d.address) as client:
                    results.append(client.infer("cls", {"x": hung}))
            except Exception as exc:
                results.append(exc)

        thread = threading.Thread(target=hang, daemon=True)
        thread.start()
        import time

        deadline = time.monotonic() + 5
        while "withholding watchdog pings" not in d.log_text():
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.05)
        pings_before = sum("WATCHDOG=1" in m.split("\n") for m in d.notify.messages)
        silent_from = len(d.notify.messages)
        time.sleep(1.5)  # 15 ping intervals
        assert pings_before >= 2
        assert not any("WATCHDOG=1" in m.split("\n") for m in d.notify.messages[silent_from:])
        with Client(d.address) as client:
            assert client.ready()  # the HTTP side answers: only the watchdog can tell
        # The runtime comes back: the pings resume and the request is answered.
        d.notify.wait_for("WATCHDOG=1", timeout=20, after=silent_from)
        thread.join(20)
        assert len(results) == 1 and isinstance(results[0], dict), results
    finally:
        assert d.stop() == 0, d.log_text()


# -- the CPU plan, the core sampler's readers, the audit topic, hot-plug ---------------------


def _cpu_root(folder: Path, online: str, isolated: str = "") -> Path:
    cpu = folder / "sys" / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(online + "\n")
    (cpu / "possible").write_text(online + "\n")
    (cpu / "isolated").write_text(isolated + "\n")
    (folder / "proc").mkdir()
    (folder / "proc" / "cmdline").write_text("console=ttyS0\n")
    return folder


def _in_process(folder: Path, models: str, extra: str = "", root: Path | None = None):
    from edged.config import load_config
    from edged.daemon import Daemon as InProcess
    from sysconf.sysroot import SysRoot

    config = load_config(write_config(folder, models + extra))
    return InProcess(config, root=SysRoot(root) if root is not None else None)


@pytest.mark.needs_cpus(2)
@pytest.mark.integration
def test_default_pinning_follows_the_tune_units_decision(models_dir: Path, tmp_path: Path) -> None:
    """No model sets cpus: the daemon pins models to decide()'s inference cores (what
    `edgectl apply` tunes) and everything else to housekeeping. Checked on the real threads
    after inferences. (onnxruntime and LiteRT: OpenVINO's CPU pinning moves its calling
    thread by itself, see the report.)"""
    from sysconf.cpusets import decide, read_cpusets
    from sysconf.sysroot import SysRoot

    models = f"""
[[models]]
name = "cls"
path = "{models_dir / "ppocr_cls.onnx"}"
backend = "onnxruntime"
threads = 2
shapes = {{ x = {CLS} }}

[[models]]
name = "face"
path = "{models_dir / "face_detection_short_range.tflite"}"
backend = "litert"

[tuning]
auto = "propose"
"""
    d = Daemon(write_config(tmp_path, models)).wait_ready()
    try:
        plan = decide(read_cpusets(SysRoot())).to_dict()
        with Client(d.address) as client:
            for _ in range(3):
                client.infer("cls", {"x": cls_input()})
                client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
            status = client.status()
        assert status["cpu_plan"] == plan
        # The tuning loop watches the same cores (proposing only: it writes nothing).
        assert status["tuning"]["auto"] == "propose"
        assert status["tuning"]["phase"] == "observing"
        assert f"tuning: auto = propose on CPUs {plan['inference_list']}" in d.log_text()
        assert status["housekeeping_cpus"] == plan["housekeeping"]
        for model in status["models"]:
            assert model["cpus"] == plan["inference"]
        threads = status["threads"]
        workers = [t for t in threads if t["name"].startswith("infer-")]
        assert {t["name"] for t in workers} == {"infer-cls", "infer-face"}
        assert all(t["cpus"] == plan["inference_list"] for t in workers), workers
        main = next(t for t in threads if t["tid"] == status["pid"])
        assert main["cpus"] == plan["housekeeping_list"]
        on_inference = [t for t in threads if t["cpus"] == plan["inference_list"]]
        assert len(on_inference) >= 3, threads  # the workers and onnxruntime's pool thread
        assert (
            f"CPU plan ({plan['source']}): models on CPUs {plan['inference_list']}" in d.log_text()
        )
        # A reload (on a thread that is itself on housekeeping) keeps the same plan, so the
        # unchanged models are kept, not reloaded.
        mark = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY=1", after=mark)
        with Client(d.address) as client:
            again = client.status()
        assert again["reloads"] == 1 and again["cpu_plan"] == plan
        assert [m["cpus"] for m in again["models"]] == [plan["inference"]] * 2
        assert {t["tid"] for t in again["threads"] if t["name"].startswith("infer-")} == {
            t["tid"] for t in workers
        }
        assert "stay unpinned" not in d.log_text()
    finally:
        assert d.stop() == 0


def test_cpu_plan_isolated_set_and_configured_cpus(models_dir: Path, tmp_path: Path) -> None:
    """On a (fixture) board whose kernel isolates 2-3, models without cpus go there; a model
    that sets cpus keeps them and the config decides."""
    root = _cpu_root(tmp_path / "root", "0-3", "2-3")
    d = _in_process(tmp_path, models_toml(models_dir), root=root)
    assert d.cpu_plan is not None and d.cpu_plan.source == "isolated"
    assert (d.cpu_plan.inference, d.cpu_plan.housekeeping) == ((2, 3), (0, 1))
    assert [mc.cpus for mc in d.config.models] == [(2, 3), (2, 3)]
    (tmp_path / "b").mkdir()
    d = _in_process(tmp_path / "b", models_toml(models_dir, extra='cpus = "1"'), root=root)
    assert [mc.cpus for mc in d.config.models] == [None, (1,)]
    assert d.cpu_plan is not None and d.cpu_plan.source == "models"
    # One CPU: decide() refuses to leave housekeeping empty; the models stay unpinned.
    (tmp_path / "c").mkdir()
    one = _cpu_root(tmp_path / "one", "0")
    d = _in_process(tmp_path / "c", models_toml(models_dir), root=one)
    assert d.cpu_plan is None and [mc.cpus for mc in d.config.models] == [None, None]


def _sampler_root(folder: Path, cur_khz: int, cooling_state: int, firmware: str | None) -> Path:
    root = _cpu_root(folder, "0-1")
    for name in ("interrupts", "softirqs"):
        (root / "proc" / name).write_text(Path(f"/proc/{name}").read_text())
    for cpu, cur in ((0, 1800000), (1, cur_khz)):
        freq = root / "sys" / "devices" / "system" / "cpu" / f"cpu{cpu}" / "cpufreq"
        freq.mkdir(parents=True)
        (freq / "scaling_cur_freq").write_text(f"{cur}\n")
        (freq / "scaling_max_freq").write_text("1800000\n")
    cooling = root / "sys" / "class" / "thermal" / "cooling_device0"
    cooling.mkdir(parents=True)
    (cooling / "type").write_text("cpufreq-cpu0\n")
    (cooling / "cur_state").write_text(f"{cooling_state}\n")
    if firmware is not None:
        fw = root / "sys" / "devices" / "platform" / "soc" / "soc:firmware"
        fw.mkdir(parents=True)
        (fw / "get_throttled").write_text(firmware + "\n")
    return root


@pytest.mark.parametrize(
    ("cur_khz", "cooling", "firmware", "causes"),
    [
        (600000, 0, None, {"freq_drop"}),  # CPU 1 below its max
        (1800000, 2, None, {"throttle"}),  # a cpufreq cooling device engaged: a thermal cap
        (1800000, 0, "0x50005", {"throttle"}),  # the Pi firmware throttling the ARM now
        (1800000, 0, "0x50000", set()),  # only "since boot" bits: not now
        (600000, 1, "0x0", {"freq_drop", "throttle"}),
    ],
)
def test_core_sampler_reads_cpufreq_and_throttle_from_the_root(
    models_dir: Path,
    tmp_path: Path,
    cur_khz: int,
    cooling: int,
    firmware: str | None,
    causes: set[str],
) -> None:
    """The daemon's sampler gets cpufreq and throttle readers on its root, so the outlier
    causes freq_drop and throttle can be recorded."""
    import time

    from edged.telemetry.attribution import attribute

    root = _sampler_root(tmp_path / "root", cur_khz, cooling, firmware)
    d = _in_process(tmp_path, "", root=root)
    sampler = d.core_sampler()
    sampler.sample_once()
    start = time.perf_counter()
    end = time.perf_counter()
    last = sampler.sample_once()
    assert last.freq == {0: (1800000, 1800000), 1: (cur_khz, 1800000)}
    assert last.throttled is ("throttle" in causes)
    found = attribute([(start, end, 0)], [1], sampler.samples())
    assert {c for c in found if c in ("freq_drop", "throttle")} == causes


def test_core_sampler_without_cpufreq_or_throttle_files(models_dir: Path, tmp_path: Path) -> None:
    root = _cpu_root(tmp_path / "root", "0-1")
    for name in ("interrupts", "softirqs"):
        (root / "proc" / name).write_text(Path(f"/proc/{name}").read_text())
    sample = _in_process(tmp_path, "", root=root).core_sampler().sample_once()
    assert sample.freq is None and sample.throttled is None and sample.irqs


@pytest.mark.needs_broker
def test_mqtt_audit_topic(models_dir: Path, tmp_path: Path) -> None:
    """After READY the daemon audits the live system in the background and publishes the
    summary retained on `audit`; cmd/audit runs it again. The ids are those `edgectl audit`
    reports on its own."""
    from tests.support.broker import Broker, SubProcess, pub, sub_once

    base = "edged/v1/lab/dev-1"
    with Broker(tmp_path / "broker") as broker:
        config = write_config(
            tmp_path,
            f"""
[telemetry]
interval_s = 5
[telemetry.mqtt]
url = "{broker.url}"
group = "lab"
device_id = "dev-1"
keepalive_s = 2

[[models]]
name = "face"
path = "{models_dir / "face_detection_short_range.tflite"}"
threads = 1
""",
        )
        d = Daemon(config).wait_ready()
        try:
            [first] = sub_once(broker.port, f"{base}/audit", wait_s=30)  # retained
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "edged.cli.main",
                    "audit",
                    "--format",
                    "json",
                    "--config",
                    str(config),
                ],
                capture_output=True,
                text=True,
                cwd=REPO,
            )
            report = json.loads(proc.stdout)
            from sysconf.audit.findings import Evidence, Finding
            from sysconf.audit.report import level

            def rank(f: dict) -> int:
                ev = tuple(Evidence(**e) for e in f.pop("evidence"))
                return level(Finding(**f, evidence=ev))

            ranked = [(f["id"], rank(dict(f))) for f in report["findings"]]
            assert first["warning"] == sorted({i for i, r in ranked if r == 1})
            assert first["failing"] == sorted({i for i, r in ranked if r == 2})
            assert first["statuses"] == report["summary"]
            assert first["findings"] == len(report["findings"]) > 0
            assert sum(first["levels"].values()) == first["findings"]
            assert {"ts", "seq", "bdSeq"} <= set(first)
            sub = SubProcess(
                broker.port, [f"{base}/audit", f"{base}/event"], tmp_path / "sub.txt"
            ).ready()
            try:
                pub(broker.port, f"{base}/cmd/audit", '{"id": "a-1"}')
                messages = sub.wait_for(
                    lambda ms: any(
                        m.topic == f"{base}/event" and m.payload.get("kind") == "command_done"
                        for m in ms
                    ),
                    timeout=30,
                )
                again = [
                    m.payload
                    for m in messages
                    if m.topic == f"{base}/audit" and m.payload["seq"] > first["seq"]
                ]
                assert again and again[-1]["warning"] == first["warning"]
                done = next(
                    m.payload
                    for m in messages
                    if m.topic == f"{base}/event" and m.payload.get("kind") == "command_done"
                )
                assert done["command"] == "audit" and done["id"] == "a-1"
            finally:
                sub.close()
        finally:
            assert d.stop() == 0, d.log_text()


@pytest.mark.integration
def test_server_changes_wait_for_a_restart_and_stop_removes_only_its_socket(
    models_dir: Path, tmp_path: Path
) -> None:
    """A reload that moves `server.socket` keeps serving on the old one and says a restart
    is needed; at stop the daemon removes the socket it bound, not the unrelated file that
    now sits at the new path, and not a file that replaced its own socket."""
    config = write_config(tmp_path, models_toml(models_dir))
    d = Daemon(config).wait_ready()
    unrelated = tmp_path / "precious.txt"
    unrelated.write_text("keep me\n")
    try:
        text = config.read_text()
        config.write_text(text.replace(str(tmp_path / "edged.sock"), str(unrelated)))
        mark = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY=1", after=mark)
        with Client(f"unix:{tmp_path / 'edged.sock'}") as client:  # the old socket serves
            status = client.status()
        assert status["restart_needed"] == ["server.socket"]
        assert status["last_reload_error"] is None
        assert "takes a restart" in d.log_text()
    finally:
        assert d.stop() == 0, d.log_text()
    assert unrelated.read_text() == "keep me\n"
    assert not (tmp_path / "edged.sock").exists()  # its own socket is gone
    # A file that replaced the daemon's socket while it ran is left alone too.
    config.write_text(text)
    d = Daemon(config).wait_ready()
    try:
        (tmp_path / "edged.sock").unlink()
        (tmp_path / "edged.sock").write_text("someone else's\n")
    finally:
        assert d.stop() == 0, d.log_text()
    assert (tmp_path / "edged.sock").read_text() == "someone else's\n"
