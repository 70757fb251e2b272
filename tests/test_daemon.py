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
from daemon_harness import REPO, Daemon, write_config

from edged.client import Client, EdgedError

CLS = "[1, 3, 48, 192]"


def models_toml(models_dir: Path, queue: int = 64, extra: str = "") -> str:
    return f"""
[[models]]
name = "cls"
path = "{models_dir / 'ppocr_cls.onnx'}"
threads = 1
shapes = {{ x = {CLS} }}
max_batch_size = 4
max_queue_delay_us = 200
max_queue_size = {queue}

[[models]]
name = "face"
path = "{models_dir / 'face_detection_short_range.tflite'}"
threads = 1
{extra}
"""


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("daemon")
    config = write_config(folder, models_toml(models_dir),
                          server_extra="max_body_bytes = 1000000")
    d = Daemon(config, env={"WATCHDOG_USEC": "300000"}).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def cls_input(seed: int = 0) -> np.ndarray:
    from edged.inputs import text_like_images

    grey = next(text_like_images(48, 192, 1, seed))
    return np.repeat(grey[None, None], 3, axis=1).astype(np.float32) * 2 - 1


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
def test_tritonclient_infer_matches_in_process(daemon: Daemon, models_dir: Path,
                                               binary: bool) -> None:
    import onnxruntime as ort
    import tritonclient.http as th

    x = cls_input()
    expected = ort.InferenceSession(str(models_dir / "ppocr_cls.onnx")).run(None, {"x": x})[0]
    client = th.InferenceServerClient(daemon.address)
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out_name = "save_infer_model/scale_0.tmp_1"
    result = client.infer("cls", [inp], outputs=[th.InferRequestedOutput(out_name,
                                                                          binary_data=binary)])
    got = result.as_numpy(out_name)
    assert got.shape == (1, 2)
    # Whatever backend was selected, it was verified against the float32 reference.
    assert np.allclose(got, expected, atol=0.02), (got, expected)
    # No outputs named: tritonclient asks for binary_data_output, all outputs come back.
    assert client.infer("cls", [inp]).as_numpy(out_name).shape == (1, 2)


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


def _post(daemon: Daemon, body: bytes, headers: dict[str, str], path: str = "/v2/models/cls/infer"
          ) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(daemon.address, timeout=30)
    conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data) if data else {}


def _binary_request(x: np.ndarray, size: int | None = None, extra: bytes = b""
                    ) -> tuple[bytes, dict[str, str]]:
    data = x.tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": size or len(data)}}]})
    return head.encode() + data + extra, {"Inference-Header-Content-Length": str(len(head))}


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


