"""The daemon's logs: plain text, one JSON object per line, or the systemd journal with
fields, and `event()`, which logs one decision with its inputs as fields.

`--log-format`:
  * `text`: `time LEVEL logger: message`, as before;
  * `json`: one object per line: ts, level, logger, message, and the event's fields;
  * `journal`: straight to journald over its native protocol, so every field is a journal
    field (`SYSLOG_IDENTIFIER=edged`, `PRIORITY`, `EVENT`, `MODEL`, `BACKEND`, `TRACE_ID`,
    ...) and `journalctl -u edged MODEL=det EVENT=failover` finds them;
  * `auto` (the default): `journal` when stderr is the journal (systemd sets
    $JOURNAL_STREAM to it), else `text`.

An event's fields are lower-case words in the code (`model`, `backend`); the journal gets
them upper-case (its field names are [A-Z0-9_]), JSON as they are. Code below edged (sysconf,
backends) can attach fields too: `extra={FIELDS: {...}}` on any log call.

The journal protocol is written here, not through systemd-python: that package has no
wheels (it compiles against libsystemd's headers, which a device image seldom has), and
the protocol is small and documented (systemd's "Native Journal Protocol"): a datagram of
KEY=value lines, a value with a newline sent as KEY, a 64-bit little-endian length and the
bytes; a datagram too large for the socket goes in a sealed memfd passed with SCM_RIGHTS.
"""

from __future__ import annotations

import array
import datetime
import errno
import json
import logging
import math
import os
import re
import socket
import struct
import sys
import time
from collections.abc import Mapping
from typing import Any

FIELDS = "edged_fields"  # the LogRecord attribute an event's fields travel in
FORMATS = ("auto", "text", "json", "journal")
JOURNAL_SOCKET = "/run/systemd/journal/socket"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
IDENTIFIER = "edged"

# logging level -> syslog priority (journald's PRIORITY)
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3}
_BAD_FIELD_CHARS = re.compile(r"[^A-Z0-9_]")


def event(
    logger: logging.Logger,
    name: str,
    message: str,
    *args: Any,
    level: int = logging.INFO,
    **fields: Any,
) -> None:
    """Log one decision: `message` for people, `name` (the EVENT field) and `fields` (its
    inputs: model, backend, reason, ...) for machines. None-valued fields are left out."""
    if logger.isEnabledFor(level):
        data = {"event": name, **{k: v for k, v in fields.items() if v is not None}}
        logger.log(level, message, *args, extra={FIELDS: data}, stacklevel=2)


class Throttle:
    """At most one event per key every `interval_s`: `due(key)` counts a happening and
    returns how many there were since the last one logged when it is time to log again,
    else None (a flood of refusals is one line every interval, with its count)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last: dict[Any, float] = {}
        self._count: dict[Any, int] = {}

    def due(self, key: Any) -> int | None:
        now = time.monotonic()
        count = self._count.get(key, 0) + 1
        if now - self._last.get(key, -math.inf) < self.interval_s:
            self._count[key] = count
            return None
        self._last[key] = now
        self._count[key] = 0
        return count


def fields_of(record: logging.LogRecord) -> Mapping[str, Any]:
    return getattr(record, FIELDS, None) or {}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; the message's own newlines stay inside its string."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        doc: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            doc.setdefault(key, value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


def journal_field(name: str) -> str:
    """A field name journald accepts: upper-case letters, digits, _; not starting with _."""
    name = _BAD_FIELD_CHARS.sub("_", name.upper()).lstrip("_")
    return ("X" + name if name[:1].isdigit() else name)[:64] or "FIELD"


def journal_datagram(record: logging.LogRecord, message: str) -> bytes:
    """The record in the native protocol's serialization."""
    fields: dict[str, Any] = {
        "MESSAGE": message,
        "PRIORITY": _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 2),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        "LOGGER": record.name,
        "CODE_FILE": record.pathname,
        "CODE_LINE": record.lineno,
        "CODE_FUNC": record.funcName,
        "THREAD_NAME": record.threadName,
    }
    for key, value in fields_of(record).items():
        fields.setdefault(journal_field(key), value)
    out = bytearray()
    for key, value in fields.items():
        data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalHandler(logging.Handler):
    """Sends each record to journald (`path`: its socket; tests give their own)."""

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        super().__init__()
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            datagram = journal_datagram(record, message)
            try:
                self.sock.sendto(datagram, self.path)
            except OSError as exc:
                if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                    raise
                self._send_memfd(datagram)
        except Exception:
            self.handleError(record)

    def _send_memfd(self, datagram: bytes) -> None:
        """A record too large for one datagram: in a sealed memfd, its descriptor sent."""
        fd = os.memfd_create("edged-journal", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.write(fd, datagram)
            import fcntl

            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            self.sock.sendmsg([], rights, 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.sock.close()
        super().close()


def stderr_is_journal() -> bool:
    """systemd connected stderr to the journal ($JOURNAL_STREAM names its device:inode)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def journal_socket() -> str:
    """journald's socket ($EDGED_JOURNAL_SOCKET: the tests' own)."""
    return os.environ.get("EDGED_JOURNAL_SOCKET", JOURNAL_SOCKET)


def setup(level: str, fmt: str = "auto") -> str:
    """Configure the root logger; returns the format used ("auto" resolved)."""
    path = journal_socket()
    if fmt == "auto":
        fmt = "journal" if stderr_is_journal() and os.path.exists(path) else "text"
    handler: logging.Handler
    if fmt == "journal":
        if not os.path.exists(path):
            raise OSError(f"no journald socket at {path} (is systemd-journald running?)")
        handler = JournalHandler(path)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return fmt


def journal_logger(name: str) -> logging.Logger | None:
    """For a one-shot command (edgectl apply/revert) run by systemd: a logger straight to the
    journal, so its changes are events with fields beside its plain stdout; None when
    stderr is not the journal (a person at a terminal reads the printed report)."""
    path = journal_socket()
    if not (stderr_is_journal() and os.path.exists(path)):
        return None
    logger = logging.getLogger(name)
    if not any(isinstance(h, JournalHandler) for h in logger.handlers):
        logger.addHandler(JournalHandler(path))
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger
