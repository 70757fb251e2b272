"""The HTTP API as a plain ASGI application: Open Inference Protocol (KServe v2), /metrics,
and /edged/status for edgectl.

Plain ASGI rather than a framework: the routes are few and fixed, and every framework layer
is added latency on a path whose floor is a few hundred microseconds (see BENCHMARKS.md).
uvicorn (httptools, uvloop) does the HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.tensors import TensorSpec
from edged import __version__
from edged.serving.http_limits import BODY_TIMED_OUT, PEER
from edged.serving.inference import (
    UNKNOWN_MODEL,
    VERSION,
    ClientGone,
    Inference,
    ModelControl,
    RequestError,
    UnknownVersion,
)
from edged.serving.metrics import ServingMetrics
from edged.serving.models import ServedModel, device_used
from edged.serving.peers import Peer, tcp_peer
from edged.serving.protocol import InferRequest, ProtocolError, decode_request, json_decode_bytes
from edged.serving.responses import encode_response, json_output_values, tensor_metadata
from edged.serving.shared_memory import SharedMemory

log = logging.getLogger("edged.serving.api")

JSON = [(b"content-type", b"application/json")]
# Requests with this much JSON (the whole body, or the binary extension's JSON header) are
# decoded in a thread: on the event loop, three 56 MB JSON requests (and their 17 MB JSON
# answers) held a health check for up to 0.9 s and a small inference for 1.9 s. Smaller
# ones stay (a hand-off costs more than decoding 100 kB).
OFFLOAD_JSON_BYTES = 1024 * 1024
OFFLOAD_JSON_VALUES = 128 * 1024  # and responses with this many values as JSON data
MiB = 2**20
# The largest body of a control route (shared-memory register, repository index, load with
# a [[models]] table, unload): a JSON object of a few fields, decoded on the event loop.
CONTROL_BODY_BYTES = 64 * 1024


HttpError = RequestError  # the shared path's error: its status is the HTTP status


class Api:
    def __init__(
        self,
        models: Callable[[], Mapping[str, ServedModel]],
        metrics: ServingMetrics,
        max_body_bytes: int,
        status: Callable[[], dict[str, Any]] | None = None,
        failed: Callable[[], Mapping[str, str]] | None = None,
        reload: Callable[[], None] | None = None,
        max_decode_bytes: int = 256 * MiB,
        shared_memory: SharedMemory | None = None,
        control: ModelControl | None = None,
        tcp_control: bool = False,
    ) -> None:
        self._models = models  # a callable: reload swaps the mapping atomically
        self.metrics = metrics
        # The infer path, model lookup, readiness, statistics, the shared-memory registry
        # and model control, shared with gRPC.
        self.inference = Inference(models, metrics, failed, shared_memory, control, tcp_control)
        self.metrics_names = "edged"  # `[server] metrics_names`: "triton" for Triton's
        self.max_body_bytes = max_body_bytes
        # The most a request's JSON may take to decode (`[server] max_decode_bytes`); such
        # decodes run one at a time (Inference.offload).
        self.max_decode_bytes = max_decode_bytes
        self._status = status
        self._reload = reload

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            if method == "POST" and path.endswith("/infer"):
                await self._infer(scope, receive, send, path)
                return
            if method == "POST" and path == "/edged/reload":
                await self._reload_request(scope, send)
                return
            if path.startswith("/v2/systemsharedmemory/"):
                await self._shared_memory(scope, receive, send, method, path)
                return
            if method == "POST" and path.startswith("/v2/repository/"):
                await self._repository(scope, receive, send, path)
                return
            if method not in ("GET", "HEAD"):
                raise HttpError(405, f"{method} {path} is not supported")
            await self._get(send, path, scope.get("query_string", b""))
        except HttpError as exc:
            await _send_json(send, exc.status, {"error": str(exc)})

    # -- GET routes --------------------------------------------------------------------------
    async def _get(self, send, path: str, query: bytes = b"") -> None:
        parts = [p for p in path.split("/") if p]
        if parts == ["v2", "health", "live"]:
            await _send_json(send, 200, {"live": True})
        elif parts == ["v2", "health", "ready"]:
            ready = self._ready()
            await _send_json(send, 200 if ready else 503, {"ready": ready})
        elif parts == ["v2"]:
            extensions = self.inference.extensions()
            await _send_json(
                send, 200, {"name": "edged", "version": __version__, "extensions": extensions}
            )
        elif parts == ["metrics"]:
            self._update_gauges()
            await _send(
                send,
                200,
                self._metrics_text(_metrics_names(query, self.metrics_names)),
                [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            )
        elif parts == ["edged", "status"]:
            await _send_json(send, 200, self._status() if self._status else {})
        elif parts == ["v2", "models", "stats"]:  # the statistics extension, every model
            await _send_json(send, 200, {"model_stats": self.inference.statistics()})
        elif len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            served, rest = self._model(parts[2:])
            if rest == []:
                await _send_json(send, 200, _metadata(served))
            elif rest == ["ready"]:
                ready = served.worker.alive()
                await _send_json(send, 200 if ready else 503, {"ready": ready})
            elif rest == ["config"]:
                await _send_json(send, 200, _model_config(served))
            elif rest == ["stats"]:
                stats = self.inference.statistics(served.name)
                await _send_json(send, 200, {"model_stats": stats})
            else:
                raise HttpError(404, f"no route {path}")
        else:
            raise HttpError(404, f"no route {path}")

    async def _reload_request(self, scope, send) -> None:
        """Reload like SIGHUP. Only over the Unix socket: its file mode decides who may (any
        local user can reach 127.0.0.1)."""
        server = scope.get("server")
        if server is not None and server[1] is not None:
            raise HttpError(403, "reload is accepted on the Unix socket only")
        if self._reload is None:
            raise HttpError(404, "reload is not available")
        self._reload()
        await _send_json(send, 202, {"reload": "started"})

    async def _shared_memory(self, scope, receive, send, method: str, path: str) -> None:
        """The system shared-memory extension: GET .../status, POST .../register and
        .../unregister, each for /v2/systemsharedmemory[/region/{name}] (Triton's routes
        and JSON; success is 200 with an empty body, as Triton answers). From this machine
        only: a region is this machine's memory."""
        parts = [p for p in path.split("/") if p]
        shm = self.inference.shared_memory
        shm.check_enabled()  # off: said so before anything of the request is read
        peer = self.inference.control_peer(_peer(scope), "system shared memory")
        region = _region_name(parts, path)
        op = (method, parts[-1])
        if op in (("GET", "status"), ("HEAD", "status")):
            await _send_json(send, 200, shm.status(peer, region))
        elif op == ("POST", "unregister"):
            shm.unregister(peer, region)
            await _send(send, 200, b"", JSON)
        elif op == ("POST", "register"):
            if not region:
                raise HttpError(404, f"no route {path} (register names a region)")
            doc = await self._json_body(scope, receive)
            unknown = sorted(set(doc) - {"key", "offset", "byte_size"})
            if unknown:
                raise HttpError(400, f"unknown register field {unknown[0]!r}")
            if "key" not in doc or "byte_size" not in doc:
                raise HttpError(400, "register needs key and byte_size (offset optional)")
            shm.register(peer, region, doc["key"], doc.get("offset", 0), doc["byte_size"])
            await _send(send, 200, b"", JSON)
        elif parts[-1] in ("status", "register", "unregister"):
            raise HttpError(405, f"{method} {path} is not supported")
        else:
            raise HttpError(404, f"no route {path}")

    async def _repository(self, scope, receive, send, path: str) -> None:
        """The repository extension's index, load and unload (Triton's routes and JSON)."""
        parts = [p for p in path.split("/") if p]
        if parts == ["v2", "repository", "index"]:
            doc = await self._json_body(scope, receive)
            ready = doc.get("ready", False)
            if not isinstance(ready, bool):
                raise HttpError(400, "ready must be true or false")
            await _send_json(send, 200, self.inference.repository_index(ready_only=ready))
        elif (
            len(parts) == 5
            and parts[:3] == ["v2", "repository", "models"]
            and parts[4] in ("load", "unload")
        ):
            # Who may is decided before the body is read: a refused client sends nothing in.
            _, peer = self.inference.check_control(_peer(scope), parts[4])
            doc = await self._json_body(scope, receive)
            parameters = doc.get("parameters", {})
            if not isinstance(parameters, dict):
                raise HttpError(400, "parameters must be a JSON object")
            if parts[4] == "load":
                await self.inference.load(parts[3], parameters, peer)
            else:
                await self.inference.unload(parts[3], peer)
            await _send(send, 200, b"", JSON)
        else:
            raise HttpError(404, f"no route {path}")

    async def _json_body(self, scope, receive) -> dict[str, Any]:
        """A control route's body (at most CONTROL_BODY_BYTES) as a JSON object ({} when
        empty). Small enough to decode on the event loop."""
        body = await self._read_body(dict(scope["headers"]), receive, CONTROL_BODY_BYTES)
        if body is None:
            raise ClientGone(0)
        if not body:
            return {}
        try:
            doc = json.loads(body)
        except RecursionError:
            raise HttpError(400, "request JSON is nested too deeply") from None
        except ValueError as exc:
            raise HttpError(400, f"request is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise HttpError(400, "request must be a JSON object")
        return doc

    def _ready(self) -> bool:
        return self.inference.ready()

    def _model(self, parts: list[str]) -> tuple[ServedModel, list[str]]:
        """The model a /v2/models/{name}[/versions/{v}]/... path names, and the rest."""
        name, rest = parts[0], parts[1:]
        served = self.inference.model(name)
        if rest[:1] == ["versions"]:
            if len(rest) < 2 or rest[1] != VERSION:
                raise UnknownVersion(name, rest[1] if len(rest) > 1 else "")
            rest = rest[2:]
        return served, rest

    def _metrics_text(self, names: str) -> bytes:
        """edged's metrics; or under Triton's names (`metrics_names = "triton"`) the request
        metrics, read from the statistics extension's counters, then edged's families that
        Triton has no name for."""
        if names == "triton":
            from edged.serving.metrics import (
                RENAMED_BY_TRITON,
                WithoutFamilies,
                triton_metrics_text,
            )

            triton = triton_metrics_text(
                self.inference.statistics(),
                {n: m.worker.queue_depth for n, m in self._models().items()},
            )
            return triton + generate_latest(
                WithoutFamilies(self.metrics.registry, RENAMED_BY_TRITON)
            )
        return generate_latest(self.metrics.registry)

    def _update_gauges(self) -> None:
        """Scrape-time values read from the workers (which know nothing of Prometheus)."""
        for name, served in self._models().items():
            worker = served.worker
            self.metrics.queue_depth.labels(name).set(worker.queue_depth)
            session = worker.session
            candidate, info = session.candidate, session.info()
            standby = worker.standby
            self.metrics.backend.labels(name).info(
                {
                    "backend": candidate.backend,
                    "device": candidate.device,
                    "device_used": device_used(candidate, info),
                    "precision": str(info.get("precision")),
                    "pick": worker.primary,
                    "standby": standby.candidate.key if standby is not None else "",
                }
            )
            self.metrics.degraded.labels(name).set(1 if worker.degraded else 0)

    # -- infer -------------------------------------------------------------------------------
    async def _infer(self, scope, receive, send, path: str) -> None:
        """The shared infer path (edged.serving.inference) with HTTP's reading: admission
        before the body, so a full queue (counting requests whose bodies are still being read
        or decoded) or a model that is not serving is refused before a byte of the body is
        read, and a flood costs no body memory. The unread rest is uvicorn's to discard:
        after the response is complete it drops further body data and keeps the connection.
        A body that does not arrive in time (edged.serving.http_limits) ends the read as a
        client gone away would, and so gives the slot back."""
        parts = [p for p in path.split("/") if p]
        if len(parts) < 4 or parts[:2] != ["v2", "models"]:
            self.metrics.count(UNKNOWN_MODEL, "404")
            raise HttpError(404, f"no route {path}")
        name = parts[2]
        headers = dict(scope["headers"])

        def model() -> ServedModel:
            served, rest = self._model(parts[2:])
            if rest != ["infer"]:
                raise HttpError(404, f"no route {path}")
            return served

        async def read(served: ServedModel) -> bytes:
            body = await self._read_body(headers, receive)
            if body is None:  # the client went away, or its body timed out (answered)
                raise ClientGone(408 if scope.get(BODY_TIMED_OUT) else 0)
            return body

        async def decode(body: bytes, served: ServedModel) -> InferRequest:
            return await self._decode(body, _header_length(headers), served.session.inputs)

        async def encode(request: InferRequest, outputs) -> tuple[bytes, int | None]:
            return await self._encode(name, request, outputs)

        answer = await self.inference.infer(name, model, read, decode, encode, _peer(scope))
        if answer is None:
            return
        payload, json_length = answer.payload
        extra = (
            []
            if json_length is None
            else [
                (b"inference-header-content-length", str(json_length).encode()),
                (b"content-type", b"application/octet-stream"),
            ]
        )
        await _send(send, 200, payload, extra or JSON)
        answer.sent()

    async def _decode(
        self, body: bytes, header_length: int | None, specs: Sequence[TensorSpec]
    ) -> InferRequest:
        """Small JSON on the event loop; large JSON in a thread, one at a time, within
        max_decode_bytes. Binary tensor data is sliced, not decoded, and stays here whatever
        its size. The request keeps its queue slot (and shows in queue_depth) meanwhile."""
        json_bytes = len(body) if header_length is None else header_length
        if json_bytes < OFFLOAD_JSON_BYTES:
            return decode_request(body, header_length, specs)
        return await self.inference.offload(self._decode_large, body, header_length, specs)

    async def _encode(
        self, name: str, request: InferRequest, outputs: Mapping[str, Any]
    ) -> tuple[bytes, int | None]:
        """Large JSON-data responses in a thread too (binary outputs are one copy)."""
        if json_output_values(request, outputs) < OFFLOAD_JSON_VALUES:
            return encode_response(name, request, outputs)
        return await asyncio.to_thread(encode_response, name, request, outputs)

    def _decode_large(
        self, body: bytes, header_length: int | None, specs: Sequence[TensorSpec]
    ) -> InferRequest:
        """Estimated first, so a request that would take too much memory is refused before
        it takes any."""
        need = json_decode_bytes(body, header_length)
        if need > self.max_decode_bytes:
            raise HttpError(
                413,
                f"JSON tensor data of this request takes about "
                f"{need / MiB:.0f} MiB to decode, over the limit of "
                f"{self.max_decode_bytes / MiB:.0f} MiB ([server] "
                f"max_decode_bytes); send the tensors as binary data "
                f"(binary_data_size)",
            )
        return decode_request(body, header_length, specs)

    async def _read_body(
        self, headers: dict[bytes, bytes], receive, limit: int | None = None
    ) -> bytes | None:
        """The body, one message in the common case (no copy). A body in several messages
        goes into one buffer of the declared size, so a large body is held once rather than
        as chunks plus their join; chunked bodies (no Content-Length) are joined. `limit`:
        the route's own bound, below max_body_bytes (a declared length over it is 413 before
        anything is read or allocated)."""
        if limit is not None and limit < self.max_body_bytes:
            return await _read_small_body(headers, receive, limit)
        declared = headers.get(b"content-length")
        size = None
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise HttpError(400, "Content-Length is not a number") from None
            if size > self.max_body_bytes:
                raise HttpError(
                    413, f"request body of {size} bytes is over the limit of {self.max_body_bytes}"
                )
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        first = message.get("body", b"")
        if not message.get("more_body", False):
            if len(first) > self.max_body_bytes:
                raise HttpError(
                    413, f"request body is over the limit of {self.max_body_bytes} bytes"
                )
            return first
        if size is not None:  # the HTTP parser holds the body to the declared length
            buffer = bytearray(size)
            view = memoryview(buffer)
            total = 0
            while True:
                end = total + len(first)
                if end > size:
                    raise HttpError(400, f"request body is longer than its Content-Length ({size})")
                view[total:end] = first
                total = end
                if not message.get("more_body", False):
                    view.release()
                    if total != size:
                        raise HttpError(
                            400,
                            f"request body of {total} bytes is shorter than "
                            f"its Content-Length ({size})",
                        )
                    return buffer
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                first = message.get("body", b"")
        chunks = [first]
        total = len(first)
        while True:
            if total > self.max_body_bytes:
                raise HttpError(
                    413, f"request body is over the limit of {self.max_body_bytes} bytes"
                )
            if not message.get("more_body", False):
                return b"".join(chunks)
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            chunks.append(chunk)


def _region_name(parts: list[str], path: str) -> str:
    """The region of /v2/systemsharedmemory[/region/{name}]/<op> ("" for all)."""
    if len(parts) == 3:
        return ""
    if len(parts) == 5 and parts[2] == "region":
        return parts[3]
    raise HttpError(404, f"no route {path}")


async def _read_small_body(headers: dict[bytes, bytes], receive, limit: int) -> bytes | None:
    """A body of at most `limit` bytes, read as it comes (chunks joined; nothing allocated for
    what a client merely declares)."""
    declared = headers.get(b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise HttpError(400, "Content-Length is not a number") from None
        if size > limit:
            raise HttpError(413, f"request body of {size} bytes is over this route's {limit}")
    chunks, total = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise HttpError(413, f"request body is over this route's limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _peer(scope) -> Peer:
    """The request's client, as the connection found it (http_limits.PEER); a scope made
    elsewhere (tests calling the app directly) from its addresses."""
    peer = scope.get(PEER)
    if peer is not None:
        return peer
    server = scope.get("server")
    if server is None or server[1] is None:  # uvicorn gives a Unix socket's server port None
        return Peer("unix", None, True, "unix")
    return tcp_peer(scope.get("client"), server)


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(b"inference-header-content-length")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ProtocolError(
            f"Inference-Header-Content-Length {raw.decode(errors='replace')!r} is not a number"
        ) from None


def _metadata(served: ServedModel) -> dict[str, Any]:
    session = served.session
    return {
        "name": served.name,
        "versions": ["1"],
        "platform": served.platform,
        "inputs": tensor_metadata(session.inputs),
        "outputs": tensor_metadata(session.outputs),
    }


def _model_config(served: ServedModel) -> dict[str, Any]:
    batching = served.worker.batching
    return {
        "name": served.name,
        "platform": served.platform,
        "max_batch_size": batching.max_batch_size if served.worker.batchable else 0,
        "dynamic_batching": {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
        },
        "input": tensor_metadata(served.session.inputs),
        "output": tensor_metadata(served.session.outputs),
    }


def _metrics_names(query: bytes, default: str) -> str:
    """`/metrics?names=edged|triton`: one scrape's names, whatever `[server] metrics_names`
    says (edgectl status reads edged's histogram; a dashboard can move over a model at a time)."""
    from urllib.parse import parse_qs

    asked = parse_qs(query.decode("latin-1")).get("names")
    if asked is None:
        return default
    if asked[-1] not in ("edged", "triton"):
        raise HttpError(400, f"/metrics?names={asked[-1]}: names is edged or triton")
    return asked[-1]


async def _send(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_json(send, status: int, doc: Any) -> None:
    await _send(send, status, json.dumps(doc, separators=(",", ":")).encode(), JSON)


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
