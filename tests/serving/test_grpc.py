"""gRPC (inference.GRPCInferenceService) against the real edged process with an unmodified
tritonclient.grpc, over loopback TCP and the Unix socket: every RPC, outputs equal to
in-process, bad input each with its status code (the daemon serving on after it), the
shared statistics, SIGTERM draining a call; and, without a daemon, the message definitions
against tritonclient's own, the request decoding and the [server] keys."""

from __future__ import annotations

import re
import signal
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from edged.serving import grpc_codec, grpc_messages, grpc_server
from edged.serving.inference import EXTENSIONS
from edged.serving.protocol import ProtocolError, ShmRef
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

HANG_S = 1.0  # onnxruntime's stand-in hang on a request whose first value is HANG_MARK
MAX_BODY = 1_000_000


def models_toml(models_dir: Path) -> str:
    # onnxruntime for cls, so the in-process reference is the same runtime and the hang
    # stand-in applies; a queue of 2 so that one hang fills it.
    cls = cls_table(
        models_dir, max_batch_size=4, max_queue_delay_us=200, max_queue_size=2, timeout_ms=5000
    )
    return f"""{cls}
[[models]]
name = "face"
path = "{models_dir / "face_detection_short_range.tflite"}"
backend = "litert"
threads = 1
"""


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("grpc")
    config = write_config(folder, models_toml(models_dir), f"max_body_bytes = {MAX_BODY}")
    d = Daemon(config, hang_s=HANG_S).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()
    assert not (folder / "grpc.sock").exists()  # removed at stop, as the HTTP socket is


@pytest.fixture(scope="module")
def urls(daemon: Daemon) -> dict[str, str]:
    return {
        "tcp": f"127.0.0.1:{grpc_port(daemon)}",
        "unix": f"unix://{daemon.config.parent / 'grpc.sock'}",  # unix:///abs/path
    }


@pytest.fixture(params=["tcp", "unix"])
def client(request, urls: dict[str, str]) -> tg.InferenceServerClient:
    with tg.InferenceServerClient(urls[request.param]) as c:
        yield c


def infer_input(x: np.ndarray, name: str = "x", datatype: str = "FP32") -> tg.InferInput:
    inp = tg.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


@pytest.fixture(scope="module")
def reference(models_dir: Path):
    import onnxruntime as ort

    session = ort.InferenceSession(str(models_dir / "ppocr_cls.onnx"))
    return lambda x: session.run(None, {"x": x})[0]


# -- against the daemon ---------------------------------------------------------------------------


@pytest.mark.integration
def test_health_metadata_and_config(client: tg.InferenceServerClient, daemon: Daemon) -> None:
    import json

    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert (meta.name, list(meta.extensions)) == ("edged", EXTENSIONS)
    assert json.loads(get(daemon, "/v2")[1])["extensions"] == EXTENSIONS  # one list for both
    assert client.is_model_ready("cls") and client.is_model_ready("cls", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("cls", "2")
    # Model metadata is HTTP's, field for field.
    grpc_meta = client.get_model_metadata("cls", as_json=True)
    http_meta = json.loads(get(daemon, "/v2/models/cls")[1])
    for doc in (grpc_meta, http_meta):
        for tensor in doc["inputs"] + doc["outputs"]:
            tensor["shape"] = [int(d) for d in tensor["shape"]]  # proto3 JSON: int64 as text
    assert grpc_meta == http_meta
    assert grpc_meta["platform"] == "onnxruntime_onnx"
    assert client.get_model_metadata("face").inputs[0].shape == [1, 128, 128, 3]
    # Triton's config: a batching model's dims leave the batch dim out.
    config = client.get_model_config("cls").config
    assert (config.name, config.max_batch_size, config.backend) == ("cls", 4, "onnxruntime")
    [x] = config.input
    assert (x.name, x.data_type, list(x.dims)[:1]) == ("x", 11, [3])  # TYPE_FP32
    assert config.dynamic_batching.max_queue_delay_microseconds == 200
    face = client.get_model_config("face").config
    assert face.max_batch_size == 0 and list(face.input[0].dims) == [1, 128, 128, 3]
    assert not face.HasField("dynamic_batching")


@pytest.mark.integration
def test_infer_matches_in_process(client: tg.InferenceServerClient, reference) -> None:
    for seed in range(3):
        x = cls_input(seed)
        result = client.infer("cls", [infer_input(x)], request_id=f"r{seed}")
        got = result.as_numpy(OUT)
        assert got.dtype == np.float32 and got.shape == (1, 2)
        np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-6)
        response = result.get_response()
        assert (response.model_name, response.model_version, response.id) == (
            "cls",
            "1",
            f"r{seed}",
        )
    # Named outputs only; an unknown one is the request's fault.
    named = client.infer("cls", [infer_input(x)], outputs=[tg.InferRequestedOutput(OUT)])
    assert [o.name for o in named.get_response().outputs] == [OUT]
    code, message = status_of(
        lambda: client.infer("cls", [infer_input(x)], outputs=[tg.InferRequestedOutput("y")])
    )
    assert code == "StatusCode.INVALID_ARGUMENT" and "unknown output 'y'" in message


