"""The one small interface every inference runtime sits behind.

A backend lists its candidates for this hardware (with a reason when one is unavailable),
loads a model on one candidate with a thread count and CPU set, and gives back a `Session`
with input/output metadata and `run`. Backends know nothing of HTTP, MQTT or config files.
The errors (`backends.errors`) and tensor specs (`backends.tensors`) sit in modules of their
own below this one and `backends.model_info`, so those two do not import each other.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from backends.errors import InputError
from backends.tensors import TensorSpec, format_shape, shape_fits

if TYPE_CHECKING:
    from backends.model_info import ModelInfo
    from sysconf.hardware import HardwareFacts


@dataclass(frozen=True)
class Candidate:
    """One way to run a model: a runtime, a device on it, and the compute precision asked."""

    backend: str
    device: str
    precision: str  # "fp32", "bf16", "fp16", or "model" (runs what the model's graph says)
    available: bool = True
    reason: str = ""  # why it is not available; empty when it is
    options: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    note: str = ""  # what it is, for people (e.g. the device's name); not a why-not

    @property
    def key(self) -> str:
        return f"{self.backend}:{self.device}:{self.precision}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["options"] = dict(self.options)
        return data


def backend_cache(state_dir: Path, backend: str) -> Path:
    """The folder where `backend` keeps what it compiled, under a state dir: one per backend,
    so that no backend finds another's files (OpenVINO's is `<state dir>/openvino-cache`, as
    it always was). The selection cleans them after a failed run."""
    return state_dir / f"{backend}-cache"


@dataclass(frozen=True)
class BackendOption:
    """One key of a backend's own table, `[models.backend_options.<backend>]`: declared in
    the backend's module (`OPTIONS`), read by the config through `backends.read_options`,
    and handed to the backend's `load` in `LoadOptions.backend_options`. Nothing outside the
    backend knows what it means."""

    name: str
    read: Callable[[Any], Any]  # the value as written -> as used; ValueError says why not
    help: str  # one line, for the config's error messages and docs


def read_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class LoadOptions:
    threads: int | None = None
    cpus: Sequence[int] | None = None
    # Concrete input shapes for runtimes that compile statically (OpenVINO GPU/NPU, delegates).
    shapes: Mapping[str, Sequence[int]] | None = None
    # Keep the batch dim dynamic when compiling `shapes` (the daemon batches requests).
    dynamic_batch: bool = False
    # Whether requests come only at `shapes` (the daemon's per-model `shapes`, which it holds
    # requests to). When False, `shapes` are a stand-in size the selection measured at
    # (dynamic dims filled): a runtime that takes any shape where it runs (OpenVINO on the
    # CPU) must not be fixed to them, or the sizes a model accepts would depend on which
    # backend won; one that compiles statically (an NPU) still needs them.
    shapes_bind: bool = True
    # The state dir: a backend that compiles keeps its files in `cache_dir(NAME)` under it;
    # None: nothing is cached.
    cache_root: Path | None = None
    # Each backend's own options (`[models.backend_options.<backend>]`, read by its OPTIONS),
    # by backend name; a backend reads only its own, with `own(NAME)`.
    backend_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)

    def cache_dir(self, backend: str) -> Path | None:
        return None if self.cache_root is None else backend_cache(self.cache_root, backend)

    def own(self, backend: str) -> Mapping[str, Any]:
        return self.backend_options.get(backend, {})

    def thread_count(self) -> int:
        if self.threads:
            return self.threads
        if self.cpus:
            return len(self.cpus)
        return len(os.sched_getaffinity(0))


class Session(Protocol):
    candidate: Candidate
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def info(self) -> dict[str, Any]:
        """What really ran: `precision` (executed), and e.g. delegate coverage."""
        ...

    def close(self) -> None: ...

    # Optional: `sensors() -> dict[str, float]`, the device's readings in base units for
    # telemetry ({"temperature_celsius": .., "power_watts": ..}); cheap, never raises.


class Backend(Protocol):
    """What a backend module's BACKEND is. The module also declares NAME, ALIASES, ORDER,
    FORMATS (the formats it owns: `backends.formats.ModelFormat`) and DEVICES (vendor device
    nodes: `sysconf.hardware.DeviceNode`); see `backends/__init__.py`."""

    name: str
    formats: tuple[str, ...]  # model formats (ModelInfo.format) this runtime reads

    def version(self) -> str | None:
        """The runtime's version, or None when it is not installed."""
        ...

    def candidates(self, hw: HardwareFacts, model: ModelInfo | None) -> list[Candidate]: ...

    def load(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> Session: ...

    def reference(self, model: ModelInfo) -> Candidate | None:
        """Its float32 CPU candidate that computes `model` most literally (the accuracy
        reference), or None when it has none (an NPU-only runtime: the family's original
        is the reference)."""
        ...


@functools.cache
def dist_version(*dists: str) -> str | None:
    """Installed version of the first distribution found, read from package metadata so that
    asking (for a cache key, for `edgectl backends`) does not import the runtime. Read once
    per process: the runtime in memory is the one imported at the first use (an upgrade on
    disk takes effect on restart), and a metadata scan on every model load left reference
    cycles behind for the collector."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def unavailable(backend: str, device: str, reason: str, precision: str = "model") -> Candidate:
    return Candidate(backend, device, precision, available=False, reason=reason)


def check_feeds(specs: Sequence[TensorSpec], feeds: Mapping[str, np.ndarray], model: str) -> None:
    """Reject wrong names, dtypes and shapes before the runtime sees them.

    Runtimes do check, but their messages name internal nodes or crash the process (LiteRT
    on a wrong buffer size), so the caller gets one clear line naming the input instead.
    """
    expected = {s.name: s for s in specs}
    unknown = sorted(set(feeds) - set(expected))
    if unknown:
        raise InputError(
            f"{model}: unknown input {unknown[0]!r}; the model's inputs are {sorted(expected)}"
        )
    missing = sorted(set(expected) - set(feeds))
    if missing:
        raise InputError(f"{model}: input {missing[0]!r} is missing")
    for name, array in feeds.items():
        spec = expected[name]
        if not isinstance(array, np.ndarray):
            raise InputError(
                f"{model}: input {name!r} must be a numpy array, not {type(array).__name__}"
            )
        if array.dtype.name != spec.dtype:
            raise InputError(
                f"{model}: input {name!r} has dtype {array.dtype.name}, expected {spec.dtype}"
            )
        if not shape_fits(spec.shape, array.shape):
            raise InputError(
                f"{model}: input {name!r} has shape {format_shape(array.shape)}, "
                f"expected {format_shape(spec.shape)}"
            )


class FloatIO:
    """A session of a model with quantized inputs and outputs (a full-integer TFLite made
    with int8 or uint8 IO) that takes and gives float32, through each tensor's own scale and
    zero point: how the accuracy gate holds such a model to its float original. Sessions
    that have quantized IO say so in `io_quantization` (name -> (scale, zero point))."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.candidate = session.candidate
        self._q: Mapping[str, tuple[float, int]] = session.io_quantization  # type: ignore[attr-defined]
        self._dtypes = {s.name: np.dtype(s.dtype) for s in (*session.inputs, *session.outputs)}
        self.inputs = [self._float(s) for s in session.inputs]
        self.outputs = [self._float(s) for s in session.outputs]

    def _float(self, spec: TensorSpec) -> TensorSpec:
        return TensorSpec(spec.name, "float32", spec.shape) if spec.name in self._q else spec

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        converted = {}
        for name, value in feeds.items():
            if name in self._q and np.issubdtype(value.dtype, np.floating):
                scale, zero = self._q[name]
                limits = np.iinfo(self._dtypes[name])
                scaled = np.asarray(value, np.float32) / np.float32(scale)
                # Half away from zero, as LiteRT's QUANTIZE rounds (np.rint rounds to even).
                rounded = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
                value = np.clip(rounded + zero, limits.min, limits.max).astype(self._dtypes[name])
            converted[name] = value
        outputs = self.session.run(converted)
        for name, value in outputs.items():
            if name in self._q:
                scale, zero = self._q[name]
                outputs[name] = (value.astype(np.float32) - zero) * np.float32(scale)
        return outputs

    def info(self) -> dict[str, Any]:
        return {**self.session.info(), "float_io": "quantized at the inputs, dequantized after"}

    def close(self) -> None:
        self.session.close()


def float_io(session: Session) -> Session:
    """`session` taking and giving float32 where its model's IO is quantized, else itself."""
    return FloatIO(session) if getattr(session, "io_quantization", None) else session
