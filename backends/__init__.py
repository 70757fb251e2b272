"""Inference runtimes behind one interface (`backends.base.Backend`).

Each backend is one module, `backends/<name>_backend.py`, found by its file name, and it holds
everything edged knows about its runtime: the formats it owns and how to recognise them
(`FORMATS`, with the protocol's platform name), the vendor device nodes it uses (`DEVICES`),
its candidates for this hardware, how it loads a model, and its float reference (or none).
A backend module imports its runtime only when it lists candidates or loads a model, so
running a LiteRT model never imports OpenVINO.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import TYPE_CHECKING

from backends.base import Backend, Candidate, LoadOptions, Session
from backends.errors import BackendError, InputError, ModelError
from backends.tensors import TensorSpec

if TYPE_CHECKING:
    from backends.formats import ModelFormat
    from backends.model_info import ModelInfo
    from sysconf.hardware import DeviceNode, HardwareFacts
    from sysconf.sysroot import SysRoot

# Every `backends/<name>_backend.py` is a backend, found by its file name: adding a runtime is
# one file (and its test), no list to edit. Each declares NAME, ALIASES, ORDER, FORMATS,
# DEVICES and BACKEND; importing one is cheap because it imports its runtime only when asked
# to list candidates or load a model. ORDER is the order candidates are listed, tried and
# reported in.
_SUFFIX = "_backend"


def _discover() -> list[ModuleType]:
    modules = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if info.name.endswith(_SUFFIX)
    ]
    return sorted(modules, key=lambda m: (m.ORDER, m.NAME))


_MODULES = _discover()
REGISTRY = {m.NAME: m.__name__ for m in _MODULES}  # name -> module holding `BACKEND`
ALIASES = {alias: m.NAME for m in _MODULES for alias in m.ALIASES}  # alias -> name

__all__ = [
    "REGISTRY",
    "Backend",
    "BackendError",
    "Candidate",
    "InputError",
    "LoadOptions",
    "ModelError",
    "Session",
    "TensorSpec",
    "backend_names",
    "device_nodes",
    "get_backend",
    "model_formats",
    "probe_hardware",
    "reference_candidates",
]


def backend_names() -> list[str]:
    return list(REGISTRY)


def canonical_name(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def get_backend(name: str) -> Backend:
    name = canonical_name(name)
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(REGISTRY)}")
    return importlib.import_module(REGISTRY[name]).BACKEND


def model_formats() -> dict[str, ModelFormat]:
    """Every format a backend owns, by name, in backend order."""
    return {fmt.name: fmt for m in _MODULES for fmt in m.FORMATS}


def format_owner(format_name: str) -> str | None:
    """The backend whose module declares `format_name`."""
    return next((m.NAME for m in _MODULES if any(f.name == format_name for f in m.FORMATS)), None)


def device_nodes() -> list[DeviceNode]:
    """The vendor device nodes every backend declares (for the hardware probe)."""
    return [node for m in _MODULES for node in m.DEVICES]


def probe_hardware(root: SysRoot | None = None, dtb=None) -> HardwareFacts:
    """`sysconf.hardware.probe` looking for every backend's device nodes too: how edged
    probes, so that an NPU whose driver only makes a character device is seen."""
    from sysconf.hardware import probe

    return probe(root, dtb, nodes=device_nodes())


def reference_candidates(model: ModelInfo) -> list[Candidate]:
    """Float32 CPU references for `model`, best first: the backend that owns its format, then
    the others that read it, in backend order; each backend's most literal CPU path. Empty for
    a format only an NPU runs (.rknn, .hef): the family's original is the reference then."""
    owner = format_owner(model.format)
    ordered = sorted(_MODULES, key=lambda m: owner != m.NAME)  # stable: owner first
    found = []
    for module in ordered:
        backend = module.BACKEND
        if model.format in backend.formats:
            candidate = backend.reference(model)
            if candidate is not None:
                found.append(candidate)
    return found