@pytest.mark.integration
def test_grpc_and_http_give_the_same_outputs(
    client: tg.InferenceServerClient, daemon: Daemon
) -> None:
    import tritonclient.http as th

    frame = np.random.default_rng(1).uniform(-1, 1, (1, 128, 128, 3)).astype(np.float32)
    grpc_result = client.infer("face", [infer_input(frame, "input")])
    http_input = th.InferInput("input", list(frame.shape), "FP32")
    http_input.set_data_from_numpy(frame)
    http_result = th.InferenceServerClient(daemon.address).infer("face", [http_input])
    for name in ("regressors", "classificators"):
        np.testing.assert_array_equal(grpc_result.as_numpy(name), http_result.as_numpy(name))


@pytest.mark.integration
def test_typed_contents(urls: dict[str, str], reference) -> None:
    """Tensors as typed values (InferTensorContents) rather than raw bytes, through
    tritonclient's own generated stub and messages."""
    import grpc

    x = cls_input(3)
    with grpc.insecure_channel(urls["tcp"]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="cls")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=x.shape)
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
        response = stub.ModelInfer(request)
        [out] = response.outputs
        got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(out.shape)
        np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-6)
        tensor.contents.ClearField("fp32_contents")
        tensor.contents.fp64_contents.extend(x.ravel().tolist())
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "FP32 values go in contents.fp32_contents, not fp64_contents" in err.value.details()
        # Bytes that are no ModelInferRequest: INVALID_ARGUMENT, not grpcio's INTERNAL.
        raw_call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            raw_call(b"\x0a\x05ab")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ModelInferRequest" in err.value.details()


@pytest.mark.integration
def test_bad_requests_get_their_status_codes(client: tg.InferenceServerClient) -> None:
    """Each a clear error with Triton's code (edged.serving.grpc_server.STATUS_CODES); the
    daemon answers the next good request."""
    x = cls_input()
    good = [infer_input(x)]
    cases = [
        (lambda: client.infer("nope", good), "INVALID_ARGUMENT", "unknown model 'nope'"),
        (lambda: client.get_model_metadata("nope"), "INVALID_ARGUMENT", "unknown model"),
        (lambda: client.get_model_config("nope"), "INVALID_ARGUMENT", "unknown model"),
        (
            lambda: client.infer("cls", good, model_version="2"),
            "NOT_FOUND",
            "has no version '2'",
        ),
        (
            lambda: client.infer("cls", [infer_input(x, "image")]),
            "INVALID_ARGUMENT",
            "unknown input 'image'",
        ),
        (
            lambda: client.infer("cls", [infer_input(x.astype(np.float64), datatype="FP64")]),
            "INVALID_ARGUMENT",
            "dtype float64, expected float32",
        ),
        (
            lambda: client.infer("cls", [infer_input(x[:, :, :24])]),
            "INVALID_ARGUMENT",
            "this model is served at",
        ),
        (
            # 1.15 MB: over max_body_bytes, refused by grpcio before any handler runs
            lambda: client.infer("cls", [infer_input(np.zeros((1, 3, 48, 2000), np.float32))]),
            "RESOURCE_EXHAUSTED",
            "larger than max",
        ),
    ]
    for call, code, text in cases:
        got_code, message = status_of(call)
        assert (got_code, text in message) == (f"StatusCode.{code}", True), message
        assert client.infer("cls", good).as_numpy(OUT).shape == (1, 2)


