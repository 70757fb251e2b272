"""The repository extension against the real edged process ([server] model_control =
"explicit"), with unmodified tritonclient http and grpc: the index with each model's state
and reason (a model that failed to load included), load (from the config file, or with a
config of its own), a missing model and a bad config each a clear error with the old
version serving on, unload during a flood (every request answered or refused, none hangs),
load again. Without a daemon: who may load (loopback and the sockets only)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from edged.serving import grpc_server
from edged.serving.http_io import request_peer
from edged.serving.inference import Inference, RequestError
from edged.serving.peers import Peer
from tests.support.daemon_harness import (
    HANG_MARK,
    OUT,
    Daemon,
    cls_input,
    cls_table,
    get,
    grpc_port,
    write_config,
)

HANG_S = 1.0


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("repository")
    (folder / "broken.onnx").write_bytes((models_dir / "ppocr_cls.onnx").read_bytes()[:5000])
    # "broken" passes the config's checks and fails to load (an input shape of the wrong rank)
    cls = cls_table(models_dir, max_batch_size=4, max_queue_size=64, timeout_ms=5000)
    models = f"""{cls}
[[models]]
name = "broken"
path = "{models_dir / "ppocr_cls.onnx"}"
backend = "onnxruntime"
shapes = {{ x = [1, 3] }}
"""
    # tcp_control: tritonclient.http loads over TCP (gRPC over the Unix socket).
    # load_dirs: a load's own table names broken.onnx beside the config (outside them: 400).
    server = (
        f'model_control = "explicit"\ntcp_control = true\nload_dirs = ["{folder}", "{models_dir}"]'
    )
    config = write_config(folder, models, server)
    d = Daemon(config, hang_s=HANG_S).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.fixture(params=["http", "grpc"])
def client(request, daemon: Daemon):
    if request.param == "http":
        c = th.InferenceServerClient(daemon.address, network_timeout=60)
    else:
        c = tg.InferenceServerClient(f"unix://{daemon.config.parent / 'grpc.sock'}")
    yield c
    c.close()


def is_grpc(client) -> bool:
    return isinstance(client, tg.InferenceServerClient)


def index(client) -> dict[str, tuple[str, str]]:
    answer = client.get_model_repository_index()
    if is_grpc(client):
        return {m.name: (m.state, m.reason) for m in answer.models}
    return {m["name"]: (m["state"], m["reason"]) for m in answer}


def error_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()), err.value.message()


def infer(client, x: np.ndarray, model: str = "cls"):
    mod = tg if is_grpc(client) else th
    inp = mod.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp])


# -- against the daemon -----------------------------------------------------------------------


@pytest.mark.integration
def test_index_lists_every_model_with_its_state(client, daemon: Daemon) -> None:
    models = index(client)
    assert models["cls"] == ("READY", "")
    state, reason = models["broken"]
    assert state == "UNAVAILABLE" and reason, models
    extensions = json.loads(get(daemon, "/v2")[1])["extensions"]
    assert "model_repository" in extensions and "system_shared_memory" not in extensions


@pytest.mark.integration
def test_load_of_a_missing_model_or_a_bad_config(client, daemon: Daemon, models_dir: Path) -> None:
    bad = "StatusCode.INVALID_ARGUMENT" if is_grpc(client) else "400"
    status, message = error_of(lambda: client.load_model("nope"))
    assert status == bad and "no such model" in message
    table = {"path": str(models_dir / "ppocr_cls.onnx"), "backend": "onnxruntime"}
    # the config is the whole [[models]] table (as Triton's replaces config.pbtxt)
    status, message = error_of(lambda: client.load_model("cls", config='{"threads": 1}'))
    assert status == bad and "parameters.config.path: required" in message, message
    config = json.dumps({**table, "threads": 0})
    status, message = error_of(lambda: client.load_model("cls", config=config))
    assert status == bad and "parameters.config.threads" in message, message  # the key named
    status, message = error_of(lambda: client.load_model("cls", config="{nope"))
    assert status == bad and "not valid JSON" in message
    status, message = error_of(lambda: client.load_model("cls", config='{"name": "other"}'))
    assert status == bad and "'other'" in message
    broken = daemon.config.parent / "broken.onnx"
    config = json.dumps({"path": str(broken), "backend": "onnxruntime"})
    status, message = error_of(lambda: client.load_model("cls", config=config))
    assert status == bad and "not a valid ONNX model" in message, message
    config = json.dumps({**table, "shapes": {"x": [1, 3]}})  # checks pass, the load fails
    status, message = error_of(lambda: client.load_model("cls", config=config))
    assert status == bad and "previous version still serves" in message, message
    assert infer(client, cls_input()).as_numpy(OUT).shape == (1, 2)  # the old version
    assert index(client)["cls"] == ("READY", "")


@pytest.mark.integration
def test_load_with_a_config_replaces_the_model(client, daemon: Daemon, models_dir: Path) -> None:
    table = {
        "path": str(models_dir / "ppocr_cls.onnx"),
        "backend": "onnxruntime",
        "threads": 1,
        "shapes": {"x": [1, 3, 48, 192]},
        "max_batch_size": 2,
    }
    client.load_model("cls", config=json.dumps(table))
    config = client.get_model_config("cls")
    batch = config.config.max_batch_size if is_grpc(client) else config["max_batch_size"]
    assert batch == 2
    assert infer(client, cls_input()).as_numpy(OUT).shape == (1, 2)
    client.load_model("cls")  # the config file's table again
    config = client.get_model_config("cls")
    batch = config.config.max_batch_size if is_grpc(client) else config["max_batch_size"]
    assert batch == 4


@pytest.mark.integration
def test_unload_during_a_flood_then_load_again(client, daemon: Daemon) -> None:
    """A request running at the unload (hung 1 s in the runtime) is answered; the others are
    answered or refused with a clear error; none hangs. Then the model is UNAVAILABLE,
    "unloaded", and serves again once loaded."""
    url = f"127.0.0.1:{grpc_port(daemon)}"
    hang = cls_input()
    hang.flat[0] = HANG_MARK
    results: list[object] = []
    stop = threading.Event()

    def one(x: np.ndarray) -> None:
        with tg.InferenceServerClient(url) as c:
            inp = tg.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            while True:
                try:
                    results.append(c.infer("cls", [inp], client_timeout=30).as_numpy(OUT).shape)
                except InferenceServerException as exc:
                    results.append((exc.status(), exc.message()))
                if stop.is_set() or x is hang:
                    return

    threads = [threading.Thread(target=one, args=(hang,))]
    threads += [threading.Thread(target=one, args=(cls_input(i),)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the hung request is running, the flood going
    start = time.monotonic()
    client.unload_model("cls")
    assert time.monotonic() - start < 10  # drained within the bound
    stop.set()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    answered = [r for r in results if r == (1, 2)]
    refused = [r for r in results if r != (1, 2)]
    assert answered, results
    for status, message in refused:  # type: ignore[misc]
        assert status == "StatusCode.UNAVAILABLE", (status, message)
        assert "unloaded" in message or "shutting down" in message, message
    assert index(client)["cls"] == ("UNAVAILABLE", "unloaded")
    status, message = error_of(lambda: infer(client, cls_input()))
    assert status in ("StatusCode.UNAVAILABLE", "503") and "unloaded" in message
    client.unload_model("cls")  # unloaded already: done, as on Triton
    assert client.is_server_live() and not client.is_model_ready("cls")

    client.load_model("cls")
    assert index(client)["cls"] == ("READY", "")
    assert infer(client, cls_input()).as_numpy(OUT).shape == (1, 2)


# -- without a daemon ---------------------------------------------------------------------------


def test_who_may_load() -> None:
    """The peer each front end sees: the HTTP scope's addresses (or the connection's Peer),
    grpcio's peer string (IPv6 percent-encoded, as grpcio writes it)."""
    tcp = ("127.0.0.1", 8000)
    assert request_peer({"server": tcp, "client": ("127.0.0.1", 5000)}).local
    assert request_peer({"server": tcp, "client": ("::ffff:127.0.0.1", 5000)}).local
    unix = request_peer({"server": ("/run/edged/edged.sock", None), "client": None})
    assert unix.transport == "unix" and unix.local
    assert not request_peer({"server": ("0.0.0.0", 8000), "client": ("10.1.2.3", 5000)}).local

    for text, local in (
        ("ipv4:127.0.0.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:%5B::1%5D:5000", True),
        ("ipv4:192.168.1.9:5000", False),
        ("ipv6:%5Bfe80::1%5D:5000", False),
        ("garbage", False),
    ):
        peer = grpc_server.grpc_tcp_peer(text, ("127.0.0.1", 8001))
        assert peer.transport == "tcp" and peer.local is local, text


def test_off_or_remote_is_refused() -> None:
    import asyncio

    from edged.serving.inference import ModelControl
    from edged.serving.metrics import ServingMetrics

    async def never(*args) -> None:
        raise AssertionError("not called")

    off = Inference(dict, ServingMetrics())
    on = Inference(dict, ServingMetrics(), control=ModelControl(never, never, set))
    unix = Peer("unix", 0, True, "unix")
    remote = Peer("tcp", None, False, "10.1.2.3:5000")
    loopback = Peer("tcp", None, True, "127.0.0.1:5000")
    for inference, peer, text in (
        (off, unix, 'model_control = "none"'),
        (on, remote, "from this machine only"),
        (on, loopback, "tcp_control = false"),
    ):
        for call in (inference.load("m", {}, peer), inference.unload("m", peer)):
            with pytest.raises(RequestError, match=text) as err:
                asyncio.run(call)
            assert err.value.status == 403
    assert "model_repository(metadata only)" in off.extensions()
    assert "model_repository" in on.extensions()
