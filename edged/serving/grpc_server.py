"""gRPC front end: the KServe v2 / Triton service `inference.GRPCInferenceService` with
grpcio's asyncio server on the daemon's event loop, over loopback TCP (`[server]
grpc_listen`) and a Unix socket (`[server] grpc_socket`). Inference goes through the same
path as HTTP (`edged.serving.inference`): admission, deadlines, errors, metrics, statistics.

The handlers are grpcio generic handlers over raw bytes, the messages those of
`edged.serving.grpc_messages` (which says why they are declared there). Raw bytes in and out
let a malformed message be INVALID_ARGUMENT (not grpcio's INTERNAL) and the tensors go out
without a second copy (`_raw_outputs`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from edged import __version__
from edged.serving.grpc_messages import (
    ModelConfigRequest,
    ModelConfigResponse,
    ModelInferRequest,
    ModelInferResponse,
    ModelMetadataRequest,
    ModelMetadataResponse,
    ModelReadyRequest,
    ModelReadyResponse,
    ModelStatisticsRequest,
    ModelStatisticsResponse,
    ModelStreamInferResponse,
    RepositoryIndexRequest,
    RepositoryIndexResponse,
    RepositoryModelLoadRequest,
    RepositoryModelLoadResponse,
    RepositoryModelUnloadRequest,
    RepositoryModelUnloadResponse,
    ServerLiveRequest,
    ServerLiveResponse,
    ServerMetadataRequest,
    ServerMetadataResponse,
    ServerReadyRequest,
    ServerReadyResponse,
    SystemSharedMemoryRegisterRequest,
    SystemSharedMemoryRegisterResponse,
    SystemSharedMemoryStatusRequest,
    SystemSharedMemoryStatusResponse,
    SystemSharedMemoryUnregisterRequest,
    SystemSharedMemoryUnregisterResponse,
)
from edged.serving.inference import (
    VERSION,
    Answer,
    Inference,
    RequestError,
    UnknownModel,
)
from edged.serving.models import ServedModel
from edged.serving.peers import GRPC_UNIX, Peer, tcp_peer
from edged.serving.protocol import (
    DATATYPES,
    SHM_PARAMETERS,
    TYPED_FIELDS,
    InferRequest,
    ProtocolError,
    datatype_of,
    dtype_and_shape,
    shm_ref,
    tensor_from_bytes,
    tensor_from_values,
)
from edged.serving.responses import datatype_of_dtype, little_endian, tensor_metadata
from edged.serving.shared_memory import SharedMemory

log = logging.getLogger("edged.serving.grpc")

SERVICE = "inference.GRPCInferenceService"
# Requests of one ModelStreamInfer stream running or answered and not yet read, at most.
STREAM_IN_FLIGHT = 16

# -- errors --------------------------------------------------------------------------------------
# edged's statuses (HTTP's) as gRPC codes, the way Triton maps its errors: its gRPC server's
# GrpcStatusUtil::CodeToStatus (triton-inference-server/server, src/grpc/grpc_utils.cc) turns
# TRITONSERVER_ERROR_INVALID_ARG into INVALID_ARGUMENT, NOT_FOUND into NOT_FOUND, UNAVAILABLE
# into UNAVAILABLE, UNSUPPORTED into UNIMPLEMENTED, INTERNAL into INTERNAL; and its core gives
# those errors as edged has them: an unknown model name is INVALID_ARG ("Request for unknown
# model", core src/model_repository_manager/model_repository_manager.cc), an unknown version
# NOT_FOUND and a model that is not ready UNAVAILABLE (model_lifecycle.cc, GetModel), a full
# queue UNAVAILABLE ("Exceeds maximum queue size"). One departure: a request past its
# deadline is DEADLINE_EXCEEDED (Triton's queue policy says UNAVAILABLE "Request timeout
# expired"): the code the client's own deadline (client_timeout) gives, so one code means
# "too late" whichever side noticed. A body over max_decode_bytes (413) is RESOURCE_EXHAUSTED,
# as grpcio answers a message over the size limit.
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a cap reached ([server] max_models)
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(exc: RequestError) -> grpc.StatusCode:
    if isinstance(exc, UnknownModel):
        return grpc.StatusCode.INVALID_ARGUMENT
    named = getattr(exc, "grpc_code", None)  # an error whose gRPC code is not its status's
    if named is not None:
        return grpc.StatusCode[named]
    return STATUS_CODES.get(exc.status, grpc.StatusCode.UNKNOWN)


# The RPCs of the service that edged does not serve (yet), and why.
# (Repository load/unload and system shared memory are served; off by config, they answer
# PERMISSION_DENIED saying which [server] key turns them on.)
_NOT_SERVED = {
    "CudaSharedMemoryStatus": "CUDA shared memory is not served (edged runs no CUDA devices)",
    "CudaSharedMemoryRegister": "CUDA shared memory is not served (edged runs no CUDA devices)",
    "CudaSharedMemoryUnregister": "CUDA shared memory is not served (edged runs no CUDA devices)",
    "TraceSetting": "trace settings are not served (no trace extension)",
    "LogSettings": "log settings are not served (no logging extension; [server] log_level)",
}

# -- requests and responses -----------------------------------------------------------------------
# Typed contents of this many values are decoded in a thread (Inference.offload), as large
# JSON is on HTTP: numpy reads a protobuf value list one value at a time.
OFFLOAD_VALUES = 128 * 1024


def decode_infer_request(request: Message, remaining_s: float | None) -> InferRequest:
    """A ModelInferRequest as the engine's request: tensors from raw_input_contents (one
    entry per input, in input order) or from typed contents; the requested outputs; the
    deadline from the `timeout` parameter (µs) and the call's own deadline, whichever is
    sooner."""
    raw = request.raw_input_contents
    if not request.inputs:
        raise ProtocolError("request has no inputs")
    refs = [shm_ref(_values(t.parameters), f"inputs[{i}]") for i, t in enumerate(request.inputs)]
    in_request = sum(ref is None for ref in refs)  # the rest are in shared memory
    if raw and len(raw) != in_request:
        raise ProtocolError(
            f"raw_input_contents has {len(raw)} entries for {in_request} inputs "
            f"(one per input not in shared memory, in input order)"
        )
    inputs: dict[str, np.ndarray] = {}
    shm_inputs = {}
    entry = 0
    for index, (tensor, ref) in enumerate(zip(request.inputs, refs, strict=True)):
        where, name = f"inputs[{index}]", tensor.name
        if name in inputs or name in shm_inputs:
            raise ProtocolError(f"{where}: input {name!r} given twice")
        if ref is not None:
            if tensor.HasField("contents"):
                raise ProtocolError(f"input {name!r} is in shared memory and has contents too")
            dtype, dims = dtype_and_shape(tensor.datatype, tensor.shape, where)
            shm_inputs[name] = (dtype, dims, ref)
            continue
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(
                    f"input {name!r} has contents and raw_input_contents: give one of them"
                )
            array = tensor_from_bytes(name, tensor.datatype, tensor.shape, raw[entry], where)
            entry += 1
        else:
            array = _typed_tensor(tensor, where)
        inputs[name] = array
    outputs = {}
    shm_outputs = {}
    for index, out in enumerate(request.outputs):
        ref = shm_ref(_values(out.parameters), f"outputs[{index}]")
        if ref is not None:
            shm_outputs[out.name] = ref
        else:
            outputs[out.name] = True  # always raw_output_contents, as Triton sends them
    timeout_ms = _timeout_ms(request.parameters)
    if remaining_s is not None:
        if remaining_s <= 0:
            raise RequestError(504, "the call's deadline passed before the request was queued")
        timeout_ms = min(timeout_ms or math.inf, remaining_s * 1000.0)
    return InferRequest(
        id=request.id or None,
        inputs=inputs,
        binary_outputs=outputs,
        binary_default=True,
        timeout_ms=timeout_ms,
        shm_inputs=shm_inputs,
        shm_outputs=shm_outputs,
    )


def _values(parameters: Mapping[str, Message]) -> dict[str, Any]:
    """The shared-memory parameters as plain values (whichever oneof field holds each;
    tritonclient sends int64_param)."""
    values: dict[str, Any] = {}
    if not parameters:  # the common case, and a map lookup per key costs
        return values
    for key in SHM_PARAMETERS:
        if key in parameters:
            param = parameters[key]
            choice = param.WhichOneof("parameter_choice")
            values[key] = getattr(param, choice) if choice is not None else None
    return values


def _typed_tensor(tensor: Message, where: str) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    field = TYPED_FIELDS.get(datatype, ("",))[0]
    given = [f.name for f, _ in tensor.contents.ListFields()]
    other = next((g for g in given if g != field), None)
    if other is not None and datatype in DATATYPES:  # (an unknown datatype: its own error)
        expected = f"contents.{field}" if field else "raw_input_contents"
        raise ProtocolError(f"input {name!r}: {datatype} values go in {expected}, not {other}")
    values = getattr(tensor.contents, field) if field else ()
    return tensor_from_values(name, datatype, tensor.shape, values, where)


def _typed_values(request: Message) -> int:
    return sum(len(values) for t in request.inputs for _, values in t.contents.ListFields())


def _timeout_ms(parameters: Mapping[str, Message]) -> float | None:
    if "timeout" not in parameters:
        return None
    param = parameters["timeout"]
    choice = param.WhichOneof("parameter_choice")
    value = getattr(param, choice) if choice in ("int64_param", "uint64_param") else None
    if value is None or value <= 0:
        raise ProtocolError("parameters.timeout must be a positive int64_param (microseconds)")
    return value / 1000.0  # the protocol's timeout is in microseconds; edged's in ms


def encode_infer_response(
    model_name: str, request: InferRequest, outputs: Mapping[str, np.ndarray]
) -> bytes:
    """A serialized ModelInferResponse: the requested outputs (all when none is named) in
    raw_output_contents."""
    named = request.binary_outputs or request.shm_outputs
    wanted = list(request.binary_outputs) if named else list(outputs)
    unknown = [name for name in wanted if name not in outputs]
    if unknown:
        raise ProtocolError(f"unknown output {unknown[0]!r}; outputs are {sorted(outputs)}")
    response = ModelInferResponse(model_name=model_name, model_version=VERSION)
    if request.id is not None:
        response.id = request.id
    data = []
    for name in wanted:
        array = np.asarray(outputs[name])
        response.outputs.add(name=name, datatype=datatype_of_dtype(array.dtype), shape=array.shape)
        data.append(little_endian(array).reshape(-1).view(np.uint8))
    # Outputs written to shared memory after those in raw_output_contents (tritonclient
    # finds an output's raw entry by its index among the outputs), with no data.
    for entry in request.shm_results.values():
        out = response.outputs.add(name=entry["name"], datatype=entry["datatype"])
        out.shape.extend(entry["shape"])
        for key, value in entry["parameters"].items():
            if isinstance(value, str):
                out.parameters[key].string_param = value
            else:
                out.parameters[key].int64_param = value
    return response.SerializeToString() + _raw_outputs(data)


def _raw_outputs(arrays: list[np.ndarray]) -> bytes:
    """raw_output_contents (field 6) written after the rest of the message: the wire format
    of a repeated bytes field is each value as key, length, bytes, and a message's fields may
    come in any order. So each tensor is copied once, into the response, instead of into a
    protobuf bytes field and again into the serialized message."""
    parts: list[Any] = []
    for array in arrays:
        parts += [_key_and_length(6, array.nbytes), memoryview(array)]
    return b"".join(parts)


def _key_and_length(number: int, length: int) -> bytes:
    out = bytearray([number << 3 | 2])  # wire type 2: length-delimited
    while True:
        byte, length = length & 0x7F, length >> 7
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out)


def model_config(served: ServedModel) -> Message:
    """Triton's ModelConfig of a served model. Triton's convention for the dims: a model that
    batches (max_batch_size > 0) leaves the batch dim out of them."""
    worker = served.worker
    batch = worker.batching.max_batch_size if worker.batchable else 0

    def tensors(specs) -> list[dict[str, Any]]:
        return [
            {
                "name": s.name,
                "data_type": f"TYPE_{datatype_of(s.dtype)}",
                "dims": [-1 if d is None else d for d in s.shape][1 if batch else 0 :],
            }
            for s in specs
        ]

    config: dict[str, Any] = {
        "name": served.name,
        "platform": served.platform,
        "backend": worker.session.candidate.backend,
        "max_batch_size": batch,
        "input": tensors(served.session.inputs),
        "output": tensors(served.session.outputs),
    }
    if batch:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(worker.batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": worker.batching.max_queue_delay_us,
        }
    return json_format.ParseDict({"config": config}, ModelConfigResponse())


# -- the service -------------------------------------------------------------------------------


class Service:
    """The RPCs of one listener ("tcp" or "unix"), over the shared Inference. `address`:
    the TCP listener's own (host, port), to tell which user a loopback client is."""

    def __init__(self, inference: Inference, listener: str = "tcp", idle_s: float = 300.0):
        self.inference = inference
        self.listener = listener
        self.idle_s = idle_s  # [server] grpc_idle_timeout_s: a stream idle this long ends
        self.address: tuple[str, int] | None = None

    def peer(self, context) -> Peer:
        """Who calls: the Unix socket's clients are one principal (grpcio tells no peer
        credentials); a TCP client is its address."""
        if self.listener == "unix":
            return GRPC_UNIX
        return grpc_tcp_peer(context.peer() or "", self.address)

    async def ServerLive(self, request: Message, context) -> Message:
        return ServerLiveResponse(live=True)

    async def ServerReady(self, request: Message, context) -> Message:
        return ServerReadyResponse(ready=self.inference.ready())

    async def ModelReady(self, request: Message, context) -> Message:
        """False for a model that is not served (unknown, failed, another version), as
        Triton answers: a readiness probe is no error."""
        try:
            served = self.inference.model(request.name, request.version)
        except RequestError:
            return ModelReadyResponse(ready=False)
        return ModelReadyResponse(ready=served.worker.alive())

    async def ServerMetadata(self, request: Message, context) -> Message:
        extensions = self.inference.extensions()
        return ServerMetadataResponse(name="edged", version=__version__, extensions=extensions)

    async def ModelMetadata(self, request: Message, context) -> Message:
        served = self.inference.model(request.name, request.version)
        session = served.session
        return ModelMetadataResponse(
            name=served.name,
            versions=[VERSION],
            platform=served.platform,
            inputs=tensor_metadata(session.inputs),
            outputs=tensor_metadata(session.outputs),
        )

    async def ModelConfig(self, request: Message, context) -> Message:
        return model_config(self.inference.model(request.name, request.version))

    async def ModelStatistics(self, request: Message, context) -> Message:
        stats = self.inference.statistics(request.name, request.version)
        return json_format.ParseDict({"model_stats": stats}, ModelStatisticsResponse())

    async def RepositoryIndex(self, request: Message, context) -> Message:
        """The configured models (any repository name: edged has one, its config)."""
        index = self.inference.repository_index(ready_only=request.ready)
        return RepositoryIndexResponse(models=index)

    async def RepositoryModelLoad(self, request: Message, context) -> Message:
        """Load with the optional "config" parameter (a string_param or bytes_param of JSON:
        the model's [[models]] table), from this machine only."""
        parameters: dict[str, Any] = {}
        for key, param in request.parameters.items():
            choice = param.WhichOneof("parameter_choice")
            value = getattr(param, choice) if choice is not None else None
            parameters[key] = value.decode(errors="replace") if isinstance(value, bytes) else value
        await self.inference.load(request.model_name, parameters, self.peer(context))
        return RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Message, context) -> Message:
        await self.inference.unload(request.model_name, self.peer(context))
        return RepositoryModelUnloadResponse()

    def _shared_memory(self, context) -> tuple[SharedMemory, Peer]:
        """The registry and the caller, who may use it (a region is this machine's memory)."""
        shm = self.inference.shared_memory
        shm.check_enabled()
        return shm, self.inference.control_peer(self.peer(context), "system shared memory")

    async def SystemSharedMemoryStatus(self, request: Message, context) -> Message:
        shm, peer = self._shared_memory(context)
        regions = shm.status(peer, request.name)
        return SystemSharedMemoryStatusResponse(regions={r["name"]: r for r in regions})

    async def SystemSharedMemoryRegister(self, request: Message, context) -> Message:
        shm, peer = self._shared_memory(context)
        shm.register(peer, request.name, request.key, request.offset, request.byte_size)
        return SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Message, context) -> Message:
        shm, peer = self._shared_memory(context)
        shm.unregister(peer, request.name)
        return SystemSharedMemoryUnregisterResponse()

    async def ModelInfer(self, request: Message, context) -> bytes:
        answer = await self._infer(request, context.time_remaining(), self.peer(context))
        answer.sent()  # counted as answered here: grpcio sends it when the handler returns
        return answer.payload

    async def _infer(
        self, request: Message, remaining_s: float | None, peer: Peer
    ) -> Answer[bytes]:
        inference = self.inference
        name = request.model_name

        async def receive(served: ServedModel) -> Message:
            return request  # whole already: grpcio reads a message before the handler runs

        async def decode(message: Message, served: ServedModel) -> InferRequest:
            if not message.raw_input_contents and _typed_values(message) >= OFFLOAD_VALUES:
                return await inference.offload(decode_infer_request, message, remaining_s)
            return decode_infer_request(message, remaining_s)

        async def encode(infer_request: InferRequest, outputs) -> bytes:
            return encode_infer_response(name, infer_request, outputs)

        answer = await inference.infer(
            name,
            lambda: inference.model(name, request.model_version),
            receive,
            decode,
            encode,
            peer,
        )
        assert answer is not None  # receive never gives up
        return answer

    async def ModelStreamInfer(
        self, requests: AsyncIterator[bytes], context
    ) -> AsyncIterator[bytes]:
        """Each request of the stream is one inference through the same path, answered as it
        completes (so a slow one does not hold the others up); a failure is a response with
        error_message, and the stream goes on, as on Triton. Requests wait in the model's
        queue like any other (a full queue refuses them).

        At most STREAM_IN_FLIGHT requests of a stream are running or answered-but-unread at
        once: past that the stream's requests are not read until the client reads answers
        (HTTP/2 flow control then holds the client), so a client that never reads cannot
        grow the daemon's memory. A stream with nothing running that sends nothing for
        [server] grpc_idle_timeout_s is ended (DEADLINE_EXCEEDED, with the reason)."""
        answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        running: set[asyncio.Task] = set()
        peer = self.peer(context)
        idle: list[str] = []

        async def one(raw: bytes) -> None:
            try:
                answer = await self._infer(_parse(ModelInferRequest, raw), None, peer)
            except RequestError as exc:
                payload = ModelStreamInferResponse(error_message=str(exc)).SerializeToString()
            except Exception as exc:  # never leave the stream waiting for this answer
                log.exception("stream infer failed")
                message = f"internal error: {exc.__class__.__name__}: {exc}"
                payload = ModelStreamInferResponse(error_message=message).SerializeToString()
            else:
                answer.sent()
                # infer_response (field 2) is the encoded ModelInferResponse as it stands
                payload = _key_and_length(2, len(answer.payload)) + answer.payload
            await answers.put(payload)

        async def read() -> None:
            incoming = requests.__aiter__()
            while True:
                await slots.acquire()  # released when an answer is taken off `answers`
                following = asyncio.ensure_future(incoming.__anext__())
                while True:
                    done, _ = await asyncio.wait({following}, timeout=self.idle_s)
                    if done:
                        break
                    if running or not answers.empty():
                        continue  # busy, or the client has answers to read: not idle
                    following.cancel()
                    idle.append(f"stream idle for {self.idle_s:g} s ([server] grpc_idle_timeout_s)")
                    await answers.put(None)
                    return
                try:
                    raw = following.result()
                except StopAsyncIteration:
                    slots.release()
                    break
                task = asyncio.ensure_future(one(raw))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.gather(*running)
            await answers.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (payload := await answers.get()) is not None:
                slots.release()
                yield payload
            if idle:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, idle[0])
            await reader
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    def handler(self) -> grpc.GenericRpcHandler:
        unary = {
            "ServerLive": ServerLiveRequest,
            "ServerReady": ServerReadyRequest,
            "ModelReady": ModelReadyRequest,
            "ServerMetadata": ServerMetadataRequest,
            "ModelMetadata": ModelMetadataRequest,
            "ModelConfig": ModelConfigRequest,
            "ModelStatistics": ModelStatisticsRequest,
            "RepositoryIndex": RepositoryIndexRequest,
            "RepositoryModelLoad": RepositoryModelLoadRequest,
            "RepositoryModelUnload": RepositoryModelUnloadRequest,
            "SystemSharedMemoryStatus": SystemSharedMemoryStatusRequest,
            "SystemSharedMemoryRegister": SystemSharedMemoryRegisterRequest,
            "SystemSharedMemoryUnregister": SystemSharedMemoryUnregisterRequest,
            "ModelInfer": ModelInferRequest,
        }
        methods = {
            rpc: grpc.unary_unary_rpc_method_handler(_unary(getattr(self, rpc), cls))
            for rpc, cls in unary.items()
        }
        methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self.ModelStreamInfer)
        for rpc, why in _NOT_SERVED.items():
            methods[rpc] = grpc.unary_unary_rpc_method_handler(_not_served(why))
        return grpc.method_handlers_generic_handler(SERVICE, methods)


