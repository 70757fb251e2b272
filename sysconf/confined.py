"""File operations inside an image root that never leave it, whatever its symlinks say.

An image root is a folder holding someone else's file system (a provisioning image, a fixture
tree), acted on as root. Its symlinks are data: `etc/default/grub -> /real/grub` means the
image's /real/grub, never the host's, and `../../..` stops at the image's top. A plain
`open(root / path)` lets the kernel follow such links on the host, so `edgectl apply --root`
wrote host files through a crafted image. Every path the change journal writes, reads an old
value from, unlinks, renames, creates or links therefore goes through `ConfinedRoot`.

The resolution is the kernel's `openat2(RESOLVE_IN_ROOT)`, done by hand: Python 3.11's os
module has no openat2 wrapper and no RESOLVE_* flags, and no library offers it. So the walk
starts at a directory fd of the root and takes one component at a time with
`O_NOFOLLOW`/`follow_symlinks=False` relative to the previous folder's fd; a component that
is a symlink is read with `readlink(dir_fd=...)` and its target resolved as if the root were
`/`: an absolute target restarts at the root fd, `..` never climbs above the root, and more
than `MAX_LINKS` links is a loop (ELOOP). The operation itself then acts on the last name
relative to its folder's fd, without following a link there, so the kernel never resolves a
path string of the image, even if the image changes while edgectl runs.

Under `proc/` and `sys/` an image holds only the kernel's files (usually nothing: they are
mount points). sysfs's own links are relative and stay inside /sys (cpu2/cpufreq ->
../cpufreq/policy2), and fixture roots copy them; any other link there (absolute, or leading
out of its /proc or /sys) is refused with `PathRefused`, and `check_kernel_links` refuses a
root that has one before anything is written.

Only regular files are read or written in an image (sysconf.regular_files): a device node,
FIFO or socket is refused with `NotRegularFile` (a `PathRefused`) before it is opened, and a
read stops at MAX_READ_BYTES. Each refusal of a read is also noted in `refused` (shared with
the SysRoot the plan reads through), so `apply` can refuse a root whose plan had to leave a
file out. Under proc/ and sys/ an image holds no live kernel: a kernel file there is written
in place only when the image already has it as a regular file (a captured tree, a fixture),
and never created.

The live root ("/") is not confined: there the paths are the system's own and every
operation is the plain path-based one it always was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sysconf.regular_files import (  # noqa: F401  (PathRefused, MAX_READ_BYTES: this API)
    MAX_READ_BYTES,
    NotRegularFile,
    PathRefused,
    check_mode,
    note,
    open_regular,
    read_capped,
)

# The kernel's MAXSYMLINKS: following more links than this for one path is a loop (ELOOP).
MAX_LINKS = 40
# The top folders of an image root that only ever hold the kernel's files.
KERNEL_DIRS = ("proc", "sys")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def temp_name(name: str) -> str:
    """Where a regular file named `name` is staged before the rename over it."""
    return f".{name}.edged-tmp"


def kernel_top(device_path: str) -> str | None:
    """ "proc" or "sys" for a path under /proc/ or /sys/, else None."""
    parts = device_path.lstrip("/").split("/", 1)
    return parts[0] if len(parts) == 2 and parts[0] in KERNEL_DIRS else None


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _lexical(start: list[str], target: str) -> list[str]:
    """Where a relative `target` lands from the folder `start`, `..` stopping at the root."""
    names = list(start)
    for part in _parts(target):
        if part == "..":
            if names:
                names.pop()
        else:
            names.append(part)
    return names


def _open_dir(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except PermissionError:  # a folder we may pass but not list: enough to walk through
        return os.open(name, _DIR | os.O_PATH, dir_fd=dir_fd)


def _fsync(fd: int) -> None:
    with contextlib.suppress(OSError):  # an O_PATH fd, or a file system without fsync
        os.fsync(fd)


def _unlink_quiet(name: str, dir_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


@dataclass(frozen=True)
class ConfinedRoot:
    """File operations on device paths ("/etc/default/grub") of the folder `root`.

    `live`: the root is the running system: paths are used as they are (see the module doc).
    Operations take device paths and raise OSError like their os counterparts; `resolve`
    gives the path a link chain leads to, as a device path inside the root. `refused`: where
    the reads that met a special file (or a file too large) append their message."""

    root: Path
    live: bool = False
    refused: list[str] | None = field(default=None, compare=False, repr=False)

    def host(self, device_path: str) -> Path:
        """The path as the host names it (for messages, and for the live root)."""
        return self.root / device_path.lstrip("/")

    # -- resolution ----------------------------------------------------------------------
    def _refuse(self, device_path: str, link: list[str], target: str, top: str) -> None:
        raise PathRefused(
            f"{self.host('/'.join(link))}: a symlink to {target!r} under /{top} of the image "
            f"root {self.root}: /proc and /sys of an image hold only the kernel's files, and a "
            f"link there that is absolute or leads out of /{top} could point anywhere, the "
            f"host's files included; refusing to act on {device_path} through it"
        )

    def _check_link(
        self, device_path: str, top: str | None, names: list[str], name: str, target: str
    ) -> None:
        if top is None:
            return
        if target.startswith("/") or _lexical(names, target)[:1] != [top]:
            self._refuse(device_path, [*names, name], target, top)

    def _walk(self, device_path: str, follow_last: bool) -> tuple[list[str], list[int], bool]:
        """Resolve `device_path` inside the root (RESOLVE_IN_ROOT semantics).

        Returns (names, fds, whole): `names` the resolved components below the root; `fds`
        open folders, fds[i] the folder names[:i] (fds[0] the root; the caller closes them);
        `whole`: every folder above the last name exists, so fds[-1] holds the last name
        (when it is not a folder that was opened). Once a component is missing (or not a
        folder with more after it), the rest is taken as written: nothing below exists."""
        top = kernel_top(device_path)
        pending = _parts(device_path)[::-1]  # a stack: the next component last
        names: list[str] = []
        fds = [os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        whole = True
        links = 0
        try:
            while pending:
                name = pending.pop()
                if name == "..":
                    if names:
                        names.pop()
                        if whole and len(fds) > 1:
                            os.close(fds.pop())
                    continue
                if not whole:
                    names.append(name)
                    continue
                last = not pending
                try:
                    st = os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError):
                    names.append(name)
                    whole = last  # a missing last name is fine: it is about to be made
                    continue
                if stat.S_ISLNK(st.st_mode) and (follow_last or not last):
                    links += 1
                    if links > MAX_LINKS:
                        raise OSError(
                            errno.ELOOP,
                            os.strerror(errno.ELOOP),
                            str(self.host("/".join([*names, name]))),
                        )
                    target = os.readlink(name, dir_fd=fds[-1])
                    self._check_link(device_path, top, names, name, target)
                    if target.startswith("/"):  # absolute: from the root, not the host's /
                        names.clear()
                        while len(fds) > 1:
                            os.close(fds.pop())
                    pending.extend(_parts(target)[::-1])
                    continue
                names.append(name)
                if last:
                    break
                if stat.S_ISDIR(st.st_mode):
                    fds.append(_open_dir(name, fds[-1]))
                else:
                    whole = False  # a file in the middle: the operation answers ENOTDIR
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if top is not None and names[:1] != [top]:
            for fd in fds:
                os.close(fd)
            raise PathRefused(
                f"{device_path}: leads out of /{top} of the image root "
                f"{self.root}; refusing to write through it"
            )
        return names, fds, whole

    def resolve(self, device_path: str, follow: bool = True) -> str:
        """The device path `device_path` leads to inside the root, every link on the way
        resolved (the last one too unless `follow` is false). Missing parts are kept as
        written. The live root answers `device_path` itself."""
        if self.live:
            return device_path
        names, fds, _ = self._walk(device_path, follow)
        for fd in fds:
            os.close(fd)
        return "/" + "/".join(names)

    @contextlib.contextmanager
    def _at(self, device_path: str, follow: bool) -> Iterator[tuple[int, str]]:
        """(folder fd, name) of the file `device_path` leads to, for an *at() call."""
        names, fds, whole = self._walk(device_path, follow)
        try:
            if not whole:
                raise FileNotFoundError(
                    errno.ENOENT, os.strerror(errno.ENOENT), str(self.host(device_path))
                )
            if not names or len(fds) != len(names):
                raise IsADirectoryError(
                    errno.EISDIR, os.strerror(errno.EISDIR), str(self.host(device_path))
                )
            yield fds[-1], names[-1]
        finally:
            for fd in fds:
                os.close(fd)

    def check_kernel_links(self) -> None:
        """Refuse (PathRefused) an image root with a link under proc/ or sys/ that is
        absolute or leads out of that folder (see the module doc). The live root has none to
        refuse: its /proc and /sys are the kernel's."""
        if self.live:
            return
        for top in KERNEL_DIRS:
            base = self.root / top
            if base.is_symlink():
                self._refuse(f"/{top}", [top], os.readlink(base), top)
            for folder, dirs, files in os.walk(base):
                rel = Path(folder).relative_to(self.root).parts
                for name in (*dirs, *files):
                    path = os.path.join(folder, name)
                    if os.path.islink(path):
                        target = os.readlink(path)
                        self._check_link("/" + "/".join([*rel, name]), top, list(rel), name, target)

    # -- reading -------------------------------------------------------------------------
    def read_bytes(self, device_path: str) -> bytes | None:
        """The content of the file the path leads to, or None when there is none. Other
        errors (EACCES, EIO) propagate: "unreadable" must not pass for "absent"."""
        if self.live:
            try:
                return self.host(device_path).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                return None
        shown = self.host(device_path)
        try:
            with self._at(device_path, follow=True) as (folder, name):
                fd = open_regular(name, os.O_RDONLY | os.O_NONBLOCK, shown, dir_fd=folder)
            return read_capped(fd, shown)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except PathRefused as exc:
            if isinstance(exc, NotRegularFile):
                resolved = self.resolve(device_path)
                if resolved != device_path:  # name the node too, not only the link to it
                    exc = NotRegularFile(f"{shown} (a link to {self.host(resolved)})", exc.kind)
            note(self.refused, exc)
            raise exc from None

    def check_file(self, device_path: str, follow: bool = True) -> None:
        """NotRegularFile when the path leads to a FIFO, socket or device node of the image
        (anything else, nothing included, passes): `apply` checks every path it will act on
        before it writes any. The live root's files are the system's own: not checked."""
        if self.live:
            return
        try:
            mode = self.stat(device_path).st_mode if follow else self.lstat(device_path).st_mode
        except OSError:
            return  # missing, or unreadable: the operation itself reports it
        check_mode(self.host(device_path), mode)

    def read(self, device_path: str) -> str | None:
        """`read_bytes` as exact text (UTF-8 with surrogateescape, no newline translation)."""
        data = self.read_bytes(device_path)
        return None if data is None else data.decode("utf-8", "surrogateescape")

    def lstat(self, device_path: str) -> os.stat_result:
        """The file itself (a last link is not followed)."""
        if self.live:
            return os.lstat(self.host(device_path))
        with self._at(device_path, follow=False) as (folder, name):
            return os.stat(name, dir_fd=folder, follow_symlinks=False)

    def stat(self, device_path: str) -> os.stat_result:
        """What the path leads to (links followed inside the root)."""
        if self.live:
            return os.stat(self.host(device_path))
        with self._at(device_path, follow=True) as (folder, name):
            return os.stat(name, dir_fd=folder, follow_symlinks=False)

    def lexists(self, device_path: str) -> bool:
        try:
            self.lstat(device_path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def is_dir(self, device_path: str) -> bool:
        try:
            return stat.S_ISDIR(self.stat(device_path).st_mode)
        except OSError:
            return False

    def is_file(self, device_path: str) -> bool:
        try:
            return stat.S_ISREG(self.stat(device_path).st_mode)
        except (OSError, PathRefused):
            return False

    def is_link(self, device_path: str) -> bool:
        try:
            return stat.S_ISLNK(self.lstat(device_path).st_mode)
        except OSError:
            return False

    def readlink(self, device_path: str) -> str:
        if self.live:
            return os.readlink(self.host(device_path))
        with self._at(device_path, follow=False) as (folder, name):
            return os.readlink(name, dir_fd=folder)

    # -- writing -------------------------------------------------------------------------
    def open(self, device_path: str, flags: int, mode: int = 0o777) -> int:
        """os.open of the file itself, never through a last link (O_NOFOLLOW)."""
        if self.live:
            return os.open(self.host(device_path), flags | os.O_NOFOLLOW, mode)
        with self._at(device_path, follow=False) as (folder, name):
            try:  # what is there must be a regular file (sysconf.regular_files)
                return open_regular(name, flags, self.host(device_path), dir_fd=folder)
            except FileNotFoundError:
                if not flags & os.O_CREAT:
                    raise
            # Made here, so a regular file (O_EXCL: nothing may appear there meanwhile).
            return os.open(name, flags | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=folder)

    def write(self, device_path: str, content: str, kernel: bool) -> None:
        """Write `content` to the file the path leads to (a link stays a link: its target is
        written). Kernel files in place with one write(); regular files through a temporary
        file, fsync and rename, so a crash never leaves them half-written."""
        if self.live:
            write_file(self.host(device_path), content, kernel)
            return
        with self._at(device_path, follow=True) as (folder, name):
            if kernel:
                # In place, as the kernel takes it; an image's kernel file only if it has one
                # as a regular file (module doc): never created, never a node's device.
                fd = open_regular(
                    name,
                    os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK,
                    self.host(device_path),
                    dir_fd=folder,
                )
                with _text(fd) as f:
                    f.write(content)
                return
            mode = None
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):  # it became a link since the walk
                    raise OSError(
                        errno.ELOOP, os.strerror(errno.ELOOP), str(self.host(device_path))
                    )
                check_mode(self.host(device_path), st.st_mode)  # never replace a node
                mode = stat.S_IMODE(st.st_mode)
            tmp = temp_name(name)
            _unlink_quiet(tmp, folder)  # a left-over, or a link planted at that name
            try:
                fd = os.open(
                    tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o666,
                    dir_fd=folder,
                )
                with _text(fd) as f:
                    f.write(content)
                    f.flush()
                    if mode is not None:
                        with contextlib.suppress(OSError):
                            os.fchmod(f.fileno(), mode)
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)  # a failed write leaves no stray file
                raise
            _fsync(folder)

    def symlink(self, device_path: str, target: str) -> None:
        """Make the path a symlink to `target` atomically (a temporary link, then rename)."""
        if self.live:
            write_symlink(self.host(device_path), target)
            return
        with self._at(device_path, follow=False) as (folder, name):
            tmp = temp_name(name)
            _unlink_quiet(tmp, folder)
            os.symlink(target, tmp, dir_fd=folder)
            try:
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
            _fsync(folder)

    def chmod(self, device_path: str, mode: int) -> None:
        """chmod of the file itself; a link there (a race) is left alone (ELOOP)."""
        if self.live:
            os.chmod(self.host(device_path), mode)
            return
        with self._at(device_path, follow=False) as (folder, name):
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(self.host(device_path)))
            # fchmod refuses an O_PATH fd; its /proc/self/fd entry names exactly that inode.
            os.chmod(f"/proc/self/fd/{fd}", mode)
        finally:
            os.close(fd)

    def unlink(self, device_path: str, missing_ok: bool = False) -> None:
        """Remove the name itself (a link, not what it points to)."""
        try:
            if self.live:
                self.host(device_path).unlink()
                return
            with self._at(device_path, follow=False) as (folder, name):
                os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, device_path: str, mode: int = 0o777) -> None:
        if self.live:
            self.host(device_path).mkdir(mode=mode)
            return
        with self._at(device_path, follow=False) as (folder, name):
            os.mkdir(name, mode, dir_fd=folder)

    def makedirs(self, device_path: str, mode: int = 0o777) -> None:
        """mkdir -p inside the root (links on the way followed inside it)."""
        if self.live:
            self.host(device_path).mkdir(parents=True, exist_ok=True, mode=mode)
            return
        parts = _parts(self.resolve(device_path))  # a linked folder: make what it leads to
        for index in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:index])
            if self.is_dir(prefix):
                continue
            try:
                self.mkdir(prefix, mode)
            except FileExistsError:
                if not self.is_dir(prefix):
                    raise

    def rmdir(self, device_path: str) -> None:
        if self.live:
            self.host(device_path).rmdir()
            return
        with self._at(device_path, follow=False) as (folder, name):
            os.rmdir(name, dir_fd=folder)

    def rename(self, device_path: str, new_path: str) -> None:
        if self.live:
            self.host(device_path).rename(self.host(new_path))
            return
        with (
            self._at(device_path, follow=False) as (folder, name),
            self._at(new_path, follow=False) as (new_folder, new_name),
        ):
            os.rename(name, new_name, src_dir_fd=folder, dst_dir_fd=new_folder)

    def fsync_dir(self, device_path: str) -> None:
        """fsync a folder (its entries survive a power cut); errors are ignored."""
        if self.live:
            fsync_path(self.host(device_path))
            return
        with contextlib.suppress(OSError):
            with self._at(device_path, follow=True) as (folder, name):
                fd = os.open(name, _DIR, dir_fd=folder)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def parent(self, device_path: str) -> str:
        return posixpath.dirname(device_path.rstrip("/")) or "/"


