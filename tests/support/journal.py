"""A socket in journald's place for tests: the daemon (or edgectl) is pointed at it with
$EDGED_JOURNAL_SOCKET and every record it sends is kept, parsed from journald's native
serialization (memfd records included). Never the machine's own journald."""

from __future__ import annotations

import array
import os
import socket
import struct
import threading
import time
from pathlib import Path


def parse_native(datagram: bytes) -> dict[str, bytes]:
    """journald's native serialization (KEY=value lines; KEY, le64 length, bytes)."""
    fields: dict[str, bytes] = {}
    pos = 0
    while pos < len(datagram):
        end = datagram.index(b"\n", pos)
        line = datagram[pos:end]
        if b"=" in line:
            key, value = line.split(b"=", 1)
            pos = end + 1
        else:
            key = line
            (size,) = struct.unpack("<Q", datagram[end + 1 : end + 9])
            value = datagram[end + 9 : end + 9 + size]
            assert datagram[end + 9 + size : end + 10 + size] == b"\n"
            pos = end + 10 + size
        fields[key.decode()] = value
    return fields


class JournalSocket:
    """A datagram socket in the journal's place; keeps every record (memfd ones too)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 2**20)
        self.sock.bind(str(path))
        self.records: list[dict[str, bytes]] = []
        self.raw: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(2**20, socket.CMSG_SPACE(4))
            except OSError:
                return
            for level, kind, fds in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fd = array.array("i", fds[:4])[0]
                    with os.fdopen(fd, "rb") as f:
                        f.seek(0)  # the sender's writes left the shared offset at the end
                        data = f.read()
            self.raw.append(data)
            self.records.append(parse_native(data))

    def messages(self) -> list[str]:
        return [r["MESSAGE"].decode() for r in self.records]

    def wait_for(self, text: str, timeout: float = 60) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in list(self.records):
                if text in record["MESSAGE"].decode():
                    return record
            time.sleep(0.05)
        raise AssertionError(f"no journal record with {text!r}: {self.messages()}")

    def close(self) -> None:
        self.sock.close()
