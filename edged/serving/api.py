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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.errors import BackendError, InputError
from backends.tensors import TensorSpec
from edged import __version__
from edged.serving.http_limits import BODY_TIMED_OUT
from edged.serving.metrics import ServingMetrics
from edged.serving.models import ServedModel, device_used
from edged.serving.protocol import InferRequest, ProtocolError, decode_request, json_decode_bytes
from edged.serving.requests import EngineError
from edged.serving.responses import encode_response, json_output_values, tensor_metadata

log = logging.getLogger("edged.serving.api")

EXTENSIONS = ["binary_tensor_data", "model_repository(metadata only)", "statistics(metrics)"]
JSON = [(b"content-type", b"application/json")]
UNKNOWN_MODEL = "_unknown"  # the model label of requests for names that are not configured
# Requests with this much JSON (the whole body, or the binary extension's JSON header) are
# decoded in a thread: on the event loop, three 56 MB JSON requests (and their 17 MB JSON
# answers) held a health check for up to 0.9 s and a small inference for 1.9 s. Smaller
# ones stay (a hand-off costs more than decoding 100 kB).
OFFLOAD_JSON_BYTES = 1024 * 1024
OFFLOAD_JSON_VALUES = 128 * 1024  # and responses with this many values as JSON data
MiB = 2**20


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
    ) -> None:
        self._models = models  # a callable: reload swaps the mapping atomically
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        # The most a request's JSON may take to decode (`[server] max_decode_bytes`), and one
        # such decode at a time: they are bound by the GIL, not by cores, so more at once
        # only take it from the event loop more often (and hold more memory).
        self.max_decode_bytes = max_decode_bytes
        self._decoding = asyncio.Lock()
        self._status = status
        self._failed = failed or dict
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
            if method not in ("GET", "HEAD"):
                raise HttpError(405, f"{method} {path} is not supported")
            await self._get(send, path)
        except HttpError as exc:
            await _send_json(send, exc.status, {"error": str(exc)})

    # -- GET routes --------------------------------------------------------------------------
    async def _get(self, send, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        if parts == ["v2", "health", "live"]:
            await _send_json(send, 200, {"live": True})
        elif parts == ["v2", "health", "ready"]:
            ready = self._ready()
            await _send_json(send, 200 if ready else 503, {"ready": ready})
        elif parts == ["v2"]:
            await _send_json(
                send, 200, {"name": "edged", "version": __version__, "extensions": EXTENSIONS}
            )
        elif parts == ["metrics"]:
            self._update_gauges()
            await _send(
                send,
                200,
                generate_latest(self.metrics.registry),
                [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            )
        elif parts == ["edged", "status"]:
            await _send_json(send, 200, self._status() if self._status else {})
        elif len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            served, rest = self._model(parts[2:])
            if rest == []:
                await _send_json(send, 200, _metadata(served))
            elif rest == ["ready"]:
                ready = served.worker.alive()
                await _send_json(send, 200 if ready else 503, {"ready": ready})
            elif rest == ["config"]:
                await _send_json(send, 200, _model_config(served))
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

    def _ready(self) -> bool:
        """Every configured model serves a version. A model whose reload failed but whose old
        version still serves counts as serving; one that never loaded does not."""
        models = self._models()
        return all(name in models for name in self._failed()) and all(
            m.worker.alive() for m in models.values()
        )

    def _model(self, parts: list[str]) -> tuple[ServedModel, list[str]]:
        name, rest = parts[0], parts[1:]
        served = self._models().get(name)
        if served is None:
            reason = self._failed().get(name)
            if reason:
                raise HttpError(503, f"model {name!r} is not loaded: {reason}")
            raise HttpError(404, f"unknown model {name!r}")
        if rest[:1] == ["versions"]:
            if len(rest) < 2 or rest[1] != "1":
                version = rest[1] if len(rest) > 1 else ""
                raise HttpError(404, f"model {name!r} has no version {version!r} (only '1')")
            rest = rest[2:]
        return served, rest

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
        """Admission before the body: a full queue (counting requests whose bodies are still
        being read or decoded) or a model that is not serving is refused before a byte of the
        body is read, so a flood costs no body memory. The unread rest is uvicorn's to
        discard: after the response is complete it drops further body data and keeps the
        connection. A body that does not arrive in time (edged.serving.http_limits) ends the read as
        a client gone away would, and so gives the slot back."""
        start = time.perf_counter()
        parts = [p for p in path.split("/") if p]
        if len(parts) < 4 or parts[:2] != ["v2", "models"]:
            self.metrics.count(UNKNOWN_MODEL, "404")
            raise HttpError(404, f"no route {path}")
        name = parts[2]
        code = 200
        try:
            served, rest = self._model(parts[2:])
            if rest != ["infer"]:
                raise HttpError(404, f"no route {path}")
            worker = served.worker
            worker.check_room()
            headers = dict(scope["headers"])
            worker.admitting += 1
            try:
                body = await self._read_body(headers, receive)
                if body is None:  # the client went away, or its body timed out (answered)
                    code = 408 if scope.get(BODY_TIMED_OUT) else 0
                    return
                request = await self._decode(body, _header_length(headers), served.session.inputs)
                served.check_shapes(request.inputs)
            finally:
                worker.admitting -= 1  # no await before submit: the slot passes to the queue
            outputs, timing = await worker.infer(request.inputs, request.timeout_ms)
            payload, json_length = await self._encode(name, request, outputs)
        except HttpError as exc:
            code = exc.status
            raise
        except (ProtocolError, InputError) as exc:
            code = 400
            raise HttpError(400, str(exc)) from None
        except EngineError as exc:
            code = exc.status
            raise HttpError(exc.status, str(exc)) from None
        except BackendError as exc:
            code = 500
            raise HttpError(500, str(exc)) from None
        finally:
            if code not in (0, 200):  # 200 is counted once the answer is out
                # Unknown names share one label value: a scan of names must not grow the
                # metric without bound. Configured-but-failed models keep their own name.
                label = name if code != 404 or name in self._models() else UNKNOWN_MODEL
                self.metrics.count(label, str(code))
        extra = (
            []
            if json_length is None
            else [
                (b"inference-header-content-length", str(json_length).encode()),
                (b"content-type", b"application/octet-stream"),
            ]
        )
        await _send(send, 200, payload, extra or JSON)
        self.metrics.count(name, "200")
        self.metrics.observe(
            name, timing.queue_s, timing.compute_s, time.perf_counter() - start, timing.batch_size
        )

    async def _decode(
        self, body: bytes, header_length: int | None, specs: Sequence[TensorSpec]
    ) -> InferRequest:
        """Small JSON on the event loop; large JSON in a thread, one at a time, within
        max_decode_bytes. Binary tensor data is sliced, not decoded, and stays here whatever
        its size. The request keeps its queue slot (and shows in queue_depth) meanwhile."""
        json_bytes = len(body) if header_length is None else header_length
        if json_bytes < OFFLOAD_JSON_BYTES:
            return decode_request(body, header_length, specs)
        async with self._decoding:
            return await asyncio.to_thread(self._decode_large, body, header_length, specs)

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

    async def _read_body(self, headers: dict[bytes, bytes], receive) -> bytes | None:
        """The body, one message in the common case (no copy). A body in several messages
        goes into one buffer of the declared size, so a large body is held once rather than
        as chunks plus their join; chunked bodies (no Content-Length) are joined."""
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
