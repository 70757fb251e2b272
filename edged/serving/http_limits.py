"""HTTP transport limits the daemon needs and uvicorn has no options for.

uvicorn bounds the time between requests (`timeout_keep_alive`) and the connections of the
whole server (`limit_concurrency`, answered with a plain-text 503 only once a request's
headers are in). It has no bound on the time to a request's headers or body, none on the size
of the headers with httptools (h11 has one; httptools' parser joins a header's pieces by
concatenation, quadratic in their number, on the event loop), and one budget for every
listener, so idle TCP connections lock out the Unix socket (edgectl, health checks). These
limits are therefore hand-written, as a small subclass of uvicorn's httptools protocol (the
`uvicorn.Config(http=...)` hook); httptools is a declared dependency, so uvicorn's `auto`
would pick the same parser.

Per connection, all on the event loop and without a timer on the common path:
- a budget per listener (TCP, Unix socket), checked when the connection is accepted: one over
  it gets a JSON 503 at once and is closed; refused connections still lingering (below) are
  bounded by the same budget, past which one more is closed without an answer, so a flood
  of refused connections cannot hold the daemon's descriptors either;
- who the client is (`edged.serving.peers.Peer`, the Unix socket's peer uid from the kernel),
  found once per connection and put in each request's scope under PEER;
- the request head (request line and headers) within `max_header_bytes` (431) and within
  `header_timeout_s` of the connection (or of the request's first byte, on a kept-alive one):
  a connection that sends nothing is closed, one that sends part of a head gets 408;
- the body within `body_timeout_s` of its head (408, and the application sees the client go
  away, so a request admitted to a model's queue gives its slot back). The timer is only armed
  when a body does not arrive with its head;
- at shutdown, a body still being read gets at most STOP_STALL_S without progress (uvicorn
  closes idle connections itself and lets in-flight requests finish).

An answer the daemon gives on its own is written with `connection: close`, the write side is
shut, and what the client still sends is read and dropped for up to LINGER_S: closing a socket
with unread data sends a reset, which can destroy the answer before the client reads it.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from edged.serving.peers import Peer, tcp_peer, unix_peer

log = logging.getLogger("edged.http")

LINGER_S = 1.0  # how long a refused or answered-and-closed connection's input is drained
STOP_STALL_S = 1.0  # at shutdown: a body receiving nothing for this long is cut (408)
# Set in the request's ASGI scope when its body timed out, so the API counts a 408 for what
# it otherwise sees as a client that went away.
BODY_TIMED_OUT = "edged.body_timed_out"
LISTENER_KEYS = {"tcp": "max_connections", "unix": "socket_max_connections"}
PEER = "edged.peer"  # the scope key of the request's Peer


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    connections: Mapping[str, int] | None = None  # "tcp" / "unix" -> connections at once
    drain_s: float = 10.0  # the server's graceful-shutdown bound

    def budget(self, listener: str) -> int | None:
        return None if self.connections is None else self.connections.get(listener)


class _Throttled:
    """A warning at most every `every_s` per kind, with how many were left out: a flood of
    hostile connections must not become a flood of log lines."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.every_s) < self.every_s:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        if skipped:
            message += f" ({skipped} more like it in the last {self.every_s:g} s)"
        log.warning(message, *args)