def _parse(cls: type[Message], raw: bytes) -> Message:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise RequestError(400, f"malformed {cls.DESCRIPTOR.name}: {exc}") from None


def _unary(
    method: Callable[[Message, Any], Awaitable[Message | bytes]], cls: type[Message]
) -> Callable[[bytes, Any], Awaitable[bytes]]:
    """A handler over raw bytes: parsed here (malformed is INVALID_ARGUMENT), a RequestError
    as its status code, anything else INTERNAL (and logged)."""

    async def handle(raw: bytes, context) -> bytes:
        try:
            reply = await method(_parse(cls, raw), context)
        except RequestError as exc:
            await context.abort(status_code(exc), str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug: say so, and keep serving
            log.exception("gRPC %s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
        return reply if isinstance(reply, bytes) else reply.SerializeToString()

    return handle


def grpc_tcp_peer(peer: str, server: tuple[str, int] | None) -> Peer:
    """A TCP client from grpcio's peer string: "ipv4:127.0.0.1:5000", or "ipv6:%5B::1%5D:5000"
    (grpcio percent-encodes the brackets)."""
    kind, _, address = urllib.parse.unquote(peer).partition(":")
    host, _, port = address.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return tcp_peer(None, server)
    return tcp_peer((host.strip("[]"), int(port)), server)


def _not_served(why: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
    async def handle(raw: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, why)
        return b""  # not reached: abort raises

    return handle
