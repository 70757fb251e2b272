"""gRPC front end: the KServe v2 / Triton service `inference.GRPCInferenceService` with
grpcio's asyncio server on the daemon's event loop, over loopback TCP (`[server]
grpc_listen`) and a Unix socket (`[server] grpc_socket`). Inference goes through the same
path as HTTP (`edged.serving.inference`): admission, deadlines, errors, metrics, statistics.

The handlers are grpcio generic handlers over raw bytes, the messages those of
`edged.serving.grpc_messages` (which says why they are declared there). Raw bytes in and out
let a malformed message be INVALID_ARGUMENT (not grpcio's INTERNAL) and the tensors go out
without a second copy (edged.serving.grpc_codec).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from edged import __version__
from edged.serving.grpc_codec import (
    OFFLOAD_VALUES,
    decode_infer_request,
    encode_infer_response,
    key_and_length,
    model_config,
    parse_message,
    typed_value_count,
)
from edged.serving.grpc_messages import (
    CudaSharedMemoryRegisterRequest,
    CudaSharedMemoryStatusRequest,
    CudaSharedMemoryStatusResponse,
    CudaSharedMemoryUnregisterRequest,
    CudaSharedMemoryUnregisterResponse,
    ModelConfigRequest,
    ModelInferRequest,
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
    TraceSettingRequest,
    TraceSettingResponse,
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
    InferRequest,
)
from edged.serving.responses import tensor_metadata
from edged.serving.shared_memory import SharedMemory
from edged.tracing.settings import TraceSettingError

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
    "LogSettings": "log settings are not served (no logging extension; [server] log_level)",
}

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

    # CUDA shared memory as a Triton without GPUs answers it (clients unregister all first).
    async def CudaSharedMemoryStatus(self, request: Message, context) -> Message:
        shm, _ = self._shared_memory(context)
        return CudaSharedMemoryStatusResponse(
            regions={r["name"]: r for r in shm.cuda_status(request.name)}
        )

    async def CudaSharedMemoryRegister(self, request: Message, context) -> Message:
        shm, _ = self._shared_memory(context)
        shm.cuda_register(request.name)  # always refuses: no GPU

    async def CudaSharedMemoryUnregister(self, request: Message, context) -> Message:
        shm, _ = self._shared_memory(context)
        shm.cuda_unregister(request.name)
        return CudaSharedMemoryUnregisterResponse()

    async def TraceSetting(self, request: Message, context) -> Message:
        """The trace extension (as HTTP's /v2[/models/{m}]/trace/setting): an empty value
        list clears a model's own setting; a change only from this machine."""
        inference = self.inference
        model = inference.model(request.model_name).name if request.model_name else None
        if request.settings:
            inference.control_peer(self.peer(context), "changing trace settings")
            changes = {
                key: (
                    None if not v.value else list(v.value) if key == "trace_level" else v.value[0]
                )
                for key, v in request.settings.items()
            }
            try:
                answer = inference.tracer.update(model, changes)
            except TraceSettingError as exc:
                raise RequestError(400, str(exc)) from None
        else:
            answer = inference.tracer.response(model)
        return TraceSettingResponse(
            settings={
                key: {"value": value if isinstance(value, list) else [value]}
                for key, value in answer.items()
            }
        )

    async def ModelInfer(self, request: Message, context) -> bytes:
        answer = await self._infer(
            request, context.time_remaining(), self.peer(context), traceparent(context)
        )
        answer.sent()  # counted as answered here: grpcio sends it when the handler returns
        return answer.payload

    async def _infer(
        self, request: Message, remaining_s: float | None, peer: Peer, parent: str | None = None
    ) -> Answer[bytes]:
        inference = self.inference
        name = request.model_name

        async def receive(served: ServedModel) -> Message:
            return request  # whole already: grpcio reads a message before the handler runs

        async def decode(message: Message, served: ServedModel) -> InferRequest:
            if not message.raw_input_contents and typed_value_count(message) >= OFFLOAD_VALUES:
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
            "GRPC",
            parent,
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
        parent = traceparent(context)  # the stream's: each request on it continues it
        idle: list[str] = []

        async def one(raw: bytes) -> None:
            try:
                answer = await self._infer(
                    parse_message(ModelInferRequest, raw), None, peer, parent
                )
            except RequestError as exc:
                payload = ModelStreamInferResponse(error_message=str(exc)).SerializeToString()
            except Exception as exc:  # never leave the stream waiting for this answer
                log.exception("stream infer failed")
                message = f"internal error: {exc.__class__.__name__}: {exc}"
                payload = ModelStreamInferResponse(error_message=message).SerializeToString()
            else:
                answer.sent()
                # infer_response (field 2) is the encoded ModelInferResponse as it stands
                payload = key_and_length(2, len(answer.payload)) + answer.payload
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
            "CudaSharedMemoryStatus": CudaSharedMemoryStatusRequest,
            "CudaSharedMemoryRegister": CudaSharedMemoryRegisterRequest,
            "CudaSharedMemoryUnregister": CudaSharedMemoryUnregisterRequest,
            "TraceSetting": TraceSettingRequest,
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


def traceparent(context) -> str | None:
    """The caller's W3C traceparent from the call's metadata (edged.tracing reads it)."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value
    return None


def _unary(
    method: Callable[[Message, Any], Awaitable[Message | bytes]], cls: type[Message]
) -> Callable[[bytes, Any], Awaitable[bytes]]:
    """A handler over raw bytes: parsed here (malformed is INVALID_ARGUMENT), a RequestError
    as its status code, anything else INTERNAL (and logged)."""

    async def handle(raw: bytes, context) -> bytes:
        try:
            reply = await method(parse_message(cls, raw), context)
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
