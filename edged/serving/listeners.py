"""Where the API listens: the TCP and Unix sockets, bound before serving (the socket file
removed at stop only while it is still ours), and the uvicorn server over them, with edged's
HTTP limits and without uvicorn's own signal handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time
from collections.abc import Iterator
from email.utils import formatdate
from typing import Any

from edged.config import Config, ServerConfig


def http_server(app: Any, srv: ServerConfig, drain_s: float):
    """uvicorn serving `app` by `srv`'s limits; in-flight requests get `drain_s` at stop.

    Connection budgets (per listener), header size and time, and body time are
    edged.serving.http_limits' (uvicorn has no such options); uvicorn's own limit_concurrency
    stays off, since it counts every listener together. WebSocket: no route uses it."""
    import uvicorn

    from edged.serving.http_limits import HttpLimits, protocol_class

    limits = HttpLimits(
        header_timeout_s=srv.header_timeout_s,
        body_timeout_s=srv.body_timeout_s,
        max_header_bytes=srv.max_header_bytes,
        connections={"tcp": srv.max_connections, "unix": srv.socket_max_connections},
        drain_s=drain_s,
    )
    uv_config = uvicorn.Config(
        app,
        lifespan="off",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=int(drain_s),
        http=protocol_class(limits),
        ws="none",
        timeout_keep_alive=srv.idle_timeout_s,  # type: ignore
        limit_concurrency=None,
        # A local client must not claim another address (X-Forwarded-For): the peer is what
        # the socket says (edged.serving.peers).
        proxy_headers=False,
    )
    return _Server(uv_config)


class _Server:
    """uvicorn's Server without its own signal handling, ticking once a second.

    uvicorn installs SIGTERM/SIGINT handlers for the duration of serve() and re-raises the
    signal afterwards, which would kill the process before our drain and exit 0; the daemon
    handles signals itself (see edged.daemon.Daemon.run).

    uvicorn's main loop wakes every 0.1 s, idle or not, to refresh its Date header (once a
    second) and to notice `should_exit`: 10 of an idle daemon's 36 wake-ups a second
    (scripts/bench_idle.py). Here the Date header is made when a response asks for it
    (`_DatedState`, cached for its second), so the main loop has nothing to do on a timer:
    it waits for `request_exit()` (the daemon's SIGTERM), and `exit_requested` lets gRPC's
    drain start at the same moment. (uvicorn's tick also serves `limit_max_requests` and
    `callback_notify`, neither of which edged sets.)"""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            def __init__(self, config) -> None:
                super().__init__(config)
                self.exit_requested = asyncio.Event()
                self.server_state = _dated_state()

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

            def request_exit(self) -> None:
                self.should_exit = True
                self.exit_requested.set()

            async def main_loop(self) -> None:
                if not await self.on_tick(0):  # sets the default headers once
                    await self.exit_requested.wait()

        return Server(config)


def _dated_state():
    """uvicorn's ServerState whose `default_headers` carry a Date made when a response reads
    them, once per second at most (uvicorn refreshes it from a 0.1 s timer instead)."""
    from uvicorn.server import ServerState

    class _DatedState(ServerState):
        def __init__(self) -> None:
            self._rest: list[tuple[bytes, bytes]] = []
            self._dated = True
            self._second = -1
            self._headers: list[tuple[bytes, bytes]] = []
            super().__init__()

        @property  # type: ignore[override]
        def default_headers(self) -> list[tuple[bytes, bytes]]:
            now = int(time.time())
            if now != self._second:
                date = [(b"date", formatdate(now, usegmt=True).encode())] if self._dated else []
                self._second, self._headers = now, date + self._rest
            return self._headers

        @default_headers.setter
        def default_headers(self, value: list[tuple[bytes, bytes]]) -> None:
            # uvicorn's on_tick sets [date (when config.date_header)] + the config's headers
            self._dated = any(name == b"date" for name, _ in value)
            self._rest = [(name, v) for name, v in value if name != b"date"]
            self._second = -1

    return _DatedState()


def bind_sockets(config: Config) -> list[socket.socket]:
    server = config.server
    sockets = []
    if server.listen_host is not None:
        family = socket.AF_INET6 if ":" in server.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((server.listen_host, server.listen_port or 0))
        sockets.append(sock)
    if server.socket is not None:
        path = server.socket
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a stale socket from a previous run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, server.socket_mode)
        sockets.append(sock)
    for sock in sockets:
        sock.listen(1024)
        sock.set_inheritable(False)
    return sockets


def socket_identity(config: Config) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the Unix socket just bound, so stop removes only that file."""
    if config.server.socket is None:
        return None
    st = config.server.socket.lstat()
    return st.st_dev, st.st_ino


def remove_socket_file(config: Config, identity: tuple[int, int] | None) -> None:
    """Remove the socket this process created, and only while it is still that socket: a
    file that replaced it (or anything else at the path) is left alone."""
    path = config.server.socket
    if path is None or identity is None:
        return
    with contextlib.suppress(OSError):
        st = path.lstat()
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == identity:
            path.unlink()


def describe(sock: socket.socket) -> str:
    name = sock.getsockname()
    return f"unix:{name}" if sock.family == socket.AF_UNIX else f"http://{name[0]}:{name[1]}"


def server_changes(running, new) -> list[str]:
    """The [server] fields that differ between two configs (they take a restart)."""
    import dataclasses

    return [
        f.name
        for f in dataclasses.fields(running)
        if f.name != "hang_s" and getattr(running, f.name) != getattr(new, f.name)
    ]
