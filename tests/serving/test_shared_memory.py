"""The system shared-memory extension against the real edged process ([server]
allow_shared_memory = true), with unmodified tritonclient.utils.shared_memory and the http
and grpc clients (gRPC over TCP and the Unix socket): register, status, unregister; inputs
and outputs in shared memory equal to in-process; each bad input a clear error with the
daemon serving on; no mapping left behind. Without a daemon: the registry's rules."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from edged.serving.peers import Peer
from edged.serving.protocol import ShmRef
from edged.serving.shared_memory import SHM_ROOT, SharedMemory, SharedMemoryError, check_key
from tests.support.daemon_harness import (
    OUT,
    Daemon,
    cls_input,
    cls_table,
    get,
    grpc_port,
    write_config,
)

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm")

X_BYTES = 1 * 3 * 48 * 192 * 4  # the cls model's input, FP32
OUT_BYTES = 2 * 4  # its output, [1, 2] FP32


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("shm")
    models = cls_table(models_dir, max_batch_size=4, max_queue_delay_us=200)
    # tcp_control: tritonclient.http speaks TCP only; gRPC is tried on both listeners.
    server = "allow_shared_memory = true\ntcp_control = true"
    d = Daemon(write_config(folder, models, server)).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()
    assert "still mapped" not in d.log_text()


@pytest.fixture(scope="module")
def reference(models_dir: Path):
    import onnxruntime as ort

    session = ort.InferenceSession(str(models_dir / "ppocr_cls.onnx"))
    return lambda x: session.run(None, {"x": x})[0]


@pytest.fixture(params=["http", "grpc-tcp", "grpc-unix"])
def client(request, daemon: Daemon):
    if request.param == "http":
        c = th.InferenceServerClient(daemon.address)
    elif request.param == "grpc-tcp":
        c = tg.InferenceServerClient(f"127.0.0.1:{grpc_port(daemon)}")
    else:
        c = tg.InferenceServerClient(f"unix://{daemon.config.parent / 'grpc.sock'}")
    yield c
    c.unregister_system_shared_memory()  # whatever a test left registered
    c.close()


class Regions:
    """Client-side regions (tritonclient's own helper), destroyed at the end."""

    def __init__(self) -> None:
        self.handles = []

    def create(self, size: int, name: str = "") -> tuple[str, str, object]:
        tag = uuid.uuid4().hex[:10]
        name = name or f"r{tag}"
        key = f"/edged_test_{tag}"
        handle = shm.create_shared_memory_region(name, key, size)
        # Shared with the group, as a client shares with the daemon's user on a device
        # (tritonclient makes it 0600); a gRPC Unix-socket client's must be (docs/SECURITY.md).
        os.chmod(SHM_ROOT / key.lstrip("/"), 0o660)
        self.handles.append(handle)
        return name, key, handle

    def destroy(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions():
    r = Regions()
    yield r
    r.destroy()


def is_grpc(client) -> bool:
    return isinstance(client, tg.InferenceServerClient)


def module(client):
    return tg if is_grpc(client) else th


def statuses(client) -> dict[str, dict]:
    """Region name -> {key, offset, byte_size}, from either client's answer."""
    if is_grpc(client):
        answer = client.get_system_shared_memory_status()
        return {
            name: {"key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for name, r in answer.regions.items()
        }
    return {
        r["name"]: {"key": r["key"], "offset": r["offset"], "byte_size": r["byte_size"]}
        for r in client.get_system_shared_memory_status()
    }


def error_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()), err.value.message()


def bad_input(client) -> str:
    """The status a 400 has on this client."""
    return "StatusCode.INVALID_ARGUMENT" if is_grpc(client) else "400"


def held(daemon: Daemon, key: str) -> bool:
    """The daemon holds the object open (one descriptor per region), and never maps it: a
    mapped client object is a SIGBUS away from killing the daemon."""
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert f"/dev/shm{key}" not in maps
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    target = f"/dev/shm{key}"
    for fd in fds.iterdir():
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False


def shm_infer(client, x: np.ndarray, in_name: str, out_name: str | None, out_size: int = 0):
    mod = module(client)
    inp = mod.InferInput("x", list(x.shape), "FP32")
    inp.set_shared_memory(in_name, x.nbytes)
    out = mod.InferRequestedOutput(OUT)
    if out_name is not None:
        out.set_shared_memory(out_name, out_size or OUT_BYTES)
    return client.infer("cls", [inp], outputs=[out])


def serves(client, reference) -> None:
    """The daemon answers a plain request correctly (after an error)."""
    mod = module(client)
    x = cls_input(3)
    inp = mod.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("cls", [inp])
    np.testing.assert_allclose(result.as_numpy(OUT), reference(x), rtol=1e-5, atol=1e-6)


# -- against the daemon -----------------------------------------------------------------------


@pytest.mark.integration
def test_metadata_lists_the_extension(daemon: Daemon) -> None:
    extensions = json.loads(get(daemon, "/v2")[1])["extensions"]
    assert "system_shared_memory" in extensions
    with tg.InferenceServerClient(f"127.0.0.1:{grpc_port(daemon)}") as c:
        assert list(c.get_server_metadata().extensions) == extensions


@pytest.mark.integration
def test_register_status_unregister(client, daemon: Daemon, regions: Regions) -> None:
    a, key_a, _ = regions.create(4096)
    b, key_b, _ = regions.create(8192)
    client.register_system_shared_memory(a, key_a, 4096)
    client.register_system_shared_memory(b, key_b, 100, offset=4096)
    assert statuses(client) == {
        a: {"key": key_a, "offset": 0, "byte_size": 4096},
        b: {"key": key_b, "offset": 4096, "byte_size": 100},
    }
    one = client.get_system_shared_memory_status(b)
    names = list(one.regions) if is_grpc(client) else [r["name"] for r in one]
    assert names == [b]
    assert held(daemon, key_a) and held(daemon, key_b)
    client.unregister_system_shared_memory(a)
    assert list(statuses(client)) == [b]
    assert not held(daemon, key_a)
    client.unregister_system_shared_memory()  # all
    assert statuses(client) == {}
    assert not held(daemon, key_b)


@pytest.mark.integration
def test_infer_in_and_out_of_shared_memory(
    client, daemon: Daemon, regions: Regions, reference
) -> None:
    x = cls_input(1)
    in_name, in_key, in_handle = regions.create(X_BYTES)
    out_name, out_key, out_handle = regions.create(64)
    shm.set_shared_memory_region(in_handle, [x])
    client.register_system_shared_memory(in_name, in_key, X_BYTES)
    client.register_system_shared_memory(out_name, out_key, 64)
    expected = reference(x)

    result = shm_infer(client, x, in_name, out_name)
    output = result.get_output(OUT)
    # Name, datatype and shape only, as Triton answers. Triton's C++ client reads
    # binary_data_size from any HTTP output that has parameters, and over gRPC reads
    # raw_output_contents[i] for the i-th output unchecked: an empty entry is its due.
    if is_grpc(client):
        assert (output.name, output.datatype, list(output.shape)) == (OUT, "FP32", [1, 2])
        assert not output.parameters
        assert list(result.get_response().raw_output_contents) == [b""]
    else:
        assert output == {"name": OUT, "datatype": "FP32", "shape": [1, 2]}
    got = shm.get_contents_as_numpy(out_handle, np.float32, [1, 2])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    # Input in shared memory, output in the response; the client rewrites its region.
    y = cls_input(2)
    shm.set_shared_memory_region(in_handle, [y])
    result = shm_infer(client, y, in_name, None)
    np.testing.assert_allclose(result.as_numpy(OUT), reference(y), rtol=1e-5, atol=1e-6)

    client.unregister_system_shared_memory()
    assert not held(daemon, in_key) and not held(daemon, out_key)  # no view outlived it


@pytest.mark.integration
def test_cuda_shared_memory_is_answered_as_a_triton_without_gpus(client, daemon: Daemon) -> None:
    """Clients written for Triton (its C++ examples) unregister every CUDA region before they
    start: that succeeds, a status lists none, and a register says there is no GPU."""
    client.unregister_cuda_shared_memory()
    status = client.get_cuda_shared_memory_status()
    assert (not status.regions) if is_grpc(client) else status == []
    with pytest.raises(InferenceServerException, match="GPUs not supported") as err:
        client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 1024)
    assert "system shared memory" in str(err.value)
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory"):
        client.get_cuda_shared_memory_status("gpu")


@pytest.mark.integration
def test_bad_input_is_a_clear_error(client, daemon: Daemon, regions: Regions, reference) -> None:
    x = cls_input(1)
    name, key, handle = regions.create(X_BYTES)
    shm.set_shared_memory_region(handle, [x])
    out_name, out_key, out_handle = regions.create(64)
    sentinel = np.full(16, 7.0, np.float32)
    shm.set_shared_memory_region(out_handle, [sentinel])
    bad = bad_input(client)

    cases = {
        # keys that are no POSIX shm object name
        "path key": (lambda: client.register_system_shared_memory("p", "../x", 16), "../x"),
        "nested key": (lambda: client.register_system_shared_memory("p", "a/b", 16), "a/b"),
        "slash key": (lambda: client.register_system_shared_memory("p", "/a/b", 16), "/a/b"),
        "missing object": (
            lambda: client.register_system_shared_memory("p", "/edged_test_none", 16),
            "no such shared-memory object",
        ),
        "offset past the end": (
            lambda: client.register_system_shared_memory("p", key, 16, offset=X_BYTES),
            "runs past the end",
        ),
        "size past the end": (
            lambda: client.register_system_shared_memory("p", key, X_BYTES + 1),
            "runs past the end",
        ),
        "unknown region": (lambda: shm_infer(client, x, "nope", None), "'nope'"),
        "unregister unknown": (lambda: client.unregister_system_shared_memory("nope"), "'nope'"),
    }
    for what, (call, text) in cases.items():
        status, message = error_of(call)
        assert status == bad and text in message, (what, status, message)
    serves(client, reference)

    client.register_system_shared_memory(name, key, X_BYTES)
    status, message = error_of(lambda: client.register_system_shared_memory(name, key, 16))
    twice = "StatusCode.ALREADY_EXISTS" if is_grpc(client) else "400"  # Triton's codes
    assert status == twice and "already registered" in message
    client.register_system_shared_memory(out_name, out_key, 64)
    mod = module(client)

    # a byte size that does not match the input's shape
    inp = mod.InferInput("x", list(x.shape), "FP32")
    inp.set_shared_memory(name, X_BYTES - 4)
    status, message = error_of(lambda: client.infer("cls", [inp]))
    assert status == bad and "does not match shape" in message, message
    # an input range past the end of its region
    inp.set_shared_memory(name, X_BYTES, offset=4)
    status, message = error_of(lambda: client.infer("cls", [inp]))
    assert status == bad and "runs past the end of region" in message, message
    # an output region too small: refused, nothing written
    status, message = error_of(lambda: shm_infer(client, x, name, out_name, out_size=4))
    assert status == bad and "more than its shared_memory_byte_size 4" in message, message
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [16]), sentinel)
    # an output range past the end of the region
    status, message = error_of(lambda: shm_infer(client, x, name, out_name, out_size=128))
    assert status == bad and "runs past the end of region" in message, message
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [16]), sentinel)
    serves(client, reference)

    client.unregister_system_shared_memory(name)
    status, message = error_of(lambda: client.unregister_system_shared_memory(name))
    assert status == bad and "not registered" in message  # twice
    client.unregister_system_shared_memory()
    assert not held(daemon, key) and not held(daemon, out_key)
    serves(client, reference)


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() == 0, reason="root opens any object")
def test_a_region_the_daemon_cannot_open(daemon: Daemon, regions: Regions) -> None:
    name, key, _ = regions.create(64)
    path = SHM_ROOT / key.lstrip("/")
    path.chmod(0)
    try:
        with th.InferenceServerClient(daemon.address) as c:
            status, message = error_of(lambda: c.register_system_shared_memory(name, key, 64))
    finally:
        path.chmod(0o600)
    assert status == "400" and "permission denied" in message


