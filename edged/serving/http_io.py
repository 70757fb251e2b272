"""ASGI plumbing of the HTTP front end: reading a request's body within its bounds, the
client a request came from, and sending a response. Hand-written on purpose: edged's HTTP
side is a plain ASGI application (see edged.serving.api) and these are its few needs."""

from __future__ import annotations

import json
from typing import Any

from edged.serving.http_limits import PEER
from edged.serving.inference import RequestError as HttpError
from edged.serving.peers import Peer, tcp_peer

JSON = [(b"content-type", b"application/json")]


async def read_body(
    headers: dict[bytes, bytes], receive, max_body_bytes: int, limit: int | None = None
) -> bytes | bytearray | None:
    """The body, one message in the common case (no copy). A body in several messages
    goes into one buffer of the declared size, so a large body is held once rather than
    as chunks plus their join; chunked bodies (no Content-Length) are joined. `limit`:
    the route's own bound, below max_body_bytes (a declared length over it is 413 before
    anything is read or allocated)."""
    if limit is not None and limit < max_body_bytes:
        return await read_small_body(headers, receive, limit)
    declared = headers.get(b"content-length")
    size = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise HttpError(400, "Content-Length is not a number") from None
        if size > max_body_bytes:
            raise HttpError(
                413, f"request body of {size} bytes is over the limit of {max_body_bytes}"
            )
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    first = message.get("body", b"")
    if not message.get("more_body", False):
        if len(first) > max_body_bytes:
            raise HttpError(413, f"request body is over the limit of {max_body_bytes} bytes")
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
        if total > max_body_bytes:
            raise HttpError(413, f"request body is over the limit of {max_body_bytes} bytes")
        if not message.get("more_body", False):
            return b"".join(chunks)
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        chunks.append(chunk)


async def read_small_body(headers: dict[bytes, bytes], receive, limit: int) -> bytes | None:
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


def request_peer(scope) -> Peer:
    """The request's client, as the connection found it (http_limits.PEER); a scope made
    elsewhere (tests calling the app directly) from its addresses."""
    peer = scope.get(PEER)
    if peer is not None:
        return peer
    server = scope.get("server")
    if server is None or server[1] is None:  # uvicorn gives a Unix socket's server port None
        return Peer("unix", None, True, "unix")
    return tcp_peer(scope.get("client"), server)


async def send_body(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, doc: Any, retry_after: int | None = None) -> None:
    headers = JSON if retry_after is None else [*JSON, (b"retry-after", str(retry_after).encode())]
    await send_body(send, status, json.dumps(doc, separators=(",", ":")).encode(), headers)


async def lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