@pytest.mark.integration
def test_deadlines_and_a_full_queue(client: tg.InferenceServerClient) -> None:
    """A hung backend (HANG_S): the client's own deadline, the request's `timeout` parameter
    and a full queue, each its code; then the daemon serves again."""
    hang = cls_input()
    hang.flat[0] = HANG_MARK
    x = cls_input(1)
    start = time.monotonic()
    code, _ = status_of(lambda: client.infer("cls", [infer_input(hang)], client_timeout=0.3))
    assert code == "StatusCode.DEADLINE_EXCEEDED"
    assert time.monotonic() - start < HANG_S
    # The worker is still inside the hang: this one's own deadline passes in the queue.
    code, message = status_of(lambda: client.infer("cls", [infer_input(x)], timeout=200_000))
    assert code == "StatusCode.DEADLINE_EXCEEDED" and "deadline passed" in message
    time.sleep(HANG_S)  # the hang is over

    results: list = []
    done = threading.Semaphore(0)

    def callback(result, error) -> None:
        results.append(error or result)
        done.release()

    client.async_infer("cls", [infer_input(hang)], callback)
    time.sleep(0.2)  # running, and hung: the queue fills behind it
    flood = 12
    for _ in range(flood):
        client.async_infer("cls", [infer_input(x)], callback)
    for _ in range(flood + 1):
        assert done.acquire(timeout=30)
    refused = [r for r in results if isinstance(r, InferenceServerException)]
    assert refused and len(refused) < flood, results
    for error in refused:
        assert error.status() == "StatusCode.UNAVAILABLE" and "queue full" in error.message()
    assert client.infer("cls", [infer_input(x)]).as_numpy(OUT).shape == (1, 2)