@pytest.mark.integration
def test_http_shapes(daemon: Daemon, regions: Regions) -> None:
    """Triton's JSON: status is a list of {name, key, offset, byte_size}; a malformed
    register body is a 400 naming the field."""
    import http.client

    name, key, _ = regions.create(64)

    def post(path: str, body: bytes) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(daemon.address, timeout=30)
        try:
            conn.request("POST", path, body=body)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    base = f"/v2/systemsharedmemory/region/{name}"
    assert post(f"{base}/register", b'{"key": "%s"}' % key.encode())[0] == 400
    assert post(f"{base}/register", b'{"key": "%s", "byte_size": -1}' % key.encode())[0] == 400
    assert post(f"{base}/register", b"[1]")[0] == 400
    assert post(f"{base}/register", b'{"key": "%s", "byte_size": 64}' % key.encode()) == (200, b"")
    status, body = get(daemon, f"{base}/status")
    assert (status, json.loads(body)) == (
        200,
        [{"name": name, "key": key, "offset": 0, "byte_size": 64}],
    )
    assert post(f"{base}/unregister", b"") == (200, b"")
    assert json.loads(get(daemon, "/v2/systemsharedmemory/status")[1]) == []


# -- without a daemon ---------------------------------------------------------------------------


def test_keys_name_only_shm_objects() -> None:
    assert check_key("/input0") == "input0" and check_key("input0") == "input0"
    for key in ("", "/", "..", "/..", ".", "a/b", "/a/b", "../x", "/dev/shm/x", "x\0y", 7):
        with pytest.raises(SharedMemoryError) as err:
            check_key(key)
        assert err.value.status == 400
    with pytest.raises(SharedMemoryError, match="longer than"):
        check_key("/" + "x" * 256)


