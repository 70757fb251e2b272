"""Who is asking: the peer of a request, for the operations that act on this machine's
resources on a client's behalf (system shared memory, the repository's load and unload).

Locality alone is no gate: every local user reaches 127.0.0.1. So those operations are for
clients on the Unix sockets (whose file mode and group say who may connect) and, only when
`[server] tcp_control = true`, for loopback TCP clients. Each such client acts as a user:
- the HTTP Unix socket: the peer's uid from the kernel (SO_PEERCRED);
- loopback TCP: the uid that owns the client's socket, from /proc/net/tcp{,6}, read at the
  request (a port is reused by other users as soon as it is closed, so never cached);
- the gRPC Unix socket: grpcio exposes no peer credentials, so its clients share one
  principal, "grpc-unix", gated by the socket's mode and group alone (docs/SECURITY.md).

A principal's `key` names its namespace: one client user cannot see, unregister or re-point
another's shared-memory regions.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

PROC_NET = Path("/proc/net")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    """One request's client. `transport`: "unix" (the HTTP Unix socket), "grpc-unix", "tcp".
    `uid`: the client's user where the kernel tells it, else None. `local`: on this machine
    (a Unix socket or a loopback address)."""

    transport: str
    uid: int | None = None
    local: bool = True
    address: str = ""  # for messages: "127.0.0.1:53412", "unix"
    # TCP: (client, server) addresses, to find the client's uid (`with_uid`) when needed.
    ends: tuple[tuple[str, int], tuple[str, int]] | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        """The principal: regions and loads are tied to it."""
        return f"uid:{self.uid}" if self.uid is not None else self.transport

    def with_uid(self, root: Path = PROC_NET) -> Peer:
        """A TCP peer with its uid looked up (the Unix sockets' peers have theirs, or none
        to find: gRPC's)."""
        if self.transport != "tcp" or self.uid is not None or self.ends is None:
            return self
        return replace(self, uid=tcp_uid(*self.ends, root=root))

    def describe(self) -> str:
        who = f"uid {self.uid}" if self.uid is not None else "unknown user"
        return f"{self.transport} client {self.address or '?'} ({who})"


def unix_peer(sock: socket.socket | None) -> Peer:
    """The peer of an accepted AF_UNIX socket, with its uid (SO_PEERCRED)."""
    uid = None
    if sock is not None:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            uid = _UCRED.unpack(raw)[1]
        except OSError:
            uid = None
    return Peer("unix", uid, True, "unix")


def tcp_peer(client: tuple[str, int] | None, server: tuple[str, int] | None) -> Peer:
    """A TCP peer; local when its address is loopback. The uid is not looked up here (see
    `tcp_uid`): only the operations that need it pay for the read."""
    if client is None:
        return Peer("tcp", None, False, "?")
    host, port = client[0], client[1]
    ends = ((host, port), (server[0], server[1])) if server is not None else None
    return Peer("tcp", None, is_loopback(host), f"{host}:{port}", ends)


GRPC_UNIX = Peer("grpc-unix", None, True, "unix")


def tcp_uid(client: tuple[str, int], server: tuple[str, int], root: Path = PROC_NET) -> int | None:
    """The uid owning the client's end of a loopback TCP connection: the /proc/net/tcp(6)
    row whose local address is the client's and remote address the server's. None when no
    row matches (the client went away)."""
    want_local = _endpoint(client[0], client[1])
    want_remote = _endpoint(server[0], server[1])
    if want_local is None or want_remote is None:
        return None
    for name in ("tcp", "tcp6"):
        try:
            text = (root / name).read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 8:
                continue
            local, remote = _parse(cols[1]), _parse(cols[2])
            if local == want_local and remote == want_remote:
                try:
                    return int(cols[7])
                except ValueError:
                    return None
    return None


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback; a name (not an address) is not."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _endpoint(host: str, port: int) -> tuple[bytes, int] | None:
    """(16-byte address, port) with IPv4 as IPv4-mapped IPv6, so tcp and tcp6 rows compare."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv4Address):
        address = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + address.packed)
    return address.packed, port


def _parse(field: str) -> tuple[bytes, int] | None:
    """A /proc/net/tcp address "0100007F:1F40": the address's 32-bit words in the kernel's
    byte order (hex), then the port (hex)."""
    raw, _, port = field.partition(":")
    try:
        packed = bytes.fromhex(raw)
        number = int(port, 16)
    except ValueError:
        return None
    if len(packed) not in (4, 16):
        return None
    if sys.byteorder == "little":
        packed = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
    if len(packed) == 4:
        packed = b"\0" * 10 + b"\xff\xff" + packed
    return packed, number
