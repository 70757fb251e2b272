"""Inference runtimes behind one interface (`backends.base.Backend`).

Each backend is one module, `backends/<name>_backend.py`, found by its file name. A backend
module imports its runtime only when it lists candidates or loads a model, so running a LiteRT
model never imports OpenVINO.
"""

from __future__ import annotations

import importlib
import pkgutil

from backends.base import Backend, Candidate, LoadOptions, Session
from backends.errors import BackendError, InputError, ModelError
from backends.tensors import TensorSpec

# Every `backends/<name>_backend.py` is a backend, found by its file name: adding a runtime is
# one file (and its test), no list to edit. Each declares NAME, ALIASES, ORDER and BACKEND;
# importing one is cheap because it imports its runtime only when asked to list candidates or
# load a model. ORDER is the order candidates are listed, tried and reported in.
_SUFFIX = "_backend"


def _discover() -> tuple[dict[str, str], dict[str, str]]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.endswith(_SUFFIX):
            module = importlib.import_module(f"{__name__}.{info.name}")
            found.append((module.ORDER, module.NAME, module.__name__, module.ALIASES))
    found.sort()
    registry = {name: module for _, name, module, _ in found}
    aliases = {alias: name for _, name, _, names in found for alias in names}
    return registry, aliases


REGISTRY, ALIASES = _discover()  # name -> module holding `BACKEND`; alias -> name

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
    "get_backend",
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
