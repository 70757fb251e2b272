"""The system shared-memory extension: the registry of regions local clients registered
(POSIX shm objects under /dev/shm), and the reading of input tensors from them and writing of
output tensors into them, for both front ends (HTTP and gRPC share one registry).

A client's object is never mapped into the daemon. The client owns it and may shrink it at
any moment (ftruncate), or it may be a sparse object on a full /dev/shm: touching a mapped
page that is no longer backed is SIGBUS, which kills the daemon, and no check made earlier
can rule it out (the request waits in a queue between its check and its read). So inputs are
read with pread(2) on the region's descriptor into an array the daemon owns, and outputs are
written with pwrite(2): a shrunk object is a short read, a full one ENOSPC, each a 400 naming
the region. The price is one copy of each input (about 0.2 ms for 4.9 MB here).

Regions belong to the client that registered them (`edged.serving.peers.Peer.key`): each
client user has its own names, and sees, uses and unregisters only its own. The object must
be the caller's: owned by its uid (uid 0 may name any), or, for a caller whose uid is not
known (the gRPC Unix socket), shared on purpose (its mode grants the group or others access).
Regions are capped in all and per client: each holds one open descriptor (O_NOFOLLOW,
O_CLOEXEC), so its object cannot be swapped for another by renaming.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from edged.serving.errors import RequestError
from edged.serving.peers import Peer
from edged.serving.protocol import ProtocolError, ShmRef, byteorder
from edged.serving.responses import datatype_of_dtype, little_endian

SHM_ROOT = Path("/dev/shm")  # where Linux keeps POSIX shared-memory objects (shm_open)
NAME_MAX = 255  # the longest file name, and so the longest shm object name
_NATIVE: dict[np.dtype, np.dtype] = {}


class SharedMemoryError(RequestError):
    """A refused shared-memory request, with its HTTP status (400: bad input, 403: off);
    gRPC gives INVALID_ARGUMENT and PERMISSION_DENIED."""


class TooManyRegions(SharedMemoryError):
    """A cap reached ([server] max_shm_regions, max_shm_regions_per_client)."""

    grpc_code = "RESOURCE_EXHAUSTED"


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
    """One registered region: [offset, offset + byte_size) of the shm object `key`, open as
    `fd` (for reading; and writing when `writable`)."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    writable: bool

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def position(self, ref: ShmRef, where: str) -> int:
        """Where `ref`'s bytes start in the object, after checking they lie in the region."""
        if ref.offset + ref.byte_size > self.byte_size:
            raise SharedMemoryError(
                400,
                f"{where}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                f"{ref.byte_size} runs past the end of region {self.name!r} "
                f"({self.byte_size} bytes)",
            )
        return self.offset + ref.offset

    def shrank(self, where: str, got: int, wanted: int) -> SharedMemoryError:
        return SharedMemoryError(
            400,
            f"{where}: region {self.name!r} ({self.key}) holds {got} of the {wanted} bytes "
            f"asked for: the object shrank since it was registered",
        )

    def read_into(self, buffer: memoryview, position: int, where: str) -> None:
        """Fill `buffer` from the object at `position` (a short read: the object shrank)."""
        done, wanted = 0, len(buffer)
        while done < wanted:
            try:
                n = os.preadv(self.fd, [buffer[done:]], position + done)
            except OSError as exc:
                raise SharedMemoryError(
                    400, f"{where}: cannot read region {self.name!r} ({self.key}): {_why(exc)}"
                ) from None
            if n == 0:
                raise self.shrank(where, done, wanted)
            done += n

    def write_from(self, data: memoryview, position: int, where: str) -> None:
        """Write `data` into the object at `position`. The object must still cover it (a
        write past its end would grow the client's object); a full /dev/shm is ENOSPC."""
        size = os.fstat(self.fd).st_size
        if size < position + len(data):
            raise self.shrank(where, max(0, size - position), len(data))
        done = 0
        while done < len(data):
            try:
                done += os.pwrite(self.fd, data[done:], position + done)
            except OSError as exc:
                raise SharedMemoryError(
                    400,
                    f"{where}: cannot write region {self.name!r} ({self.key}): "
                    f"{_why(exc)}; {done} of {len(data)} bytes written",
                ) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SharedMemory:
    """The registry. Every operation runs on the event loop (HTTP and gRPC share it) except
    the reads and writes of tensors, which take the region they were handed; so it needs no
    lock. `enabled` is `[server] allow_shared_memory`; the caps are max_shm_regions and
    max_shm_regions_per_client."""

    def __init__(
        self,
        enabled: bool,
        root: Path = SHM_ROOT,
        max_regions: int = 64,
        max_per_client: int = 16,
    ) -> None:
        self.enabled = enabled
        self.root = root
        self.max_regions = max_regions
        self.max_per_client = max_per_client
        self._regions: dict[tuple[str, str], Region] = {}  # (Peer.key, name) -> region

    def check_enabled(self) -> None:
        if not self.enabled:
            raise SharedMemoryError(
                403,
                "system shared memory is off ([server] allow_shared_memory = false): send "
                "tensors in the request (binary data, raw_input_contents)",
            )

    def count(self) -> int:
        """Regions registered now (each one open descriptor)."""
        return len(self._regions)

    # -- the extension's operations ---------------------------------------------------------
    def status(self, peer: Peer, name: str = "") -> list[dict[str, Any]]:
        self.check_enabled()
        if name:
            return [self._region(peer, name).status()]
        return [r.status() for (owner, _), r in self._regions.items() if owner == peer.key]

    def register(self, peer: Peer, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        self.check_enabled()
        if not isinstance(name, str) or not name:
            raise SharedMemoryError(400, "a region needs a non-empty name")
        if len(name) > NAME_MAX:
            raise SharedMemoryError(400, f"region name {name[:40]!r}... is over {NAME_MAX} chars")
        file_name = check_key(key)
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SharedMemoryError(400, f"{what} must be a non-negative integer")
        if byte_size == 0:
            raise SharedMemoryError(400, "byte_size must be at least 1")
        have = self._regions.get((peer.key, name))
        if have is not None:
            raise AlreadyRegistered(
                400,
                f"shared memory region {name!r} is already registered (key {have.key}); "
                f"unregister it first",
            )
        mine = sum(1 for owner, _ in self._regions if owner == peer.key)
        if mine >= self.max_per_client:
            raise TooManyRegions(
                400,
                f"{mine} regions are registered by this client ({peer.key}), the most "
                f"[server] max_shm_regions_per_client allows: unregister some first",
            )
        if len(self._regions) >= self.max_regions:
            raise TooManyRegions(
                400,
                f"{len(self._regions)} regions are registered, the most [server] "
                f"max_shm_regions allows: unregister some first",
            )
        self._regions[(peer.key, name)] = self._open(peer, name, key, file_name, offset, byte_size)

    def unregister(self, peer: Peer, name: str = "") -> None:
        """One region, or all of the caller's ("" as Triton's unregister-all). A name not
        registered is an error (Triton answers it with success; an error tells a client its
        mistake)."""
        self.check_enabled()
        if name:
            region = self._regions.pop((peer.key, name), None)
            if region is None:
                raise SharedMemoryError(
                    400, f"shared memory region {name!r} is not registered (nothing unregistered)"
                )
            region.close()
            return
        for k in [k for k in self._regions if k[0] == peer.key]:
            self._regions.pop(k).close()

    # -- CUDA shared memory, as a Triton built without GPUs answers it --------------------
    # Clients written for Triton (its C++ examples among them) unregister all CUDA regions
    # before they start; a server with no GPU has none, so that succeeds, a status lists
    # none, and only a register is refused.
    def cuda_status(self, name: str = "") -> list[dict[str, Any]]:
        self.check_enabled()
        if name:
            raise SharedMemoryError(404, f"Unable to find cuda shared memory region: {name!r}")
        return []

    def cuda_register(self, name: str) -> NoReturn:
        self.check_enabled()
        raise SharedMemoryError(
            400,
            f"failed to register CUDA shared memory region: {name!r}, GPUs not supported "
            f"(edged runs no CUDA devices; use system shared memory)",
        )

    def cuda_unregister(self, name: str = "") -> None:
        self.check_enabled()  # nothing is ever registered: unregistering succeeds

    def close(self) -> list[str]:
        """At shutdown: close every region. Returns nothing left open (kept for callers)."""
        for region in self._regions.values():
            region.close()
        self._regions = {}
        return []

    # -- tensors ------------------------------------------------------------------------------
    def region(self, peer: Peer, ref: ShmRef, where: str) -> Region:
        """The caller's region a tensor names (at admission; the read or write comes later
        and is checked again then)."""
        self.check_enabled()
        return self._region(peer, ref.region, where)

    def read_input(
        self, peer: Peer, name: str, dtype: np.dtype, shape: tuple[int, ...], ref: ShmRef
    ) -> np.ndarray:
        """Input `name` read from its region into an array of its own."""
        self.check_enabled()
        where = f"input {name!r}"
        region = self._region(peer, ref.region, where)
        expected = math.prod(shape) * dtype.itemsize
        if ref.byte_size != expected:
            raise SharedMemoryError(
                400,
                f"{where}: shared_memory_byte_size {ref.byte_size} does not match shape "
                f"{list(shape)} of {datatype_of_dtype(dtype)} ({expected} bytes)",
            )
        position = region.position(ref, where)
        if dtype.kind == "b":
            raw = np.empty(expected, np.uint8)
            region.read_into(raw.data, position, where)
            return (raw != 0).reshape(shape)
        array = np.empty(shape, byteorder(_NATIVE, dtype, "="))
        target = array.reshape(-1).view(np.uint8).data
        region.read_into(target, position, where)
        if array.dtype != dtype:  # the wire is little-endian; this machine is not
            array = array.view(dtype).astype(array.dtype)
        return array

    def write_outputs(
        self, peer: Peer, refs: Mapping[str, ShmRef], outputs: Mapping[str, np.ndarray]
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
            region = self._region(peer, ref.region, where)
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
            plan.append((name, ref, array, region, region.position(ref, where)))
        entries = {}
        for name, ref, array, region, position in plan:
            region.write_from(array.reshape(-1).view(np.uint8).data, position, name)
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
    def _region(self, peer: Peer, name: str, where: str = "") -> Region:
        region = self._regions.get((peer.key, name))
        if region is None:
            prefix = f"{where}: " if where else ""
            raise SharedMemoryError(
                400, f"{prefix}unable to find system shared memory region {name!r}"
            )
        return region

    def _open(
        self, peer: Peer, name: str, key: str, file_name: str, offset: int, byte_size: int
    ) -> Region:
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
            _check_owner(peer, key, st)
            if offset + byte_size > st.st_size:
                raise SharedMemoryError(
                    400,
                    f"offset {offset} + byte_size {byte_size} runs past the end of {key!r} "
                    f"({st.st_size} bytes)",
                )
        except BaseException:
            os.close(fd)
            raise
        return Region(name, key, offset, byte_size, fd, writable)


def _check_owner(peer: Peer, key: str, st: os.stat_result) -> None:
    """The object is the caller's to hand over: the daemon must never read or write, on a
    client's say-so, an object that client could not open itself."""
    if peer.uid is not None:
        if peer.uid != 0 and st.st_uid != peer.uid:
            raise SharedMemoryError(
                403,
                f"{key!r} belongs to uid {st.st_uid}, not to this client (uid {peer.uid}): "
                f"register your own objects",
            )
        return
    if not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SharedMemoryError(
            403,
            f"{key!r} is private to its owner (mode {stat.S_IMODE(st.st_mode):04o}) and this "
            f"client's user is not known ({peer.transport}): share it with the group "
            f"(fchmod 0660) or register it over the HTTP Unix socket",
        )


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "no such shared-memory object (create it first, e.g. shm_open)"
    if exc.errno == errno.EACCES:
        return "permission denied (the daemon's user cannot open it; check its mode/owner)"
    if exc.errno == errno.ELOOP:
        return "a symbolic link (refused)"
    return exc.strerror or str(exc)
