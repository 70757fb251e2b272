"""OpenVINO: every device in `available_devices` (CPU, GPU, NPU); reads .onnx, IR .xml, .tflite.

The precision is always set explicitly: on CPUs with AMX or AVX512-BF16 the CPU plugin's
default is bf16, so "it ran fast" may mean "it ran in bf16". What really ran is read back from
the compiled model's runtime graph (per-layer `runtimePrecision`) and reported.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import Candidate, LoadOptions, check_feeds, dist_version, unavailable
from backends.errors import BackendError, ModelError
from backends.formats import FormatFacts, ModelFormat
from backends.model_info import ModelInfo
from backends.tensors import TensorSpec

NAME = "openvino"
ALIASES = ("ov",)  # other names config and --backend accept
ORDER = 20  # place among the candidates (backends.REGISTRY)


def read_ir(path: Path, data: bytes) -> FormatFacts:
    """An IR's precision from its .xml (the weights file must be beside it): FakeQuantize
    layers are INT8, 8/4-bit Const layers int8-compressed weights, else f16 or f32."""
    weights = path.with_suffix(".bin")
    if not weights.exists():
        raise ModelError(f"{path}: OpenVINO IR weights {weights.name} are missing")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise ModelError(f"{path}: not a valid OpenVINO IR ({exc})") from None
    layers = root.findall("./layers/layer")
    if root.tag != "net" or not layers:
        raise ModelError(f"{path}: not an OpenVINO IR (no <net> with layers)")
    types = Counter(layer.get("type") for layer in layers)
    const_types = Counter(
        (node.get("element_type") if (node := layer.find("data")) is not None else None)
        for layer in layers
        if layer.get("type") == "Const"
    )
    if types["FakeQuantize"]:
        return FormatFacts("int8", f"OpenVINO IR with {types['FakeQuantize']} FakeQuantize")
    if sum(const_types[t] for t in ("i8", "u8", "i4", "u4")):
        return FormatFacts("int8", "OpenVINO IR with int8-compressed weights (activations float)")
    if const_types["f16"] > const_types["f32"]:
        return FormatFacts("fp16", "OpenVINO IR with f16 weights")
    return FormatFacts("fp32", "OpenVINO IR, float32")


FORMATS = (
    ModelFormat(
        "openvino-ir",
        "OpenVINO IR",
        (".xml",),
        "openvino",  # Triton's OpenVINO backend name
        read_ir,
        recognise=lambda data: True if data.lstrip()[:5] == b"<?xml" else None,
    ),
)
DEVICES = ()  # its plugins find their own devices (CPU, GPU via DRM, NPU via accel)
CPU_DEVICES = frozenset({"CPU"})  # its device labels that are the CPU itself
OPTIONS = ()  # no [models.backend_options.openvino] keys yet
# Where `edgectl quantize` gates an INT8 model of each format: (target, device).
QUANTIZE_TARGETS = {"onnx": (("openvino", "CPU"),)}
# edged precision name -> OpenVINO INFERENCE_PRECISION_HINT
PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
# Runtime layer precisions -> edged names.
RUNTIME_NAMES = {
    "u8": "int8",
    "i8": "int8",
    "f32": "fp32",
    "bf16": "bf16",
    "f16": "fp16",
    "i32": "int32",
    "u1": "binary",
}
# Layers whose precision is the precision of the model's arithmetic.
COMPUTE_LAYERS = {
    "Convolution",
    "GroupConvolution",
    "FullyConnected",
    "MatMul",
    "Deconvolution",
    "GroupDeconvolution",
    "ConvolutionBackpropData",
}


def _import():
    # `import openvino` imports its model converter, which sends a usage event to Google
    # Analytics from a forked child unless the user has opted out (openvino_telemetry: opt-out
    # outside CI). A daemon on a device must not phone home, and that child, forked from a
    # threaded process, can hang for good at exit, where the interpreter joins it (seen here:
    # an edged that never stopped after SIGTERM). The converter falls back to its own stub when
    # the package does not import, so it is made not to import, here and for this process.
    sys.modules.setdefault("openvino_telemetry", None)
    import openvino

    return openvino


_core = None


def core():
    """One Core per process: creating it scans plugins, and the cache dir is per-compile."""
    global _core
    if _core is None:
        _core = _import().Core()
    return _core


class OpenVinoBackend:
    name = NAME
    formats = ("onnx", "openvino-ir", "tflite")

    def version(self) -> str | None:
        return dist_version("openvino")

    def candidates(self, hw, model: ModelInfo | None) -> list[Candidate]:
        try:
            ov_core = core()
        except ImportError as exc:
            return [unavailable(NAME, "CPU", f"openvino is not installed ({exc})")]
        result = []
        for device in ov_core.available_devices:
            try:
                caps = set(ov_core.get_property(device, "OPTIMIZATION_CAPABILITIES"))
                full_name = str(ov_core.get_property(device, "FULL_DEVICE_NAME"))
            except RuntimeError as exc:
                result.append(unavailable(NAME, device, f"device does not answer: {exc}"))
                continue
            for precision in _precisions(device, caps):
                if model is not None and model.format not in self.formats:
                    result.append(
                        unavailable(NAME, device, f"openvino cannot read {model.format}", precision)
                    )
                else:
                    result.append(Candidate(NAME, device, precision, note=full_name))
        return result

    def load(self, model: ModelInfo, candidate: Candidate, options: LoadOptions):
        return OvSession(model, candidate, options)

    def reference(self, model: ModelInfo) -> Candidate | None:
        return Candidate(NAME, "CPU", "fp32")  # the hint set to f32: never bf16 on AMX


def _capabilities(device: str) -> set[str]:
    try:
        return set(core().get_property(device, "OPTIMIZATION_CAPABILITIES"))
    except RuntimeError:
        return set()


def _precisions(device: str, caps: set[str]) -> list[str]:
    base = device.split(".")[0]
    if base == "CPU":
        return ["fp32"] + [p for p, cap in (("bf16", "BF16"), ("fp16", "FP16")) if cap in caps]
    if base == "NPU":
        return ["fp16"]
    return ["fp16", "fp32"] if "FP32" in caps else ["fp16"]


class OvSession:
    def __init__(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> None:
        ov = _import()
        self.candidate = candidate
        self.model = model
        try:
            ov_model = core().read_model(str(model.path))
        except RuntimeError as exc:
            raise ModelError(f"{model.path}: openvino cannot read it: {_first_line(exc)}") from None
        if options.shapes and (options.shapes_bind or not candidate.device.startswith("CPU")):
            first = -1 if options.dynamic_batch else None
            ov_model.reshape(
                {
                    name: ov.PartialShape([first or shape[0], *shape[1:]])
                    for name, shape in options.shapes.items()
                }
            )
        config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
        hint = PRECISION_HINTS.get(candidate.precision)
        if hint:
            config["INFERENCE_PRECISION_HINT"] = hint
        if candidate.device.startswith("CPU"):
            config["INFERENCE_NUM_THREADS"] = options.thread_count()
            # Pinning keeps OpenVINO's stream threads on cores inside the caller's affinity
            # mask; without a CPU set we let the scheduler place them.
            config["ENABLE_CPU_PINNING"] = bool(options.cpus)
        # With pinning on, OpenVINO's CPU plugin resets the *calling* thread's affinity to the
        # whole process mask on every infer (openvinotoolkit/openvino#24826; seen here with
        # 2026.4: a thread on {1} comes back on {0, 1}). run() puts the caller back.
        self._caller_cpus = (
            set(options.cpus) if options.cpus and candidate.device.startswith("CPU") else None
        )
        cache_dir = options.cache_dir(NAME)
        if cache_dir is not None:
            # One folder per precision hint: OpenVINO leaves the hint out of its cache key, so
            # with one folder a second compile of the same model at another precision loads the
            # first one's blob (seen on aarch64: an "fp32" session that ran fp16).
            cache = cache_dir / (hint or "default").lower()
            cache.mkdir(parents=True, exist_ok=True)
            config["CACHE_DIR"] = str(cache)
        try:
            self._compiled = core().compile_model(ov_model, candidate.device, config)
        except RuntimeError as exc:
            raise BackendError(
                f"{model.path}: openvino cannot compile it for "
                f"{candidate.device}: {_first_line(exc)}"
            ) from None
        self._request = self._compiled.create_infer_request()
        self.inputs = [_spec(port) for port in self._compiled.inputs]
        self.outputs = [_spec(port) for port in self._compiled.outputs]
        self._precision = self._executed_precision()

    def _executed_precision(self) -> dict[str, Any]:
        counts: Counter[str] = Counter()
        try:
            for op in self._compiled.get_runtime_model().get_ops():
                rt = op.get_rt_info()
                if "layerType" in rt and rt["layerType"].astype(str) in COMPUTE_LAYERS:
                    runtime = rt["runtimePrecision"].astype(str)
                    counts[RUNTIME_NAMES.get(runtime, runtime)] += 1
        except RuntimeError:
            pass  # GPU/NPU plugins may not expose a runtime graph; the hint is all we know
        hint = self._compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        hinted = RUNTIME_NAMES.get(hint, hint)
        # f16 on a CPU without fp16 arithmetic is how weights are stored (decompressed to
        # f32 for the math), not a precision that ran.
        if (
            "fp16" in counts
            and self.candidate.device.startswith("CPU")
            and "FP16" not in _capabilities("CPU")
        ):
            counts["fp32"] += counts.pop("fp16")
        total = sum(counts.values())
        main = [p for p, n in counts.most_common() if total and n / total >= 0.1]
        if main == ["int8"] and hinted not in ("fp32", "int8"):
            main.append(hinted)  # the layers between the int8 convolutions run in bf16/fp16
        return {
            "precision": "+".join(main) if main else hinted,
            "precision_hint": hint,
            "compute_layers": dict(counts),
        }

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds, self.model.name)
        try:
            result = self._request.infer(dict(feeds))
        except RuntimeError as exc:
            raise BackendError(
                f"{self.model.name}: openvino run failed: {_first_line(exc)}"
            ) from None
        finally:
            if self._caller_cpus is not None:
                os.sched_setaffinity(0, self._caller_cpus)  # one syscall, about a microsecond
        return {
            spec.name: np.array(result[port], copy=True)
            for spec, port in zip(self.outputs, self._compiled.outputs, strict=True)
        }

    def info(self) -> dict[str, Any]:
        return {
            **self._precision,
            "execution_devices": list(self._compiled.get_property("EXECUTION_DEVICES")),
            # True when the compile was skipped: a restart reused the model cache dir.
            "loaded_from_cache": bool(self._loaded_from_cache()),
        }

    def _loaded_from_cache(self) -> bool:
        try:
            return bool(self._compiled.get_property("LOADED_FROM_CACHE"))
        except RuntimeError:  # plugins that do not support import/export have no cache
            return False

    def close(self) -> None:
        self._request = None
        self._compiled = None


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else exc.__class__.__name__)[:300]


def _spec(port) -> TensorSpec:
    shape = tuple(d.get_length() if d.is_static else None for d in port.get_partial_shape())
    dtype = port.get_element_type().to_dtype().name
    try:
        name = port.get_any_name()
    except RuntimeError:
        name = f"output{port.get_index()}"
    return TensorSpec(name, dtype, shape)


BACKEND = OpenVinoBackend()
