"""The system shared-memory extension: the registry of regions a local client registered
(POSIX shm objects under /dev/shm), and the reading of input tensors from them and writing of
output tensors into them, for both front ends (HTTP and gRPC share one registry).

Each region maps the object with `os.open` + `mmap`, not `multiprocessing.shared_memory`:
before Python 3.13 attaching a SharedMemory registers it with the resource tracker, which
unlinks the client's object when the daemon exits (and warns of "leaked" segments); and
here the open takes O_NOFOLLOW and O_CLOEXEC, the mapping covers only the registered
range, and the descriptor stays open so each use can fstat the object (a client that
shrank it after registering gets a 400, not a SIGBUS that kills the daemon).

Inputs are numpy views over the mapping (no copy; the engine copies only when it batches
several requests into one). A region unregistered while a request still holds such a view
is closed as soon as the view is gone (`_retired`): the mapping never outlives its users,
and never outlives them by more than the next registry operation or `close()` at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import mmap
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edged.serving.inference import RequestError
from edged.serving.protocol import ProtocolError, ShmRef, byteorder
from edged.serving.responses import datatype_of_dtype, little_endian

SHM_ROOT = Path("/dev/shm")  # where Linux keeps POSIX shared-memory objects (shm_open)
NAME_MAX = 255  # the longest file name, and so the longest shm object name
_NATIVE: dict[np.dtype, np.dtype] = {}


class SharedMemoryError(RequestError):
    """A refused shared-memory request, with its HTTP status (400: bad input, 403: off);
    gRPC gives INVALID_ARGUMENT and PERMISSION_DENIED."""


class AlreadyRegistered(SharedMemoryError):
    """A region name registered twice: Triton's ALREADY_EXISTS, which its HTTP server
    answers 400 (http_server.cc, HttpCodeFromError) and its gRPC server ALREADY_EXISTS."""

    grpc_code = "ALREADY_EXISTS"


def check_key(key: Any) -> str:
    """The shm object's file name for a register request's key: a POSIX shm name ("/name" or
    "name": one component, no "/" after the leading one, no "." or "..", no NUL)."""
    if not isinstance(key, str):
        raise SharedMemoryError(400, "key must be a string (a POSIX shared-memory name)")
    name = key[1:] if key.startswith("/") else key
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise SharedMemoryError(
            400,
            f"key {key!r} is not a POSIX shared-memory name: one name such as '/input0' "
            f"(no other '/', no '..', no NUL), an object under {SHM_ROOT}",
        )
    if len(os.fsencode(name)) > NAME_MAX:
        raise SharedMemoryError(400, f"key {key[:40]!r}... is longer than {NAME_MAX} bytes")
    return name


@dataclass
class Region:
    """One registered region: [offset, offset + byte_size) of the shm object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    map: mmap.mmap
    start: int  # where the region starts in the mapping (its offset within a page)
    writable: bool

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def check(self, ref: ShmRef, where: str) -> int:
        """The start of `ref`'s bytes in the mapping, after checking they lie in the region
        and the object still covers them."""
        if ref.offset + ref.byte_size > self.byte_size:
            raise SharedMemoryError(
                400,
                f"{where}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                f"{ref.byte_size} runs past the end of region {self.name!r} "
                f"({self.byte_size} bytes)",
            )
        # A client may shrink the object after registering: touching the lost pages then is
        # SIGBUS. One fstat per use (≈1 µs) turns that into this error.
        size = os.fstat(self.fd).st_size
        if size < self.offset + self.byte_size:
            raise SharedMemoryError(
                400,
                f"{where}: region {self.name!r} ({self.key}) shrank to {size} bytes since "
                f"it was registered (offset {self.offset}, {self.byte_size} bytes)",
            )
        return self.start + ref.offset

    def close(self) -> bool:
        """Unmap; False while a view into the mapping is still alive (try again later)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.map.close()
        except BufferError:  # an input view of a request still running
            return False
        return True


class SharedMemory:
    """The registry. Every operation runs on the event loop (HTTP and gRPC share it), so
    it needs no lock. `enabled` is `[server] allow_shared_memory`."""

    def __init__(self, enabled: bool, root: Path = SHM_ROOT) -> None:
        self.enabled = enabled
        self.root = root
        self._regions: dict[str, Region] = {}
        self._retired: list[Region] = []  # unregistered, still mapped (a view is alive)
        self._sweeping: asyncio.TimerHandle | None = None

    def check_enabled(self) -> None:
        if not self.enabled:
            raise SharedMemoryError(
                403,
                "system shared memory is off ([server] allow_shared_memory = false): send "
                "tensors in the request (binary data, raw_input_contents)",
            )

    # -- the extension's operations ---------------------------------------------------------
    def status(self, name: str = "") -> list[dict[str, Any]]:
        self.check_enabled()
        self._sweep()
        if name:
            return [self._region(name).status()]
        return [r.status() for r in self._regions.values()]

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        self.check_enabled()
        self._sweep()
        if not isinstance(name, str) or not name:
            raise SharedMemoryError(400, "a region needs a non-empty name")
        file_name = check_key(key)
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SharedMemoryError(400, f"{what} must be a non-negative integer")
        if byte_size == 0:
            raise SharedMemoryError(400, "byte_size must be at least 1")
        if name in self._regions:
            have = self._regions[name]
            raise AlreadyRegistered(
                400,
                f"shared memory region {name!r} is already registered (key {have.key}); "
                f"unregister it first",
            )
        self._regions[name] = self._open(name, key, file_name, offset, byte_size)

    def unregister(self, name: str = "") -> None:
        """One region, or all ("" as Triton's unregister-all). A name not registered is an
        error (Triton answers it with success; an error tells a client its mistake)."""
        self.check_enabled()
        if name:
            region = self._regions.pop(name, None)
            if region is None:
                raise SharedMemoryError(
                    400, f"shared memory region {name!r} is not registered (nothing unregistered)"
                )
            self._retire(region)
        else:
            regions, self._regions = list(self._regions.values()), {}
            for region in regions:
                self._retire(region)
        self._sweep()

    def close(self) -> list[str]:
        """At shutdown, after the workers stopped: unmap everything. Returns the keys of
        mappings that could not be closed (a view still alive: none once workers stopped)."""
        for region in self._regions.values():
            self._retire(region)
        self._regions = {}
        self._sweep()
        return [r.key for r in self._retired]

    # -- tensors ------------------------------------------------------------------------------
    def read_input(
        self, name: str, dtype: np.dtype, shape: tuple[int, ...], ref: ShmRef
    ) -> np.ndarray:
        """Input `name` as a view of its bytes in the region (a copy only for BOOL, made 0/1)."""
        self.check_enabled()
        where = f"input {name!r}"
        region = self._region(ref.region, where)
        expected = math.prod(shape) * dtype.itemsize
        if ref.byte_size != expected:
            raise SharedMemoryError(
                400,
                f"{where}: shared_memory_byte_size {ref.byte_size} does not match shape "
                f"{list(shape)} of {datatype_of_dtype(dtype)} ({expected} bytes)",
            )
        start = region.check(ref, where)
        if dtype.kind == "b":
            raw = np.frombuffer(region.map, np.uint8, expected, start)
            return (raw != 0).reshape(shape)
        array = np.frombuffer(region.map, dtype, math.prod(shape), start).reshape(shape)
        return array.astype(byteorder(_NATIVE, dtype, "="), copy=False)

    def write_outputs(
        self, refs: Mapping[str, ShmRef], outputs: Mapping[str, np.ndarray]
    ) -> dict[str, dict[str, Any]]:
        """Each output of `refs` written into its region: all checked first (unknown output,
        too large, a read-only region), so a refused request writes nothing. Returns each
        one's response entry (name, datatype, shape, and its shared-memory parameters, as
        Triton answers: no data)."""
        self.check_enabled()
        plan = []
        for name, ref in refs.items():
            where = f"output {name!r}"
            if name not in outputs:
                raise ProtocolError(f"unknown output {name!r}; outputs are {sorted(outputs)}")
            array = np.ascontiguousarray(little_endian(np.asarray(outputs[name])))
            region = self._region(ref.region, where)
            if array.nbytes > ref.byte_size:
                raise SharedMemoryError(
                    400,
                    f"{where} is {array.nbytes} bytes (shape {list(array.shape)}), more than "
                    f"its shared_memory_byte_size {ref.byte_size}: nothing written",
                )
            if not region.writable:
                raise SharedMemoryError(
                    400, f"{where}: region {ref.region!r} ({region.key}) is read-only here"
                )
            plan.append((name, ref, array, region, region.check(ref, where)))
        entries = {}
        for name, ref, array, region, start in plan:
            target = np.frombuffer(region.map, np.uint8, array.nbytes, start)
            target[:] = array.reshape(-1).view(np.uint8)
            del target
            params: dict[str, Any] = {
                "shared_memory_region": ref.region,
                "shared_memory_byte_size": array.nbytes,
            }
            if ref.offset:
                params["shared_memory_offset"] = ref.offset
            entries[name] = {
                "name": name,
                "datatype": datatype_of_dtype(array.dtype),
                "shape": list(array.shape),
                "parameters": params,
            }
        return entries

    # -- inside --------------------------------------------------------------------------------
    def _region(self, name: str, where: str = "") -> Region:
        region = self._regions.get(name)
        if region is None:
            prefix = f"{where}: " if where else ""
            raise SharedMemoryError(
                400, f"{prefix}unable to find system shared memory region {name!r}"
            )
        return region

    def _open(self, name: str, key: str, file_name: str, offset: int, byte_size: int) -> Region:
        path = self.root / file_name
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        writable = True
        try:
            try:
                fd = os.open(path, os.O_RDWR | flags)
            except PermissionError:  # read-only for us: serves inputs only
                fd = os.open(path, os.O_RDONLY | flags)
                writable = False
        except OSError as exc:
            raise SharedMemoryError(400, f"cannot open {key!r} ({path}): {_why(exc)}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SharedMemoryError(400, f"{key!r} ({path}) is not a shared-memory object")
            if offset + byte_size > st.st_size:
                raise SharedMemoryError(
                    400,
                    f"offset {offset} + byte_size {byte_size} runs past the end of {key!r} "
                    f"({st.st_size} bytes)",
                )
            page_start = offset - offset % mmap.ALLOCATIONGRANULARITY
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(
                fd, offset + byte_size - page_start, access=access, offset=page_start
            )
        except BaseException:
            os.close(fd)
            raise
        return Region(name, key, offset, byte_size, fd, mapping, offset - page_start, writable)

    def _retire(self, region: Region) -> None:
        self._retired.append(region)

    def _sweep(self) -> None:
        """Close the retired mappings whose views are gone; retry the others soon."""
        self._retired = [r for r in self._retired if not r.close()]
        if self._retired and self._sweeping is None:
            with contextlib.suppress(RuntimeError):  # no loop: the next operation retries
                loop = asyncio.get_running_loop()
                self._sweeping = loop.call_later(0.1, self._swept)

    def _swept(self) -> None:
        self._sweeping = None
        self._sweep()


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "no such shared-memory object (create it first, e.g. shm_open)"
    if exc.errno == errno.EACCES:
        return "permission denied (the daemon's user cannot open it; check its mode/owner)"
    if exc.errno == errno.ELOOP:
        return "a symbolic link (refused)"
    return exc.strerror or str(exc)
