"""The sha256 of model files, hashed once per change of the file: a file is known by its
device, inode, size, modification and change times, so a file replaced or written in place
is hashed again, and an unchanged one (every reload, switch-back, standby load) is not."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

CHUNK = 1 << 20

Identity = tuple[int, int, int, int, int]


def identity(path: Path) -> Identity:
    """What tells this file's content apart from its next version (OSError if unreadable)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Digests:
    def __init__(self) -> None:
        self._known: dict[str, tuple[Identity, str]] = {}
        self._lock = threading.Lock()
        self.hashed = 0  # files hashed so far (a test's and a benchmark's figure)

    def sha256(self, path: Path) -> str:
        """The file's sha256, from the cache when the file has not changed since."""
        key = str(path)
        before = identity(path)
        with self._lock:
            known = self._known.get(key)
        if known is not None and known[0] == before:
            return known[1]
        value = sha256_file(path)
        if identity(path) != before:  # written while hashed: the digest names no version
            raise OSError(f"{path} changed while it was hashed; try again")
        with self._lock:
            self._known[key] = (before, value)
            self.hashed += 1
        return value
