"""The HTTP front end's control routes: reload (like SIGHUP), Triton's system shared-memory
extension and its repository extension (index, load, unload). Who may is decided before a
body is read (edged.serving.inference's control checks); a control body is a small JSON
object, at most CONTROL_BODY_BYTES, decoded on the event loop. Mixed into edged.serving.api's
Api, whose infer and read-only routes are its own."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from edged.serving.http_io import JSON, read_body, request_peer, send_body, send_json
from edged.serving.inference import ClientGone, Inference
from edged.serving.inference import RequestError as HttpError
from edged.tracing.settings import TraceSettingError

# The largest body of a control route (shared-memory register, repository index, load with
# a [[models]] table, unload): a JSON object of a few fields, decoded on the event loop.
CONTROL_BODY_BYTES = 64 * 1024


class ControlRoutes:
    inference: Inference
    max_body_bytes: int
    _reload: Callable[[], None] | None

    async def _reload_request(self, scope, send) -> None:
        """Reload like SIGHUP. Only over the Unix socket: its file mode decides who may (any
        local user can reach 127.0.0.1)."""
        server = scope.get("server")
        if server is not None and server[1] is not None:
            raise HttpError(403, "reload is accepted on the Unix socket only")
        if self._reload is None:
            raise HttpError(404, "reload is not available")
        self._reload()
        await send_json(send, 202, {"reload": "started"})

    async def _shared_memory(self, scope, receive, send, method: str, path: str) -> None:
        """The system shared-memory extension: GET .../status, POST .../register and
        .../unregister, each for /v2/systemsharedmemory[/region/{name}] (Triton's routes
        and JSON; success is 200 with an empty body, as Triton answers). From this machine
        only: a region is this machine's memory."""
        parts = [p for p in path.split("/") if p]
        shm = self.inference.shared_memory
        shm.check_enabled()  # off: said so before anything of the request is read
        peer = self.inference.control_peer(request_peer(scope), "system shared memory")
        region = region_name(parts, path)
        op = (method, parts[-1])
        if parts[1] == "cudasharedmemory":
            await self._cuda_shared_memory(send, op, region, path)
            return
        if op in (("GET", "status"), ("HEAD", "status")):
            await send_json(send, 200, shm.status(peer, region))
        elif op == ("POST", "unregister"):
            shm.unregister(peer, region)
            await send_body(send, 200, b"", JSON)
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
            await send_body(send, 200, b"", JSON)
        elif parts[-1] in ("status", "register", "unregister"):
            raise HttpError(405, f"{method} {path} is not supported")
        else:
            raise HttpError(404, f"no route {path}")

    async def _trace_setting(self, scope, receive, send, method: str, path: str) -> None:
        """The trace extension: GET or POST /v2[/models/{m}]/trace/setting (Triton's JSON:
        every value a string, trace_level a list; null clears a model's own value). Reading
        is open to every client; a change only from this machine, as the other control
        routes (it decides what the daemon writes to disk)."""
        parts = [p for p in path.split("/") if p]
        model = None
        if len(parts) == 5 and parts[:2] == ["v2", "models"] and parts[3:] == ["trace", "setting"]:
            model = self.inference.model(parts[2]).name
        elif parts != ["v2", "trace", "setting"]:
            raise HttpError(404, f"no route {path}")
        tracer = self.inference.tracer
        if method in ("GET", "HEAD"):
            await send_json(send, 200, tracer.response(model))
        elif method == "POST":
            self.inference.control_peer(request_peer(scope), "changing trace settings")
            doc = await self._json_body(scope, receive)
            try:
                answer = tracer.update(model, doc)
            except TraceSettingError as exc:
                raise HttpError(400, str(exc)) from None
            await send_json(send, 200, answer)
        else:
            raise HttpError(405, f"{method} {path} is not supported")

    async def _cuda_shared_memory(self, send, op: tuple[str, str], region: str, path: str) -> None:
        """/v2/cudasharedmemory[/region/{name}]/<op> as a Triton without GPUs answers."""
        shm = self.inference.shared_memory
        if op in (("GET", "status"), ("HEAD", "status")):
            await send_json(send, 200, shm.cuda_status(region))
        elif op == ("POST", "unregister"):
            shm.cuda_unregister(region)
            await send_body(send, 200, b"", JSON)
        elif op == ("POST", "register"):
            shm.cuda_register(region)
        elif op[1] in ("status", "register", "unregister"):
            raise HttpError(405, f"{op[0]} {path} is not supported")
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
            await send_json(send, 200, self.inference.repository_index(ready_only=ready))
        elif (
            len(parts) == 5
            and parts[:3] == ["v2", "repository", "models"]
            and parts[4] in ("load", "unload")
        ):
            # Who may is decided before the body is read: a refused client sends nothing in.
            _, peer = self.inference.check_control(request_peer(scope), parts[4])
            doc = await self._json_body(scope, receive)
            parameters = doc.get("parameters", {})
            if not isinstance(parameters, dict):
                raise HttpError(400, "parameters must be a JSON object")
            if parts[4] == "load":
                await self.inference.load(parts[3], parameters, peer)
            else:
                await self.inference.unload(parts[3], peer)
            await send_body(send, 200, b"", JSON)
        else:
            raise HttpError(404, f"no route {path}")

    async def _json_body(self, scope, receive) -> dict[str, Any]:
        """A control route's body (at most CONTROL_BODY_BYTES) as a JSON object ({} when
        empty). Small enough to decode on the event loop."""
        body = await read_body(
            dict(scope["headers"]), receive, self.max_body_bytes, CONTROL_BODY_BYTES
        )
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


def region_name(parts: list[str], path: str) -> str:
    """The region of /v2/{system,cuda}sharedmemory[/region/{name}]/<op> ("" for all)."""
    if len(parts) == 3:
        return ""
    if len(parts) == 5 and parts[2] == "region":
        return parts[3]
    raise HttpError(404, f"no route {path}")
