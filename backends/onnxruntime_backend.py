"""onnxruntime: the CPU execution provider plus every other EP this build lists.

Threads: an explicit intra-op count, spinning off (a spinning pool steals the core from the
next request's queueing and from other models), and per-thread affinities from the CPU set.
onnxruntime does not pin the calling thread; the caller (bench, engine worker) pins itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from backends import onnx_file
from backends.base import Candidate, LoadOptions, check_feeds, dist_version, unavailable
from backends.errors import BackendError, ModelError
from backends.formats import ModelFormat
from backends.model_info import ModelInfo
from backends.tensors import TensorSpec

NAME = "onnxruntime"
ALIASES = ("ort",)  # other names config and --backend accept
ORDER = 10  # place among the candidates (backends.REGISTRY)
FORMATS = (
    ModelFormat(
        "onnx",
        "ONNX",
        (".onnx",),
        "onnxruntime_onnx",  # Triton's platform name for its onnxruntime backend
        onnx_file.read,
        signature=onnx_file.signature,  # protobuf has no magic: the suffix tells
        metadata=onnx_file.metadata,
    ),
)
DEVICES = ()  # its execution providers find their own devices
# Device labels (PROVIDERS below) that are the CPU itself, not an accelerator: what decides
# whether a pick on this runtime keeps a standby, and how a session's device is described.
CPU_DEVICES = frozenset({"CPU", "XNNPACK", "ACL", "ArmNN"})
OPTIONS = ()  # no [models.backend_options.onnxruntime] keys yet
# Where `edgectl quantize` gates an INT8 model of each format: (target, device).
QUANTIZE_TARGETS = {"onnx": (("onnxruntime", "CPU"),)}
# EP name -> (device label, note). EPs not listed here are offered under their own name.
PROVIDERS = {
    "CPUExecutionProvider": ("CPU", ""),
    "XnnpackExecutionProvider": ("XNNPACK", ""),
    "ACLExecutionProvider": ("ACL", "Arm Compute Library"),
    "ArmNNExecutionProvider": ("ArmNN", ""),
    "QNNExecutionProvider": ("QNN", "Qualcomm NPU/DSP"),
    "OpenVINOExecutionProvider": ("OpenVINO-EP", ""),
    "CUDAExecutionProvider": ("CUDA", ""),
    "TensorrtExecutionProvider": ("TensorRT", ""),
    "RknpuExecutionProvider": ("RKNPU", "Rockchip NPU"),
    "VitisAIExecutionProvider": ("VitisAI", ""),
}
# Providers that are not a local device to run on.
NOT_LOCAL = {"AzureExecutionProvider": "remote (cloud) execution provider, not a local device"}
ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
}


def _import():
    import onnxruntime

    return onnxruntime


class OnnxRuntimeBackend:
    name = NAME
    formats = ("onnx",)

    def version(self) -> str | None:
        return dist_version(
            "onnxruntime",
            "onnxruntime-openvino",
            "onnxruntime-qnn",
            "onnxruntime-gpu",
            "onnxruntime-directml",
        )

    def candidates(self, hw, model: ModelInfo | None) -> list[Candidate]:
        try:
            ort = _import()
        except ImportError as exc:
            return [unavailable(NAME, "CPU", f"onnxruntime is not installed ({exc})")]
        result = []
        for provider in ort.get_available_providers():
            device, note = PROVIDERS.get(provider, (provider.removesuffix("ExecutionProvider"), ""))
            if provider in NOT_LOCAL:
                result.append(unavailable(NAME, device, NOT_LOCAL[provider]))
                continue
            if model is not None and model.format not in self.formats:
                result.append(
                    unavailable(NAME, device, f"onnxruntime reads only ONNX, not {model.format}")
                )
                continue
            result.append(
                Candidate(NAME, device, "model", True, "", {"provider": provider}, note=note)
            )
        return result

    def load(self, model: ModelInfo, candidate: Candidate, options: LoadOptions):
        return OrtSession(model, candidate, options)

    def reference(self, model: ModelInfo) -> Candidate | None:
        # Optimisations off: an FP32 graph runs as written; in a QDQ graph the pairs stay
        # unfused, i.e. the quantized arithmetic in float32 (the lone-INT8 reference).
        return Candidate(
            NAME,
            "CPU",
            "model",
            options={"provider": "CPUExecutionProvider", "optimization": "disable_all"},
        )


def _affinity_string(cpus: list[int], threads: int) -> str:
    """`session.intra_op_thread_affinities` for the pool's threads (all but the caller's).

    onnxruntime numbers logical processors from 1 (checked against /proc: "2" -> CPU 1).
    """
    return ";".join(str(cpus[(i + 1) % len(cpus)] + 1) for i in range(threads - 1))


class OrtSession:
    def __init__(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> None:
        ort = _import()
        self.candidate = candidate
        self.model = model
        so = ort.SessionOptions()
        so.log_severity_level = 3
        threads = options.thread_count()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if options.cpus and threads > 1:
            so.add_session_config_entry(
                "session.intra_op_thread_affinities", _affinity_string(list(options.cpus), threads)
            )
        if candidate.options.get("optimization") == "disable_all":
            # The reference run: QDQ stays DequantizeLinear -> float op -> QuantizeLinear, so
            # it computes the quantized model's arithmetic in float32.
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        provider = candidate.options.get("provider", "CPUExecutionProvider")
        providers = (
            [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
        )
        try:
            self._session = ort.InferenceSession(str(model.path), so, providers=providers)
        except Exception as exc:  # onnxruntime raises its own pybind classes (Fail, InvalidGraph)
            raise ModelError(
                f"{model.path}: onnxruntime cannot load it: {str(exc).splitlines()[0][:300]}"
            ) from None
        self.inputs = [_spec(i) for i in self._session.get_inputs()]
        self.outputs = [_spec(o) for o in self._session.get_outputs()]
        self._output_names = [o.name for o in self.outputs]
        self._providers = self._session.get_providers()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds, self.model.name)
        try:
            values = self._session.run(self._output_names, dict(feeds))
        except Exception as exc:
            raise BackendError(
                f"{self.model.name}: onnxruntime run failed: {str(exc).splitlines()[0][:300]}"
            ) from None
        return dict(zip(self._output_names, values, strict=True))

    def info(self) -> dict[str, Any]:
        return {
            # The CPU EP runs a QDQ graph with int8 kernels and a float graph in float32.
            "precision": {"int8": "int8", "fp16": "fp16"}.get(self.model.precision, "fp32"),
            "providers": self._providers,
        }

    def close(self) -> None:
        self._session = None


def _spec(arg) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in (arg.shape or []))
    return TensorSpec(arg.name, ORT_DTYPES.get(arg.type, arg.type), shape)


BACKEND = OnnxRuntimeBackend()