ROOT = Peer("unix", 0, True, "unix")


def test_off_refuses_everything() -> None:
    registry = SharedMemory(enabled=False)
    ref = ShmRef("r", 0, 4)
    calls = [
        lambda: registry.status(ROOT),
        lambda: registry.register(ROOT, "r", "/r", 0, 16),
        lambda: registry.unregister(ROOT),
        lambda: registry.cuda_status(),
        lambda: registry.cuda_unregister(),
        lambda: registry.cuda_register("gpu"),
        lambda: registry.read_input(ROOT, "x", np.dtype("float32"), (1,), ref),
    ]
    for call in calls:
        with pytest.raises(SharedMemoryError, match="allow_shared_memory = false") as err:
            call()
        assert err.value.status == 403


def test_inputs_are_the_daemons_own_copy(regions: Regions) -> None:
    """An input is read into an array of the daemon's (no view of the client's object), so
    it stays valid whatever the client does to its region after."""
    name, key, handle = regions.create(64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
    registry = SharedMemory(enabled=True)
    registry.register(ROOT, name, key, 0, 64)
    x = registry.read_input(ROOT, "x", np.dtype("float32"), (4, 4), ShmRef(name, 0, 64))
    assert x.base is None and x[1, 1] == 5.0
    registry.unregister(ROOT, name)
    assert x[3, 3] == 15.0 and registry.count() == 0


def test_an_object_the_daemon_cannot_open_is_a_400(regions: Regions, monkeypatch) -> None:
    """EACCES (a mode or owner that shuts the daemon's user out; tested here without
    changing users: root opens anything) is a 400 saying so, and nothing is registered."""
    import errno

    from edged.serving import shared_memory

    name, key, _ = regions.create(64)

    def refuse(path, flags, *args):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(shared_memory.os, "open", refuse)
    registry = SharedMemory(enabled=True)
    with pytest.raises(SharedMemoryError, match="permission denied") as err:
        registry.register(ROOT, name, key, 0, 64)
    assert err.value.status == 400 and registry.status(ROOT) == []


def test_http_decoding_of_the_parameters() -> None:
    from edged.serving.protocol import ProtocolError, decode_request

    def body(inputs, outputs=()) -> bytes:
        return json.dumps({"inputs": inputs, "outputs": list(outputs)}).encode()

    region = {"shared_memory_region": "r", "shared_memory_byte_size": 8}
    x = {"name": "x", "shape": [1, 2], "datatype": "FP32", "parameters": region}
    out = {"name": "y", "parameters": {**region, "shared_memory_offset": 16}}
    request = decode_request(body([x], [out]), None, [])
    assert request.inputs == {} and request.binary_outputs == {}
    assert request.shm_inputs["x"][1:] == ((1, 2), ShmRef("r", 0, 8))
    assert request.shm_outputs == {"y": ShmRef("r", 16, 8)}
    bad = {
        "region alone": {"shared_memory_region": "r"},
        "size alone": {"shared_memory_byte_size": 8},
        "negative offset": {**region, "shared_memory_offset": -1},
        "size as text": {"shared_memory_region": "r", "shared_memory_byte_size": "8"},
        "and binary data": {**region, "binary_data_size": 8},
    }
    for what, params in bad.items():
        with pytest.raises(ProtocolError):
            decode_request(body([{**x, "parameters": params}]), None, [])
            raise AssertionError(what)


def test_remote_clients_are_refused() -> None:
    """Over a TCP listener that is not loopback, a peer elsewhere gets 403: a region is
    this machine's memory; a loopback TCP client too, unless [server] tcp_control; a client
    on the Unix socket is served."""
    import asyncio

    from edged.serving.api import Api
    from edged.serving.inference import Inference
    from edged.serving.metrics import ServingMetrics

    api = Api(Inference(dict, ServingMetrics(), shared_memory=SharedMemory(enabled=True)), 1024)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v2/systemsharedmemory/status",
        "headers": [],
        "server": ("0.0.0.0", 8000),
        "client": ("192.0.2.7", 40000),
    }
    asyncio.run(api(scope, receive, send))
    assert sent[0]["status"] == 403 and b"from this machine only" in sent[1]["body"]
    sent.clear()
    asyncio.run(api({**scope, "client": ("127.0.0.1", 40000)}, receive, send))
    assert sent[0]["status"] == 403 and b"tcp_control = false" in sent[1]["body"]
    sent.clear()
    asyncio.run(api({**scope, "server": ("/run/edged/edged.sock", None)}, receive, send))
    assert (sent[0]["status"], sent[1]["body"]) == (200, b"[]")
