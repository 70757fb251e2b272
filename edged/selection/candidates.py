"""The candidates a model can run on here: every backend's (backend, device, precision)
offers and a backend spec ("auto", "openvino:CPU:bf16") matched against them (the float32
references accuracy is judged against are each backend's: `backends.reference_candidates`).
A named backend is asked alone, so pinning one (or loading a cached decision) imports only
its runtime.
"""

from __future__ import annotations

from backends import Candidate, backend_names, canonical_name, get_backend, probe_hardware
from backends.model_info import ModelInfo
from sysconf.hardware import HardwareFacts


def runtime_versions() -> dict[str, str | None]:
    return {name: get_backend(name).version() for name in backend_names()}


def all_candidates(hw: HardwareFacts | None, model: ModelInfo | None) -> list[Candidate]:
    if hw is None:
        hw = probe_hardware()
    result: list[Candidate] = []
    for name in backend_names():
        result.extend(get_backend(name).candidates(hw, model))
    return result


def backend_candidates(
    hw: HardwareFacts | None, model: ModelInfo | None, spec: str = "auto"
) -> list[Candidate]:
    """The candidates matching `spec`. A named backend is asked alone, so pinning one (or
    loading a cached decision) imports only its runtime; "auto"/"all" ask every backend."""
    if spec in ("auto", "all"):
        return all_candidates(hw, model)
    name = canonical_name(spec.split(":")[0])
    if name not in backend_names():
        return []
    if hw is None:
        hw = probe_hardware()
    return [c for c in get_backend(name).candidates(hw, model) if matches(c, spec)]


def find_candidate(
    hw: HardwareFacts | None, model: ModelInfo | None, wanted: Candidate
) -> Candidate:
    """`wanted` as its backend lists it now (with its options), else `wanted` itself."""
    for candidate in backend_candidates(hw, model, wanted.backend):
        if candidate.key == wanted.key:
            return candidate
    return wanted


def matches(candidate: Candidate, spec: str) -> bool:
    """`spec` is "auto", "all", "backend", "backend:device" or "backend:device:precision"."""
    if spec in ("auto", "all"):
        return True
    parts = spec.split(":")
    if canonical_name(parts[0]) != candidate.backend:
        return False
    if len(parts) > 1 and parts[1].upper() != candidate.device.upper():
        return False
    return len(parts) <= 2 or parts[2].lower() == candidate.precision.lower()