def protocol_class(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` enforcing `limits`. Each class keeps
    its own connection counts: one class per server."""
    return type(
        "LimitedHttpToolsProtocol",
        (LimitedHttpToolsProtocol,),
        {"limits": limits, "open": {}, "lingering": {}, "warn": _Throttled()},
    )


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    # Per class (protocol_class makes one per server): uvicorn makes the instances.
    limits: ClassVar[HttpLimits] = HttpLimits()
    open: ClassVar[dict[str, int]] = {}  # listener -> connections counted against its budget
    lingering: ClassVar[dict[str, int]] = {}  # listener -> refused connections not yet closed
    warn: ClassVar[_Throttled] = _Throttled()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listener: str | None = None  # set once counted against a budget
        self._closing = False  # answered on our own: input is drained, not parsed
        self._in_head = True  # reading a request line and headers
        self._head_bytes = 0  # bytes fed to the parser since the head began
        self._in_body = False  # the head is in, the body is not complete
        self._head_timer: Any = None
        self._body_timer: Any = None
        self._body_deadline = 0.0
        self._stop_deadline: float | None = None  # set at shutdown
        self._refused: str | None = None  # the listener this refused connection lingers on
        self._who = Peer("tcp", None, False, "?")

    # -- connection --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        listener = "unix" if sock is not None and sock.family == socket.AF_UNIX else "tcp"
        budget = self.limits.budget(listener)
        if budget is not None and self.open.get(listener, 0) >= budget:
            self.transport = transport
            if self.lingering.get(listener, 0) >= budget:
                transport.abort()  # refusing takes descriptors too: past the budget, none
                return
            self.lingering[listener] = self.lingering.get(listener, 0) + 1
            self._refused = listener
            key = LISTENER_KEYS[listener]
            where = "on the Unix socket" if listener == "unix" else "over TCP"
            # The phrase uvicorn logged for its own limit: operators may grep for it.
            self.warn.warning(
                f"refused-{listener}",
                "Exceeded concurrency limit: %d connections open %s ([server] %s); refusing more",
                budget,
                where,
                key,
            )
            self._answer(
                503,
                f"too many connections: {budget} open {where} (the limit, "
                f"[server] {key}); retry later",
            )
            return
        self.open[listener] = self.open.get(listener, 0) + 1
        self._listener = listener
        if listener == "unix":
            self._who = unix_peer(sock)
        else:
            self._who = tcp_peer(
                transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            )
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._refused is not None:
            self.lingering[self._refused] -= 1
            self._refused = None
        if self._listener is not None:
            self.open[self._listener] -= 1
            self._listener = None
            super().connection_lost(exc)
        elif exc is None:
            self.transport.close()

    def eof_received(self) -> None:
        if self._closing:
            return  # the client read our answer and hung up: close now
        super().eof_received()

    def shutdown(self) -> None:
        if self._closing or self._listener is None:
            self.transport.close()
            return
        if self._in_body and self.cycle is not None and not self.cycle.response_complete:
            self._stop_deadline = self.loop.time() + self.limits.drain_s / 2
            self._arm_body_timer()
        super().shutdown()

    # -- reading -----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # drained: nothing more is parsed on a connection we answered
        if self._in_head:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) > room:
                view = memoryview(data)
                if room > 0:
                    super().data_received(view[:room])  # type: ignore[arg-type]  # any buffer
                if self._in_head:  # the head did not end within the limit
                    if not self._closing and not self.transport.is_closing():
                        self._header_too_large()
                    return
                data = view[room:]  # the head ended inside: the rest is body or the next
                if not data or self._closing or self.transport.is_closing():
                    self._after_feed()
                    return
            else:
                self._head_bytes += len(data)
        super().data_received(data)
        self._after_feed()

    def _after_feed(self) -> None:
        if self._in_body:
            if self._body_timer is None:
                self._body_deadline = self.loop.time() + self.limits.body_timeout_s
                self._arm_body_timer()
            elif self._stop_deadline is not None:
                self._arm_body_timer()  # progress during shutdown: another STOP_STALL_S

    # Parser callbacks (httptools calls them from feed_data).
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[PEER] = self._who  # type: ignore[literal-required]
        if self._head_timer is None:  # a later request on a kept-alive connection
            self._head_timer = self.loop.call_later(
                self.limits.header_timeout_s, self._head_timed_out
            )

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._in_body = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._in_head = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # -- limits ------------------------------------------------------------------------------
    def _header_too_large(self) -> None:
        limit = self.limits.max_header_bytes
        self.warn.warning(
            "header-size", "request headers over %d bytes (%s); answered 431", limit, self._peer()
        )
        self._answer(
            431,
            f"request line and headers are over the limit of {limit} bytes "
            f"([server] max_header_bytes)",
        )

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._closing or self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_complete
        if self._head_bytes == 0 or busy:
            self.transport.close()  # nothing asked (or a response is being written): no answer
            return
        timeout = self.limits.header_timeout_s
        self.warn.warning(
            "header-timeout",
            "request headers not complete within %g s (%s); answered 408",
            timeout,
            self._peer(),
        )
        self._answer(
            408, f"request headers not received within {timeout:g} s ([server] header_timeout_s)"
        )

    def _arm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        when = self._body_deadline
        if self._stop_deadline is not None:
            when = min(when, self._stop_deadline, self.loop.time() + STOP_STALL_S)
        self._body_timer = self.loop.call_at(when, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self._closing or self.transport.is_closing() or cycle is None:
            return
        if self._stop_deadline is not None and self.loop.time() < self._body_deadline:
            message = "the daemon is stopping and the request body stalled"
        else:
            message = (
                f"request body not received within {self.limits.body_timeout_s:g} s "
                f"([server] body_timeout_s)"
            )
        self.warn.warning("body-timeout", "%s (%s); answered 408", message, self._peer())
        if cycle.response_started:
            self.transport.close()  # already answered (a refusal before the body): just close
        else:
            cycle.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
            self._answer(408, message)
        # The application is waiting for the body: it sees the client go away now, and so
        # gives back what it holds (its queue slot), whatever the transport still does.
        cycle.disconnected = True
        cycle.message_event.set()

    def _answer(self, status: int, message: str) -> None:
        """Write a JSON error with connection: close, shut our write side, drain what the
        client still sends for LINGER_S, then close."""
        self._closing = True
        self._in_body = False
        self._cancel_timers()
        body = json.dumps({"error": message}, separators=(",", ":")).encode()
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\nconnection: close\r\n\r\n",
                body,
            ]
        )
        transport = self.transport
        transport.write(b"".join(content))
        if self._stop_deadline is not None or not transport.can_write_eof():
            transport.close()  # stopping: the server waits for this connection to end
            return
        transport.write_eof()
        if self.flow is not None:
            self.flow.resume_reading()  # drain, even if a full body buffer paused reading
        self.loop.call_later(LINGER_S, transport.close)

    def _cancel_timers(self) -> None:
        for name in ("_head_timer", "_body_timer"):
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

    def _peer(self) -> str:
        if self.client:
            return f"{self.client[0]}:{self.client[1]}"
        return "unix socket" if self._listener == "unix" else "?"
