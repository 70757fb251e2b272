"""Opening only regular files of an image root, and reading them to a bound.

An image root is someone else's file system. A name edgectl reads or writes there (a boot
config, an IRQ's affinity file in a fixture tree) may be a FIFO, a socket or a device node
instead: reading a FIFO blocks forever, a twin of /dev/zero fills memory, a block device's
content would be read into the plan and the journal, and the node's numbers lead to the
host's own device, so a write through it reaches that device. Even opening one is an action
(opening a watchdog node arms the host's watchdog; a tape rewinds at close).

So a file is first opened with O_PATH, which touches no driver, and fstat'd; only a regular
file is then opened for real, through /proc/self/fd of that O_PATH descriptor: the inode that
was checked, not whatever the name holds a moment later. Anything else is `NotRegularFile`
(a `PathRefused`), naming the path and what it is. Reads stop at `MAX_READ_BYTES`.

Nothing here is used for the live root ("/"): there the system's own files are read as they
always were.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# The largest file read from an image: its config files and fixture kernel files are small.
MAX_READ_BYTES = 16 * 2**20
MAX_NOTED = 100  # refusals a root keeps for `apply` to name
_KINDS = (
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
)


class PathRefused(ValueError):
    """A path of an image root that leads somewhere it must not (a link under /proc or /sys
    that is absolute or leaves that folder, a device node or FIFO). Nothing is read from or
    written through it."""


class NotRegularFile(PathRefused):
    """A FIFO, socket or device node where edgectl reads or writes a file."""

    def __init__(self, shown: Path | str, kind: str) -> None:
        self.path, self.kind = str(shown), kind
        super().__init__(
            f"{shown}: a {kind} in the image root, not a regular file: edgectl neither "
            "opens nor reads nor writes it"
        )


class TooLarge(PathRefused):
    """A file larger than edgectl reads from an image."""

    def __init__(self, shown: Path | str, limit: int) -> None:
        self.path = str(shown)
        super().__init__(
            f"{shown}: larger than the {limit} bytes edgectl reads from a file of an image root"
        )


def note(refused: list[str] | None, exc: PathRefused) -> None:
    """Add a refusal's message to a root's `refused` list, at most MAX_NOTED of them (a
    long-running reader of a strange root must not grow it for ever)."""
    if refused is not None and len(refused) < MAX_NOTED and str(exc) not in refused:
        refused.append(str(exc))


def special_kind(mode: int) -> str | None:
    """ "FIFO", "character device", ... for a special file's mode; None for a regular file,
    folder or link (those the callers handle their own way)."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return None


def check_mode(shown: Path | str, mode: int) -> None:
    """NotRegularFile unless `mode` is a regular file's, a folder's or a link's."""
    kind = special_kind(mode)
    if kind is not None:
        raise NotRegularFile(shown, kind)


def open_regular(
    name: str | os.PathLike[str],
    flags: int,
    shown: Path | str,
    *,
    dir_fd: int | None = None,
    follow: bool = False,
) -> int:
    """os.open of the regular file `name` (relative to `dir_fd` when given) with `flags`,
    never opening anything else: a special file is NotRegularFile, a folder IsADirectoryError
    and, unless `follow`, a symlink ELOOP (the callers resolve links themselves). O_CREAT is
    not honoured: a missing file is FileNotFoundError."""
    path_flags = os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    handle = os.open(name, path_flags, dir_fd=dir_fd)
    try:
        mode = os.fstat(handle).st_mode
        if stat.S_ISLNK(mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(shown))
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(shown))
        check_mode(shown, mode)
        # The checked inode itself (an O_PATH fd cannot be read or written).
        wanted = flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECTORY)
        return os.open(f"/proc/self/fd/{handle}", wanted | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(handle)


def read_capped(fd: int, shown: Path | str, limit: int = MAX_READ_BYTES) -> bytes:
    """All of the open file `fd` (closed here), or TooLarge past `limit` bytes."""
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(shown, limit)
    return data
