"""What a model file is: format, sha256, the precision its graph computes in and the device
a compiled model is built for.

INT8 awareness: an ONNX graph with QDQ pairs or QOperator ops, an OpenVINO IR with
FakeQuantize (or int8-compressed weights), a full-integer TFLite model, an INT8 .rknn and
any HEF are INT8; anything else runs but is flagged. The format is told and read by the
backend that owns it (`FORMATS` in its module, `backends.formats`); inspection reads the
files directly and imports no inference runtime, so it is cheap and safe to do before
choosing one.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar, cast

from backends.errors import ModelError
from backends.formats import Signature, detect
from backends.tensors import format_shape

T = TypeVar("T")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    format: str  # a registered format's name (backends.formats): "onnx", "tflite", "rknn", ...
    sha256: str
    size: int
    precision: str  # "int8", "fp16", "fp32", "mixed"
    precision_detail: str
    # ONNX INT8: "u8s8" (uint8 activations, int8 weights), "u8s8-rr" (7-bit weights,
    # reduce_range), "u8u8", "s8s8"; None where not ONNX INT8 or not told by the graph.
    int8_scheme: str | None = None
    # The device a compiled model is built for, as its file says (an .rknn's
    # target_platform "rk3588", a HEF's "hailo8l"); None for portable formats.
    target: str | None = None

    @property
    def is_int8(self) -> bool:
        return self.precision == "int8"

    @property
    def name(self) -> str:
        return self.path.name

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        data["int8"] = self.is_int8
        return data


def read_model_file(path: Path) -> bytes:
    """The bytes of a model file: a regular file only (`/dev/zero` would never end, and a
    FIFO would block this thread until someone writes), errors naming the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise ModelError(f"{path}: is a folder, not a model file")
        raise ModelError(f"{path}: not a regular file (a device, FIFO or socket)")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as exc:
            raise ModelError(f"{path}: cannot read: {exc.strerror}") from None


def write_model_file(path: Path, data: bytes) -> None:
    """Write a model whole or not at all: via PATH.part (synced, then renamed over `path`),
    which a failure removes. OSError is the caller's to word."""
    part = path.with_name(path.name + ".part")
    try:
        with part.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


# What inspect_model and signature found, per file identity: a model is read and hashed once
# per change of its file, not once per caller (config check, selection, variants job, the
# variants' checks: 2-6 reads of the same file per load). The identity has the inode and
# ctime, which any write or rename changes and no user can set back. Successes only; at
# most _CACHE_MAX entries (the oldest go first).
_CACHE_MAX = 64
_cache: dict[tuple, object] = {}
_cache_lock = threading.Lock()


def _cached(kind: str, path: Path, compute: Callable[[], T]) -> T:
    try:
        st = os.stat(path)
    except OSError:
        return compute()  # its error names the path
    key = (kind, str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _cache_lock:
        if key in _cache:
            return cast(T, _cache[key])
    value = compute()
    with _cache_lock:
        _cache[key] = value
        while len(_cache) > _CACHE_MAX:
            del _cache[next(iter(_cache))]
    return value


def inspect_model(path: str | Path) -> ModelInfo:
    """What the file at `path` is (read and hashed once per change of the file)."""
    path = Path(path)
    return _cached("info", path, lambda: _inspect(path))


def _inspect(path: Path) -> ModelInfo:
    data = read_model_file(path)
    if not data:
        raise ModelError(f"{path}: empty file")
    fmt = detect(path, data)
    facts = fmt.read(path, data)
    return ModelInfo(
        path,
        fmt.name,
        hashlib.sha256(data).hexdigest(),
        len(data),
        facts.precision,
        facts.detail,
        facts.int8_scheme,
        facts.target,
    )


def detect_format(path: Path, data: bytes) -> str:
    """The format's name (`backends.formats.detect`: by magic, else by suffix)."""
    return detect(path, data).name


def signature(path: str | Path) -> Signature | None:
    """A model file's inputs and outputs (names, dtypes, shapes with None for dynamic dims),
    read from the file without a runtime; None for formats read only by a runtime (IR)."""
    path = Path(path)
    found = _cached("signature", path, lambda: _signature(path))
    return None if found is None else (list(found[0]), list(found[1]))  # the lists: the caller's


def _signature(path: Path) -> Signature | None:
    data = read_model_file(path)
    fmt = detect(path, data)
    return fmt.signature(path, data) if fmt.signature is not None else None


def metadata(path: str | Path) -> dict[str, str]:
    """A model file's own key/value metadata (e.g. an ONNX export's class names); empty for a
    format that has none edged reads."""
    path = Path(path)

    def read() -> dict[str, str]:
        data = read_model_file(path)
        fmt = detect(path, data)
        return fmt.metadata(path, data) if fmt.metadata is not None else {}

    return dict(_cached("metadata", path, read))


def signature_mismatch(original: Signature, variant: Signature) -> str | None:
    """What differs between two models' inputs/outputs (names, dtypes, fixed dims), or None.
    A dim that is dynamic in either is not compared (a variant may fix a size)."""
    for kind, want, got in (
        ("inputs", original[0], variant[0]),
        ("outputs", original[1], variant[1]),
    ):
        if [s.name for s in want] != [s.name for s in got]:
            return (
                f"{kind} are {[s.name for s in got]}, the original's are {[s.name for s in want]}"
            )
        for a, b in zip(want, got, strict=True):
            if a.dtype != b.dtype:
                return f"{kind[:-1]} {a.name!r} is {b.dtype}, the original's is {a.dtype}"
            if len(a.shape) != len(b.shape) or any(
                x is not None and y is not None and x != y
                for x, y in zip(a.shape, b.shape, strict=True)
            ):
                return (
                    f"{kind[:-1]} {a.name!r} has shape {format_shape(b.shape)}, the "
                    f"original's is {format_shape(a.shape)}"
                )
    return None
