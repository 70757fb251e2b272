"""The HTTP API as a plain ASGI application: Open Inference Protocol (KServe v2), /metrics,
and /edged/status for edgectl. The control routes (reload, shared memory, repository) are
edged.serving.http_control's, body reading and responses edged.serving.http_io's.

Plain ASGI rather than a framework: the routes are few and fixed, and every framework layer
is added latency on a path whose floor is a few hundred microseconds (see BENCHMARKS.md).
uvicorn (httptools, uvloop) does the HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.tensors import TensorSpec
from edged import __version__
from edged.serving.http_control import ControlRoutes
from edged.serving.http_deepstack import DeepStackRoutes
from edged.serving.http_io import JSON, lifespan, read_body, request_peer, send_body, send_json
from edged.serving.http_limits import BODY_TIMED_OUT
from edged.serving.inference import (
    UNKNOWN_MODEL,
    VERSION,
    ClientGone,
    Inference,
    RequestError,
    UnknownVersion,
)
from edged.serving.models import ServedModel, device_used
from edged.serving.protocol import InferRequest, ProtocolError, decode_request, json_decode_bytes
from edged.serving.responses import encode_response, json_output_values, tensor_metadata

log = logging.getLogger("edged.serving.api")

# Requests with this much JSON (the whole body, or the binary extension's JSON header) are
# decoded in a thread: on the event loop, three 56 MB JSON requests (and their 17 MB JSON
# answers) held a health check for up to 0.9 s and a small inference for 1.9 s. Smaller
# ones stay (a hand-off costs more than decoding 100 kB).
OFFLOAD_JSON_BYTES = 1024 * 1024
OFFLOAD_JSON_VALUES = 128 * 1024  # and responses with this many values as JSON data
MiB = 2**20


HttpError = RequestError  # the shared path's error: its status is the HTTP status


class Api(ControlRoutes, DeepStackRoutes):
    """The HTTP front end: routes a request to the shared `Inference` (which gRPC's front end
    is handed too) or to the control routes."""

    def __init__(
        self,
        inference: Inference,
        max_body_bytes: int,
        status: Callable[[], dict[str, Any]] | None = None,
        reload: Callable[[], None] | None = None,
        max_decode_bytes: int = 256 * MiB,
        metrics_names: str = "edged",
    ) -> None:
        # The infer path, model lookup, readiness, statistics, the shared-memory registry
        # and model control, shared with gRPC.
        self.inference = inference
        self.metrics = inference.metrics
        self.metrics_names = metrics_names  # `[server] metrics_names`: "triton" for Triton's
        self.max_body_bytes = max_body_bytes
        # The most a request's JSON may take to decode (`[server] max_decode_bytes`); such
        # decodes run one at a time (Inference.offload).
        self.max_decode_bytes = max_decode_bytes
        self._status = status
        self._reload = reload

    def _models(self) -> Mapping[str, ServedModel]:
        return self.inference.models()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            if method == "POST" and path.endswith("/infer"):
                await self._infer(scope, receive, send, path)
                return
            if method == "POST" and path.startswith("/v1/vision/"):
                await self._deepstack(scope, receive, send, path)
                return
            if method == "POST" and path == "/edged/reload":
                await self._reload_request(scope, send)
                return
            if path.startswith(("/v2/systemsharedmemory/", "/v2/cudasharedmemory/")):
                await self._shared_memory(scope, receive, send, method, path)
                return
            if path.endswith("/trace/setting"):
                await self._trace_setting(scope, receive, send, method, path)
                return
            if method == "POST" and path.startswith("/v2/repository/"):
                await self._repository(scope, receive, send, path)
                return
            if method not in ("GET", "HEAD"):
                raise HttpError(405, f"{method} {path} is not supported")
            await self._get(send, path, scope.get("query_string", b""))
        except HttpError as exc:
            await send_json(send, exc.status, {"error": str(exc)}, exc.retry_after)

    # -- GET routes --------------------------------------------------------------------------
    async def _get(self, send, path: str, query: bytes = b"") -> None:
        parts = [p for p in path.split("/") if p]
        if parts == ["v2", "health", "live"]:
            await send_json(send, 200, {"live": True})
        elif parts == ["v2", "health", "ready"]:
            ready = self._ready()
            await send_json(send, 200 if ready else 503, {"ready": ready})
        elif parts == ["v2"]:
            extensions = self.inference.extensions()
            await send_json(
                send, 200, {"name": "edged", "version": __version__, "extensions": extensions}
            )
        elif parts == ["metrics"]:
            self._update_gauges()
            await send_body(
                send,
                200,
                self._metrics_text(_metrics_names(query, self.metrics_names)),
                [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            )
        elif parts == ["edged", "status"]:
            await send_json(send, 200, self._status() if self._status else {})
        elif parts == ["v2", "models", "stats"]:  # the statistics extension, every model
            await send_json(send, 200, {"model_stats": self.inference.statistics()})
        elif len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            served, rest = self._model(parts[2:])
            if rest == []:
                await send_json(send, 200, _metadata(served))
            elif rest == ["ready"]:
                ready = served.worker.alive()
                await send_json(send, 200 if ready else 503, {"ready": ready})
            elif rest == ["config"]:
                await send_json(send, 200, _model_config(served))
            elif rest == ["stats"]:
                stats = self.inference.statistics(served.name)
                await send_json(send, 200, {"model_stats": stats})
            else:
                raise HttpError(404, f"no route {path}")
        else:
            raise HttpError(404, f"no route {path}")

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

        async def read(served: ServedModel) -> bytes | bytearray:
            body = await read_body(headers, receive, self.max_body_bytes)
            if body is None:  # the client went away, or its body timed out (answered)
                raise ClientGone(408 if scope.get(BODY_TIMED_OUT) else 0)
            return body

        async def decode(body: bytes, served: ServedModel) -> InferRequest:
            return await self._decode(body, _header_length(headers), served.session.inputs)

        async def encode(request: InferRequest, outputs) -> tuple[bytes, int | None]:
            return await self._encode(name, request, outputs)

        answer = await self.inference.infer(
            name,
            model,
            read,
            decode,
            encode,
            request_peer(scope),
            "HTTP",
            headers.get(b"traceparent"),
        )
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
        await send_body(send, 200, payload, extra or JSON)
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
