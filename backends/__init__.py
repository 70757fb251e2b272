"""Inference runtimes behind one interface (`backends.base.Backend`).

Each backend module is imported only when asked for by name, and imports its runtime only
when it lists candidates or loads a model, so running a LiteRT model never imports OpenVINO.
"""

from __future__ import annotations

import importlib

from backends.base import Backend, Candidate, LoadOptions, Session
from backends.errors import BackendError, InputError, ModelError
from backends.tensors import TensorSpec

# name -> module holding `BACKEND`; registration is data so nothing is imported up front.
REGISTRY = {
    "onnxruntime": "backends.onnxruntime_backend",
    "openvino": "backends.openvino_backend",
    "litert": "backends.litert_backend",
}
ALIASES = {"ort": "onnxruntime", "ov": "openvino", "tflite": "litert"}

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
