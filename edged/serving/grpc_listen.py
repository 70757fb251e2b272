"""The gRPC servers: one grpcio asyncio server per listener (loopback TCP, the Unix socket),
both on the daemon's event loop and serving one `Service` each over the shared Inference.

One server per listener because grpcio's `maximum_concurrent_rpcs` is per server: with one
server for both, idle TCP streams used up the budget and health checks on the Unix socket got
RESOURCE_EXHAUSTED. Now each listener has its own budget (`[server] max_connections` for
TCP, `socket_max_connections` for the socket, as HTTP), and each knows which listener a call
came in on, so it can say who the peer is (`edged.serving.peers`).

Per connection, grpc core's channel arguments bound what a client may hold:
- grpc.max_connection_idle_ms: a connection with no RPC for grpc_idle_timeout_s is closed
  (an idle stream is an RPC: `Service.ModelStreamInfer` ends it after the same time);
- no grpc.max_concurrent_streams: a client's calls beyond it on one channel are refused
  (REFUSED_STREAM, not queued, at a channel's start), and the listener's RPC budget already
  bounds them;
- grpc.http2.min_ping_interval_without_data_ms and max_ping_strikes: a client pinging to
  keep an idle connection alive more often than once a minute is disconnected;
- messages up to max_body_bytes (a larger one is RESOURCE_EXHAUSTED before a handler runs).
SO_REUSEPORT off, so a second daemon on the same port fails to start instead of sharing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from pathlib import Path

import grpc

from edged.config import ServerConfig
from edged.config.schema import MAX_SOCKET_PATH
from edged.serving.grpc_server import SERVICE, Service
from edged.serving.inference import Inference

log = logging.getLogger("edged.serving.grpc")

MIN_PING_INTERVAL_MS = 60_000  # the most often a client may ping a connection without calls
PING_STRIKES = 2  # pings more often than that, then the connection is closed


def server_options(srv: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", srv.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
        ("grpc.max_connection_idle_ms", int(srv.grpc_idle_timeout_s * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", PING_STRIKES),
    ]


class GrpcServer:
    """The servers of the gRPC listeners, started and stopped together."""

    def __init__(
        self, servers: list[grpc.aio.Server], where: list[str], unix: _UnixSocket | None
    ) -> None:
        self.servers = servers
        self.where = where  # "127.0.0.1:8001", "unix:/run/edged/grpc.sock"
        self._unix = unix
        self._stopping: asyncio.Future | None = None

    async def start(self) -> None:
        for server in self.servers:
            await server.start()
        log.info("gRPC (%s) on %s", SERVICE, ", ".join(self.where))

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, give those running `grace_s` to finish (then cancel them), and
        remove the socket file. Once, however often called (the first call's grace holds)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float) -> None:
        try:
            await asyncio.gather(*(server.stop(grace_s) for server in self.servers))
        finally:
            if self._unix is not None:
                self._unix.remove()

    async def stop_when(self, exit_requested: asyncio.Event, grace_s: float) -> None:
        """Stop as soon as the HTTP server is asked to exit (the daemon's SIGTERM sets
        `exit_requested`): gRPC drains while HTTP does, not after it. Nothing is polled,
        so an idle daemon is not woken for it (a 50 ms poll woke it 20 times a second)."""
        await exit_requested.wait()
        await self.stop(grace_s)


def bind_grpc(inference: Inference, srv: ServerConfig) -> GrpcServer | None:
    """The gRPC servers for `srv`, their ports bound (OSError naming the address when one
    cannot be), not yet serving; None when grpc_listen and grpc_socket are both off."""
    if srv.grpc_listen_host is None and srv.grpc_socket is None:
        return None
    servers, where = [], []
    if srv.grpc_listen_host is not None:
        host = f"[{srv.grpc_listen_host}]" if ":" in srv.grpc_listen_host else srv.grpc_listen_host
        server = grpc.aio.server(
            options=server_options(srv), maximum_concurrent_rpcs=srv.max_connections
        )
        service = Service(inference, "tcp", srv.grpc_idle_timeout_s)
        server.add_generic_rpc_handlers((service.handler(),))
        port = _add_port(server, f"{host}:{srv.grpc_listen_port}")
        service.address = (srv.grpc_listen_host, port)
        servers.append(server)
        where.append(f"{host}:{port}")
    unix = None
    if srv.grpc_socket is not None:
        server = grpc.aio.server(
            options=server_options(srv), maximum_concurrent_rpcs=srv.socket_max_connections
        )
        service = Service(inference, "unix", srv.grpc_idle_timeout_s)
        server.add_generic_rpc_handlers((service.handler(),))
        unix = _UnixSocket(srv.grpc_socket, srv.socket_mode)
        unix.bind(server)
        servers.append(server)
        where.append(f"unix:{srv.grpc_socket}")
    return GrpcServer(servers, where, unix)


def _add_port(server: grpc.aio.Server, address: str) -> int:
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
        raise OSError(f"gRPC cannot listen on {address}: {exc}") from None
    if not port:  # older grpcio returned 0
        raise OSError(f"gRPC cannot listen on {address}")
    return port


class _UnixSocket:
    """The gRPC socket file, with `[server] socket_mode` from the start: bound under a
    temporary name in the same folder, its mode set, then renamed into place (grpcio creates
    the file with the process umask; a rename keeps the listening socket). Removed at stop
    only while it is still the file this process created, as the HTTP socket is."""

    def __init__(self, path: Path, mode: int) -> None:
        self.path = path
        self.mode = mode
        self._identity: tuple[int, int] | None = None

    def bind(self, server: grpc.aio.Server) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise OSError(f"gRPC cannot listen on unix:{path}: a file is there (no socket)")
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        if len(os.fsencode(temp)) > MAX_SOCKET_PATH:  # then in place (the umask's mode a moment)
            temp = path
        _add_port(server, f"unix:{temp}")
        os.chmod(temp, self.mode)
        if temp != path:
            os.replace(temp, path)  # over a stale socket of an earlier run
        st = path.lstat()
        self._identity = (st.st_dev, st.st_ino)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            st = self.path.lstat()
            if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._identity:
                self.path.unlink()