@pytest.mark.integration
def test_stream_infer(client: tg.InferenceServerClient, reference) -> None:
    """ModelStreamInfer: one answer per request, an error as a response in the stream,
    which goes on."""
    answers: dict[str, object] = {}
    done = threading.Semaphore(0)

    def callback(result, error) -> None:
        if error is not None:
            answers[f"error{len(answers)}"] = error
        else:
            answers[result.get_response().id] = result.as_numpy(OUT)
        done.release()

    inputs = {f"s{i}": cls_input(i) for i in range(3)}
    client.start_stream(callback)
    try:
        for request_id, x in inputs.items():
            client.async_stream_infer("cls", [infer_input(x)], request_id=request_id)
        client.async_stream_infer("nope", [infer_input(inputs["s0"])], request_id="bad")
        for _ in range(len(inputs) + 1):
            assert done.acquire(timeout=30)
        client.async_stream_infer("cls", [infer_input(inputs["s1"])], request_id="after")
        assert done.acquire(timeout=30)
    finally:
        client.stop_stream()
    for request_id, x in inputs.items():
        np.testing.assert_allclose(answers[request_id], reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(answers["after"], answers["s1"])
    [error] = [a for key, a in answers.items() if key.startswith("error")]
    assert "unknown model 'nope'" in str(error)


@pytest.mark.integration
def test_statistics_count_both_front_ends(client: tg.InferenceServerClient, daemon: Daemon) -> None:
    import tritonclient.http as th

    def stats() -> dict:
        [model] = client.get_inference_statistics("cls", as_json=True)["model_stats"]
        return model

    def count(model: dict, phase: str) -> int:
        return int(model["inference_stats"][phase].get("count", 0))

    before = stats()
    x = cls_input()
    http = th.InferenceServerClient(daemon.address)
    http_input = th.InferInput("x", list(x.shape), "FP32")
    http_input.set_data_from_numpy(x)
    for _ in range(2):
        client.infer("cls", [infer_input(x)])
        http.infer("cls", [http_input])
    status_of(lambda: client.infer("cls", [infer_input(x[:, :, :24])]))  # a failure
    after = stats()
    for phase in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert count(after, phase) == count(before, phase) + 4, (phase, after)
        assert int(after["inference_stats"][phase]["ns"]) > 0
    assert count(after, "fail") == count(before, "fail") + 1
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 4
    assert int(after["execution_count"]) > int(before.get("execution_count", 0))
    assert int(after["last_inference"]) > time.time() * 1000 - 60_000
    assert {b["batch_size"] for b in after["batch_stats"]} >= {"1"}
    # HTTP's statistics extension: the same counters in Triton's JSON.
    [http_model] = http.get_inference_statistics("cls")["model_stats"]
    assert http_model["inference_stats"]["success"]["count"] == count(after, "success")
    assert set(http_model) >= {"name", "version", "inference_count", "batch_stats"}
    everything = client.get_inference_statistics(as_json=True)["model_stats"]
    assert [m["name"] for m in everything] == ["cls", "face"]
    code, _ = status_of(lambda: client.get_inference_statistics("nope"))
    assert code == "StatusCode.INVALID_ARGUMENT"
    # And the Prometheus metrics the HTTP path keeps: gRPC requests are counted there too.
    metrics = get(daemon, "/metrics")[1].decode()
    assert re.search(r'edged_requests_total\{code="200",model="cls"\} \d+', metrics)
    assert re.search(r'edged_requests_total\{code="404",model="_unknown"\} \d+', metrics)


@pytest.mark.integration
def test_repository_index_and_what_is_not_served(client: tg.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert [(m.name, m.version, m.state) for m in index.models] == [
        ("cls", "1", "READY"),
        ("face", "1", "READY"),
    ]
    # Off by default ([server] model_control, allow_shared_memory): refused, naming the key.
    off = {
        "load": (lambda: client.load_model("cls"), "model_control"),
        "unload": (lambda: client.unload_model("cls"), "model_control"),
        "shm status": (lambda: client.get_system_shared_memory_status(), "allow_shared_memory"),
        "shm register": (
            lambda: client.register_system_shared_memory("r", "/r", 16),
            "allow_shared_memory",
        ),
        "shm unregister": (lambda: client.unregister_system_shared_memory(), "allow_shared_memory"),
        "cuda shm status": (lambda: client.get_cuda_shared_memory_status(), "allow_shared_memory"),
        "cuda shm unregister": (
            lambda: client.unregister_cuda_shared_memory(),
            "allow_shared_memory",
        ),
    }
    for what, (call, text) in off.items():
        code, message = status_of(call)
        assert code == "StatusCode.PERMISSION_DENIED" and text in message, what
    x = cls_input()
    shm_input = infer_input(x)
    shm_input.set_shared_memory("r", x.nbytes)
    code, message = status_of(lambda: client.infer("cls", [shm_input]))
    assert code == "StatusCode.PERMISSION_DENIED" and "allow_shared_memory" in message
    assert "cls" in [m.name for m in client.get_model_repository_index().models]  # not unloaded
    assert client.is_server_ready()


@pytest.mark.integration
def test_http_extensions_off_by_default(daemon: Daemon) -> None:
    """HTTP's side of the same: refused (403, naming the key), and not listed."""
    import http.client
    import json

    def post(path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection(daemon.address, timeout=30)
        try:
            conn.request("POST", path, body=b"{}")
            response = conn.getresponse()
            return response.status, json.loads(response.read())["error"]
        finally:
            conn.close()

    for path in ("/v2/repository/models/cls/load", "/v2/repository/models/cls/unload"):
        status, error = post(path)
        assert status == 403 and "model_control" in error, path
    for path in ("/v2/systemsharedmemory/region/r/register", "/v2/systemsharedmemory/unregister"):
        status, error = post(path)
        assert status == 403 and "allow_shared_memory" in error, path
    status, body = get(daemon, "/v2/systemsharedmemory/status")
    assert status == 403 and b"allow_shared_memory" in body
    extensions = json.loads(get(daemon, "/v2")[1])["extensions"]
    assert extensions == EXTENSIONS and "system_shared_memory" not in extensions
    assert get(daemon, "/v2/models/cls/ready")[0] == 200


@pytest.mark.integration
def test_socket_mode(daemon: Daemon) -> None:
    sock = daemon.config.parent / "grpc.sock"
    assert stat.S_ISSOCK(sock.lstat().st_mode)
    assert stat.S_IMODE(sock.lstat().st_mode) == 0o660  # [server] socket_mode
    assert not list(daemon.config.parent.glob(".grpc.sock.*"))  # bound, then renamed


@pytest.mark.integration
def test_sigterm_drains_a_running_call(daemon: Daemon, urls: dict[str, str]) -> None:
    """Last in this module: it stops the module's daemon. A call running at SIGTERM is
    answered, then the daemon exits 0 (the fixture checks the socket file is gone)."""
    hang = cls_input()
    hang.flat[0] = HANG_MARK
    results: list = []
    done = threading.Event()
    client = tg.InferenceServerClient(urls["unix"])
    client.async_infer(
        "cls",
        [infer_input(hang)],
        lambda result, error: (results.append(error or result), done.set()),
    )
    time.sleep(0.2)
    daemon.signal(signal.SIGTERM)
    assert done.wait(30)
    assert not isinstance(results[0], Exception), results
    assert results[0].as_numpy(OUT).shape == (1, 2)
    assert daemon.proc.wait(30) == 0
    client.close()


# -- without a daemon ------------------------------------------------------------------------------


def test_messages_match_tritonclients() -> None:
    """Every field edged declares has the number, type, label and message type of
    tritonclient's generated definition (the same wire format), and every RPC of the service
    is handled, served or refused with a reason."""
    from google.protobuf import descriptor_pool

    theirs = descriptor_pool.Default()  # tritonclient's modules registered there on import
    for name, cls in grpc_messages.MESSAGES.items():
        ours = cls.DESCRIPTOR
        other = theirs.FindMessageTypeByName(f"inference.{name}")
        for field in ours.fields:
            match = other.fields_by_name.get(field.name)
            assert match is not None, f"{name}.{field.name}"
            assert (field.number, field.type, field.is_repeated) == (
                match.number,
                match.type,
                match.is_repeated,
            ), f"{name}.{field.name}"
            if field.message_type is not None:
                assert field.message_type.full_name == match.message_type.full_name
            if field.enum_type is not None:
                assert [v.name for v in field.enum_type.values][: len(match.enum_type.values)] == [
                    v.name for v in match.enum_type.values
                ]
            if field.containing_oneof is not None:
                assert field.containing_oneof.name == match.containing_oneof.name
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handled = set(grpc_server._NOT_SERVED) | {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
        "TraceSetting",
    }
    assert {m.name for m in service.methods} == handled


def _decode(request: service_pb2.ModelInferRequest, remaining_s: float | None = None):
    """tritonclient's message, as edged parses and decodes it."""
    ours = grpc_messages.ModelInferRequest.FromString(request.SerializeToString())
    return grpc_codec.decode_infer_request(ours, remaining_s)


def test_decode_raw_and_typed_inputs() -> None:
    request = service_pb2.ModelInferRequest(model_name="m", id="7")
    request.inputs.add(name="a", datatype="INT8", shape=[2, 2]).contents.int_contents.extend(
        [1, -2, 3, 127]
    )
    request.inputs.add(name="b", datatype="BOOL", shape=[3]).contents.bool_contents.extend(
        [True, False, True]
    )
    request.outputs.add(name="y")
    request.parameters["timeout"].int64_param = 250_000  # µs
    decoded = _decode(request)
    assert decoded.inputs["a"].dtype == np.int8 and decoded.inputs["a"].tolist() == [
        [1, -2],
        [3, 127],
    ]
    assert decoded.inputs["b"].tolist() == [True, False, True]
    assert (decoded.id, decoded.binary_outputs, decoded.timeout_ms) == ("7", {"y": True}, 250.0)
    assert _decode(request, remaining_s=0.1).timeout_ms == pytest.approx(100.0)

    raw = service_pb2.ModelInferRequest(model_name="m")
    raw.inputs.add(name="h", datatype="FP16", shape=[2])
    raw.raw_input_contents.append(np.array([1.5, -2], "<f2").tobytes())
    assert _decode(raw).inputs["h"].tolist() == [1.5, -2.0]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda r: r.inputs.add(
                name="a", datatype="INT8", shape=[1]
            ).contents.int_contents.append(300),
            "values outside [-128, 127] for INT8",
        ),
        (
            lambda r: r.inputs.add(
                name="a", datatype="FP16", shape=[1]
            ).contents.fp32_contents.append(1.0),
            "FP16 values go in raw_input_contents, not fp32_contents",
        ),
        (
            lambda r: r.inputs.add(
                name="a", datatype="FP32", shape=[3]
            ).contents.fp32_contents.append(1.0),
            "1 values for shape [3] (3 expected)",
        ),
        (
            lambda r: r.inputs.add(name="a", datatype="BYTES", shape=[1]),
            "0 BYTES element(s), its shape [1] needs 1",
        ),
        (lambda r: r.inputs.add(name="a", datatype="FP32", shape=[-1]), "non-negative"),
        (lambda r: None, "request has no inputs"),
    ],
)
def test_decode_refuses(build, message: str) -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    build(request)
    with pytest.raises(ProtocolError, match=re.escape(message)):
        _decode(request)