def test_client_disconnects_mid_request(daemon: Daemon) -> None:
    body, headers = _binary_request(cls_input())
    with socket.create_connection(("127.0.0.1", daemon.port)) as raw:
        raw.sendall(b"POST /v2/models/cls/infer HTTP/1.1\r\nHost: x\r\n"
                    + f"Content-Length: {len(body)}\r\n".encode()
                    + f"Inference-Header-Content-Length: "
                      f"{headers['Inference-Header-Content-Length']}\r\n\r\n".encode()
                    + body[: len(body) // 2])
    body, headers = _binary_request(cls_input())
    assert _post(daemon, body, headers)[0] == 200


def test_deadline_passed_is_504(daemon: Daemon) -> None:
    with Client(daemon.address) as client, pytest.raises(EdgedError, match=r"\[504\] cls: "
                                                          r"deadline passed"):
        client.infer("cls", {"x": cls_input()}, timeout_ms=0.001)


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
    assert 'edged_backend_info{backend=' in text
    # Intrusion counters, read from the kernel at scrape time.
    assert 'edged_cpu_interrupts_total{cpu="0",role=' in text
    assert 'edged_cpu_softirqs_total{cpu="0",kind="TIMER",role=' in text
    assert 'edged_worker_involuntary_switches_total{model="cls"}' in text


def test_watchdog_pings_while_workers_live(daemon: Daemon) -> None:
    daemon.notify.wait_for("WATCHDOG=1", timeout=5)
    ready = daemon.notify.wait_for("READY=1")
    assert "STATUS=serving 2 model(s)" in ready


def test_queue_full_is_503_and_others_keep_serving(models_dir: Path, tmp_path: Path) -> None:
    models = f"""
[[models]]
name = "det"
path = "{models_dir / 'ppocrv4_det.onnx'}"
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
        # 2. A model whose new file is corrupt keeps its old version serving.
        broken = tmp_path / "broken.onnx"
        broken.write_bytes((models_dir / "ppocr_cls.onnx").read_bytes()[:5000])
        config.write_text(text.replace(str(models_dir / "ppocr_cls.onnx"), str(broken)))
        mark = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY=1", after=mark)
        with Client(d.address) as client:
            status = client.status()
            assert "broken.onnx" in status["failed"]["cls"]
            assert client.infer("cls", {"x": cls_input()})  # old version still serves
        # 3. Remove one model, add another: swapped in (this time via `edgectl reload`).
        config.write_text(text.replace('name = "face"', 'name = "face2"'))
        mark = len(d.notify.messages)
        with Client(d.address) as client, pytest.raises(EdgedError, match="403"):
            client.reload()  # not over TCP
        proc = subprocess.run([sys.executable, "-m", "edged.cli", "reload", "--address",
                               f"unix:{tmp_path / 'edged.sock'}"], capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        d.notify.wait_for("READY=1", after=mark)
        with Client(d.address) as client:
            assert {m["name"] for m in client.status()["models"]} == {"cls", "face2"}
            with pytest.raises(EdgedError, match="404"):
                client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
            assert client.infer("face2", {"input": np.zeros((1, 128, 128, 3), np.float32)})
    finally:
        assert d.stop() == 0


def test_sigterm_drains_in_flight_and_exits_0(models_dir: Path, tmp_path: Path) -> None:
    models = f"""
[[models]]
name = "det"
path = "{models_dir / 'ppocrv4_det.onnx'}"
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


def test_bad_config_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text('[server]\nlisten = "localhost"\n')
    for extra in ([], ["--check-config"]):
        proc = subprocess.run([sys.executable, "-m", "edged.daemon", "--config", str(config),
                               *extra], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 2
        assert f"{config}: server.listen" in proc.stderr


def test_check_config_ok(models_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, models_toml(models_dir))
    proc = subprocess.run([sys.executable, "-m", "edged.daemon", "--config", str(config),
                           "--check-config"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and "OK (2 model(s))" in proc.stdout


def test_edgectl_status(daemon: Daemon) -> None:
    with Client(daemon.address) as client:
        client.infer("face", {"input": np.zeros((1, 128, 128, 3), np.float32)})
    sock = daemon.config.parent / "edged.sock"
    proc = subprocess.run([sys.executable, "-m", "edged.cli", "status", "--address",
                           f"unix:{sock}", "--json"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    face = next(m for m in status["models"] if m["name"] == "face")
    assert face["ready"] and face["backend"] in ("litert", "openvino")
    assert status["latency_ms"]["face"]["requests"] >= 1
    assert status["latency_ms"]["face"]["p99_ms_le"] >= status["latency_ms"]["face"]["p50_ms_le"]
    text = subprocess.run([sys.executable, "-m", "edged.cli", "status", "--address",
                           daemon.address], capture_output=True, text=True, cwd=REPO).stdout
    assert "face" in text and "infer-face" in text
    gone = subprocess.run([sys.executable, "-m", "edged.cli", "status", "--address",
                           "unix:/nonexistent.sock"], capture_output=True, text=True, cwd=REPO)
    assert gone.returncode == 1 and "no edged answers" in gone.stderr


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pinning_fifo_and_mlockall(models_dir: Path, tmp_path: Path) -> None:
    """Checked for real on this machine, on the daemon's own threads: the worker and the
    runtime's pool on the model's CPU, everything else on housekeeping."""
    models = f"""
[[models]]
name = "cls"
path = "{models_dir / 'ppocr_cls.onnx'}"
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
