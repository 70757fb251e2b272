"""Inference runtimes behind one interface (`backends.base.Backend`).

Each backend is one module, `backends/<name>_backend.py`, or one package, `backends/<name>/`
(a large one: its format reader, its vendor-stack probe and its session in modules of their
own), found by its file name, and it holds
everything edged knows about its runtime: the formats it owns and how to recognise them
(`FORMATS`, with the protocol's platform name), the vendor device nodes it uses (`DEVICES`),
its candidates for this hardware, how it loads a model, and its float reference (or none).
A backend module imports its runtime only when it lists candidates or loads a model, so
running a LiteRT model never imports OpenVINO.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from backends.base import Backend, BackendOption, Candidate, LoadOptions, Session
    from backends.errors import BackendError, InputError, ModelError
    from backends.formats import ModelFormat
    from backends.model_info import ModelInfo
    from backends.tensors import TensorSpec
    from sysconf.hardware import DeviceNode, HardwareFacts
    from sysconf.sysroot import SysRoot

# Every `backends/<name>_backend.py` and every package `backends/<name>/` is a backend, found
# by its file name: adding a runtime is one file or one folder (and its test), no list to
# edit. Each declares NAME, ALIASES, ORDER, FORMATS, DEVICES, CPU_DEVICES, OPTIONS (its
# `[models.backend_options.<name>]` keys) and BACKEND; optionally OLDER_KEYS, QUANTIZE_TARGETS and
# NPU_TARGETS (with `form_note`) for `edgectl quantize`, and `quiet_native_info`. Importing one
# is cheap because it imports its runtime only when asked to list candidates or load a model.
# ORDER is the order candidates are listed, tried and reported in. They are found on first
# use, not when this package is imported: `import backends.errors` (what many modules need)
# then costs neither the backends nor numpy.
_SUFFIX = "_backend"
# Names this package hands on from its modules, imported when first asked for (PEP 562).
_EXPORTS = {
    "Backend": "backends.base",
    "Candidate": "backends.base",
    "LoadOptions": "backends.base",
    "Session": "backends.base",
    "BackendError": "backends.errors",
    "InputError": "backends.errors",
    "ModelError": "backends.errors",
    "TensorSpec": "backends.tensors",
}


@functools.cache
def _modules() -> tuple[ModuleType, ...]:
    modules = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if info.name.endswith(_SUFFIX) or info.ispkg
    ]
    return tuple(sorted(modules, key=lambda m: (m.ORDER, m.NAME)))


def _registry() -> dict[str, str]:
    """name -> the module holding its `BACKEND`."""
    return {m.NAME: m.__name__ for m in _modules()}


def _aliases() -> dict[str, str]:
    return {alias: m.NAME for m in _modules() for alias in m.ALIASES}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "REGISTRY":
        return _registry()
    if name == "ALIASES":
        return _aliases()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "options_of",
    "probe_hardware",
    "read_options",
    "reference_candidates",
    "runs_on_cpu",
]


def backend_names() -> list[str]:
    return list(_registry())


def canonical_name(name: str) -> str:
    name = name.strip().lower()
    return _aliases().get(name, name)


def read_options(name: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """A `[models.backend_options.<name>]` table read by the backend's own OPTIONS: each key
    as the backend uses it. OptionError names the key (relative to the table) and why."""
    from backends.errors import OptionError

    registry = _registry()
    if name not in registry:
        raise OptionError("", f"no backend is called {name!r}; known: {', '.join(registry)}")
    declared = {o.name: o for o in importlib.import_module(registry[name]).OPTIONS}
    read: dict[str, Any] = {}
    for key, value in table.items():
        if key not in declared:
            takes = ", ".join(declared) if declared else "none"
            raise OptionError(key, f"{name} has no option {key!r} (its options: {takes})")
        try:
            read[key] = declared[key].read(value)
        except ValueError as exc:
            raise OptionError(key, f"{declared[key].help}: {exc}") from None
    return read


def quantize_targets(fmt: str) -> tuple[str, ...]:
    """The targets `edgectl quantize` gates an INT8 model of format `fmt` on, in backend
    order: each backend declares its own (QUANTIZE_TARGETS, optional)."""
    return tuple(
        target for m in _modules() for target, _ in getattr(m, "QUANTIZE_TARGETS", {}).get(fmt, ())
    )


def target_device(target: str) -> tuple[str, str]:
    """A quantize target as (backend, device): as its backend declares it, else
    BACKEND[:DEVICE] with the CPU when no device is given."""
    for m in _modules():
        for pairs in getattr(m, "QUANTIZE_TARGETS", {}).values():
            for name, device in pairs:
                if name == target:
                    return m.NAME, device
    backend, _, device = target.partition(":")
    return canonical_name(backend), device or "CPU"


def npu_targets() -> dict[str, str]:
    """NPU targets `edgectl quantize` makes a full-integer model for -> the backend whose
    delegate runs them (each backend's NPU_TARGETS, optional)."""
    return {t: m.NAME for m in _modules() for t in getattr(m, "NPU_TARGETS", ())}


def npu_form_note(target: str, path: Path) -> str:
    """One line: whether the model at `path` is in the form `target`'s NPU runs."""
    module = importlib.import_module(_registry()[npu_targets()[target]])
    return module.form_note(target, path)


def quiet_native_info() -> None:
    """Ask every backend that writes native INFO lines to stderr to drop them (the CLI's
    stderr is for its own errors): each module's optional `quiet_native_info`."""
    for m in _modules():
        quiet = getattr(m, "quiet_native_info", None)
        if quiet is not None:
            quiet()


def older_option_keys() -> dict[str, str]:
    """[[models]] keys that older configs wrote a backend's option as -> that backend (each
    module's optional OLDER_KEYS): read as `[models.backend_options.<backend>]` keys."""
    return {key: m.NAME for m in _modules() for key in getattr(m, "OLDER_KEYS", ())}


def options_of(name: str) -> tuple[BackendOption, ...]:
    """The options a backend declares (for docs and `edgectl backends`)."""
    return tuple(importlib.import_module(_registry()[canonical_name(name)]).OPTIONS)


def get_backend(name: str) -> Backend:
    name = canonical_name(name)
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(registry)}")
    return importlib.import_module(registry[name]).BACKEND


def model_formats() -> dict[str, ModelFormat]:
    """Every format a backend owns, by name, in backend order."""
    return {fmt.name: fmt for m in _modules() for fmt in m.FORMATS}


def format_owner(format_name: str) -> str | None:
    """The backend whose module declares `format_name`."""
    return next((m.NAME for m in _modules() if any(f.name == format_name for f in m.FORMATS)), None)


def device_nodes() -> list[DeviceNode]:
    """The vendor device nodes every backend declares (for the hardware probe)."""
    return [node for m in _modules() for node in m.DEVICES]


def runs_on_cpu(candidate: Candidate) -> bool:
    """Whether a candidate's device is the CPU itself (its backend's CPU_DEVICES), not an
    accelerator. A backend this registry does not know runs on no CPU it can vouch for."""
    module = _registry().get(candidate.backend)
    if module is None:
        return False
    return candidate.device in importlib.import_module(module).CPU_DEVICES


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
    ordered = sorted(_modules(), key=lambda m: owner != m.NAME)  # stable: owner first
    found = []
    for module in ordered:
        backend = module.BACKEND
        if model.format in backend.formats:
            candidate = backend.reference(model)
            if candidate is not None:
                found.append(candidate)
    return found