def test_decode_refuses_raw_mismatches_and_shared_memory() -> None:
    two = service_pb2.ModelInferRequest(model_name="m")
    two.inputs.add(name="a", datatype="FP32", shape=[1])
    two.inputs.add(name="b", datatype="FP32", shape=[1])
    two.raw_input_contents.append(b"\0" * 4)
    with pytest.raises(ProtocolError, match="1 entries for 2 inputs"):
        _decode(two)
    two.raw_input_contents.append(b"\0" * 8)
    with pytest.raises(ProtocolError, match="8 bytes of raw contents do not match shape"):
        _decode(two)
    shm = service_pb2.ModelInferRequest(model_name="m")
    shm.inputs.add(name="a", datatype="FP32", shape=[1]).parameters[
        "shared_memory_region"
    ].string_param = "r"
    with pytest.raises(ProtocolError, match="shared_memory_byte_size go together"):
        _decode(shm)
    shm.inputs[0].parameters["shared_memory_byte_size"].int64_param = 4
    shm.inputs.add(name="b", datatype="FP32", shape=[1])
    shm.raw_input_contents.append(b"\0" * 4)  # one entry: for the input not in shm
    decoded = _decode(shm)
    assert list(decoded.inputs) == ["b"]
    assert decoded.shm_inputs["a"][1:] == ((1,), ShmRef("r", 0, 4))
    shm.raw_input_contents.append(b"\0" * 4)
    with pytest.raises(ProtocolError, match="2 entries for 1 inputs"):
        _decode(shm)
    bad_timeout = service_pb2.ModelInferRequest(model_name="m")
    bad_timeout.inputs.add(name="a", datatype="FP32", shape=[0])
    bad_timeout.raw_input_contents.append(b"")
    bad_timeout.parameters["timeout"].string_param = "soon"
    with pytest.raises(ProtocolError, match="timeout must be a positive int64_param"):
        _decode(bad_timeout)


