"""One filesystem object rooted at a configurable path (`/` live, or an image/fixture folder).

All of sysconf reads through it, the way node_exporter's collectors read through one procfs/sysfs
object, so tests point the probes at a tree built from a real board's files.

`path()` only joins: the host resolves any symlink in the result. What becomes a change (a
file's content that apply edits and writes back) is read through `files` instead, which
resolves every link inside the root (sysconf.confined), so an image's absolute link never
brings a host file's content into the image.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from sysconf.confined import ConfinedRoot
from sysconf.regular_files import PathRefused, note, open_regular, read_capped


@dataclass(frozen=True)
class SysRoot:
    """`refused`: what reads of an image root met instead of a regular file (a FIFO, a device
    node) or found too large, one message each. Those reads answer "absent" so a probe or plan
    goes on; `apply` refuses a root with any (sysconf.changes), and a caller may show them."""

    root: Path = Path("/")
    refused: list[str] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def at(cls, root: str | os.PathLike[str] | None) -> SysRoot:
        return cls(Path(root or "/"))

    @property
    def is_live(self) -> bool:
        return self.root.resolve() == Path("/")

    @property
    def files(self) -> ConfinedRoot:
        """This root's files with every symlink resolved inside it (plain paths when live):
        what the change journal writes through and what planned changes are read from."""
        return ConfinedRoot(self.root, live=self.is_live, refused=self.refused)

    def path(self, path: str) -> Path:
        """`path` is absolute as seen on the device; the result is under this root."""
        return self.root / path.lstrip("/")

    def exists(self, path: str) -> bool:
        return self.path(path).exists()

    @overload
    def read_text(self, path: str, default: str) -> str: ...

    @overload
    def read_text(self, path: str, default: None = None) -> str | None: ...

    def read_text(self, path: str, default: str | None = None) -> str | None:
        """The file's text, or `default` when it is missing or unreadable (sysfs answers EIO,
        EINVAL or EACCES for some attributes; to a probe that means "not known")."""
        data = self.read_bytes(path)
        return default if data is None else data.decode(errors="replace")

    def read_bytes(self, path: str) -> bytes | None:
        """The file's bytes, or None when it is missing or unreadable. In an image root, a
        regular file only (sysconf.regular_files): a FIFO, socket or device node there is
        never opened, and neither it nor a file past MAX_READ_BYTES is read; each is noted
        in `refused` and answers None."""
        try:
            if self.is_live:
                return self.path(path).read_bytes()
            shown = self.path(path)
            # follow: path() joins, and the host resolves links (module doc)
            fd = open_regular(shown, os.O_RDONLY | os.O_NONBLOCK, shown, follow=True)
            return read_capped(fd, shown)
        except OSError:
            return None
        except PathRefused as exc:
            note(self.refused, exc)
            return None

    def read_line(self, path: str) -> str | None:
        text = self.read_text(path)
        return None if text is None else text.strip().rstrip("\x00")

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(path)))
        except OSError:
            return []

    def glob(self, pattern: str) -> Iterator[str]:
        """Device-side paths matching `pattern` (absolute, as on the device)."""
        for match in sorted(self.root.glob(pattern.lstrip("/"))):
            yield "/" + str(match.relative_to(self.root))

    def link_name(self, path: str) -> str | None:
        """Last component of a symlink's target, e.g. a device's `driver` link -> its name.

        Read with readlink, not resolve: in an image root the absolute target would point at
        the host."""
        try:
            return os.path.basename(os.readlink(self.path(path)))
        except OSError:
            return None