def _text(fd: int):
    # Exact text: no newline translation, undecodable bytes kept (see ConfinedRoot.read).
    return os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape", newline="")


# -- the live root's plain path operations ------------------------------------------------------
# Used as they always were for "/" (and by callers that hold a host path of their own, such as
# a test's writer); an image root never reaches them.


def read_current(path: Path) -> str | None:
    """The file's exact text, or None when it does not exist. Any other error (EACCES on a
    write-only sysctl, EIO) propagates: "unreadable" must not pass for "absent", or revert
    would delete a file it never created."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return data.decode("utf-8", "surrogateescape")


def temp_path(path: Path) -> Path:
    """Where `write_file` stages a regular file before the rename."""
    return path.with_name(temp_name(path.name))


def _open_text(path: Path, mode: str):
    return open(path, mode, encoding="utf-8", errors="surrogateescape", newline="")


def write_file(path: Path, content: str, kernel: bool) -> None:
    """For kernel files the write itself is the change. Regular files (boot config,
    irqbalance defaults) go through a temporary file, fsync and rename, so a crash never
    leaves them half-written."""
    if kernel:
        with _open_text(path, "w") as f:
            f.write(content)
        return
    tmp = temp_path(path)
    try:
        with _open_text(tmp, "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a failed write leaves no stray file behind
        raise
    fsync_path(path.parent)


def write_symlink(path: Path, target: str) -> None:
    """Make `path` a symlink to `target` atomically (a temporary link, then rename over)."""
    tmp = temp_path(path)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(path.parent)


def fsync_path(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