def test_response_is_tritonclients_message() -> None:
    """The response, raw_output_contents written after the rest, parses as tritonclient's
    ModelInferResponse."""
    from edged.serving.protocol import InferRequest

    outputs = {
        "y": np.arange(6, dtype=np.float32).reshape(2, 3),
        "flag": np.array(True),
        "big": np.ones(300, np.int64),  # a length that takes two varint bytes
    }
    request = InferRequest(id="q", inputs={}, binary_outputs={"flag": True, "y": True, "big": True})
    data = grpc_codec.encode_infer_response("m", request, outputs)
    response = service_pb2.ModelInferResponse.FromString(data)
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "q")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("flag", "BOOL", []),
        ("y", "FP32", [2, 3]),
        ("big", "INT64", [300]),
    ]
    assert response.raw_output_contents[0] == b"\x01"
    assert np.frombuffer(response.raw_output_contents[1], np.float32).tolist() == list(range(6))
    assert np.frombuffer(response.raw_output_contents[2], np.int64).sum() == 300
    with pytest.raises(ProtocolError, match="unknown output 'z'"):
        grpc_codec.encode_infer_response(
            "m", InferRequest(id=None, inputs={}, binary_outputs={"z": True}), outputs
        )


def test_grpc_keys(tmp_path: Path) -> None:
    from edged.config import ConfigError, load_config

    def server(text: str):
        (tmp_path / "edged.toml").write_text(f"[server]\n{text}\n")
        return load_config(tmp_path / "edged.toml").server

    default = server("")
    assert (default.grpc_listen_host, default.grpc_listen_port) == ("127.0.0.1", 8001)
    assert default.grpc_socket == Path("/run/edged/grpc.sock")
    follows = server('listen = "[::1]:9000"\nsocket = "/tmp/e/api.sock"')
    assert (follows.grpc_listen_host, follows.grpc_listen_port) == ("::1", 9001)
    assert follows.grpc_socket == Path("/tmp/e/grpc.sock")
    assert server('listen = "127.0.0.1:0"').grpc_listen_port == 0
    assert server('listen = "127.0.0.1:65535"').grpc_listen_port == 65534
    off = server('grpc_listen = ""\ngrpc_socket = ""')
    assert (off.grpc_listen_host, off.grpc_socket) == (None, None)
    assert server('listen = ""').grpc_listen_host is None  # no TCP: none for gRPC either
    given = server(f'grpc_listen = "0.0.0.0:7001"\ngrpc_socket = "{tmp_path}/g.sock"')
    assert (given.grpc_listen_host, given.grpc_listen_port, given.grpc_socket) == (
        "0.0.0.0",
        7001,
        tmp_path / "g.sock",
    )
    for text, key, problem in [
        ('grpc_listen = "8001"', "server.grpc_listen", "expected HOST:PORT"),
        (
            'listen = "127.0.0.1:9"\ngrpc_listen = "127.0.0.1:9"',
            "server.grpc_listen",
            "is server.listen",
        ),
        (
            f'socket = "{tmp_path}/s"\ngrpc_socket = "{tmp_path}/s"',
            "server.grpc_socket",
            "is server.socket",
        ),
        (f'grpc_socket = "/{"x" * 120}"', "server.grpc_socket", "at most 107"),
    ]:
        with pytest.raises(ConfigError) as err:
            server(text)
        assert err.value.key == key and problem in str(err.value), str(err.value)
