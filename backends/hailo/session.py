"""A HEF running on a Hailo device through HailoRT's InferModel API (the backend and its
candidates: `backends.hailo`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Candidate, LoadOptions, check_feeds
from backends.errors import BackendError, InputError, ModelError
from backends.hailo.hef_file import RUNS
from backends.model_info import ModelInfo
from backends.tensors import TensorSpec

SHARED_GROUP = "SHARED"  # the group id Hailo's own applications share a device under
# run(): HailoRT's own timeout, so that a device that stopped answering gives the worker
# thread back (as BackendError) instead of holding it; the engine's watchdog may fail over
# sooner. HailoRT's default vstream timeout is the same 10 s.
RUN_TIMEOUT_MS = 10_000
SENSOR_MIN_INTERVAL_S = 0.5  # telemetry asking faster gets the last readings

# Hints for HailoRT's failures, by exception class (pyhailort.py's HailoRTException subclasses;
# HailoCommunicationClosedException is 4.20+) or by the status name in the message.
HINTS = {
    "HailoRTTimeout": "the device did not answer in time",
    "HailoCommunicationClosedException": "the connection to hailort_service closed",
    "HailoRTDriverOperationFailedException": "a driver operation failed; see dmesg | grep hailo",
    "HailoRTPCIeDriverException": "a driver operation failed; see dmesg | grep hailo",
    "HAILO_OUT_OF_PHYSICAL_DEVICES": (
        "another process holds the device: without hailort_service a Hailo opens in one "
        "process only (enable hailort.service and open it through the service everywhere)"
    ),
    "HAILO_INVALID_DRIVER_VERSION": "the driver and the library versions differ",
    "HAILO_RPC_FAILED": "hailort_service did not answer (is hailort.service running?)",
}
MODEL_ERRORS = ("HailoRTInvalidHEFException", "HailoRTHEFNotCompatibleWithDevice")


def _import():
    import hailo_platform

    return hailo_platform


def _describe(exc: BaseException) -> str:
    names = [cls.__name__ for cls in type(exc).__mro__]
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    hint = next((HINTS[n] for n in names if n in HINTS), None)
    hint = hint or next((h for key, h in HINTS.items() if key.isupper() and key in text), None)
    return f"{type(exc).__name__}: {text}" + (f" ({hint})" if hint else "")


def _is_model_error(exc: BaseException) -> bool:
    return any(cls.__name__ in MODEL_ERRORS for cls in type(exc).__mro__)


def _name_of(value: Any) -> str:
    return str(getattr(value, "name", value)).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class _Output:
    spec: TensorSpec
    frame_shape: tuple[int, ...]  # one frame's buffer, as HailoRT wants it
    nms: bool  # an on-chip NMS output: read as TF format (classes, 5, max boxes)


class HailoSession:
    """One HEF on one Hailo device. Inputs are NHWC frames in the HEF's own input type (uint8
    for 8-bit inputs: the image as the device takes it, no host-side quantization); outputs
    are float32, dequantized by HailoRT. The batch dimension is edged's: each frame of a
    batch is one binding of a single `run`, which HailoRT pipelines."""

    def __init__(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> None:
        try:
            hp = _import()
        except ImportError as exc:
            raise BackendError(
                f"{model.name}: hailo_platform (HailoRT's Python API) is not installed ({exc})"
            ) from None
        self.model = model
        self.candidate = candidate
        self._hp = hp
        self._vdevice: Any = None
        self._infer_model: Any = None
        self._configured: Any = None
        self._devices: list[Any] = []
        self._device_lock = threading.Lock()  # sensors() against close(); never run()
        self._failed: str | None = None
        self._readings: tuple[float, dict[str, float]] = (0.0, {})
        self._power = False
        self.architecture: str | None = None
        self.firmware: str | None = None
        self.io_quantization: dict[str, tuple[float, int]] = {}
        try:
            self._open(hp, model, candidate)
        except ModelError:
            self.close()
            raise
        except Exception as exc:  # pyhailort raises its own HailoRTException subclasses
            self.close()
            if _is_model_error(exc):
                raise ModelError(
                    f"{model.path}: HailoRT cannot load this HEF: {_describe(exc)}"
                ) from None
            raise BackendError(
                f"{model.name}: HailoRT could not open {candidate.device}: {_describe(exc)}"
            ) from None

    def _open(self, hp: Any, model: ModelInfo, candidate: Candidate) -> None:
        params = hp.VDevice.create_params()
        # The scheduler switches between every model on the device (ours and, through the
        # service, other processes'); the InferModel API needs no activate() under it.
        params.scheduling_algorithm = hp.HailoSchedulingAlgorithm.ROUND_ROBIN
        params.group_id = candidate.options.get("group_id", SHARED_GROUP)
        if candidate.options.get("device_id"):
            params.device_ids = [candidate.options["device_id"]]
        if candidate.options.get("multi_process_service"):
            params.multi_process_service = True
        self._vdevice = hp.VDevice(params)
        self._identify(model)
        infer_model = self._vdevice.create_infer_model(str(model.path))
        self._infer_model = infer_model
        infer_model.set_batch_size(1)  # frames are bindings: a batch of one is least latency
        self.inputs = [self._input_spec(infer_model.input(n)) for n in infer_model.input_names]
        self._outputs = [self._output(hp, infer_model, n) for n in infer_model.output_names]
        self.outputs = [o.spec for o in self._outputs]
        self._configured = infer_model.configure()

    def _identify(self, model: ModelInfo) -> None:
        """The physical device's chip and firmware, kept for sensors(); a HEF for another
        chip is refused here by name (HailoRT's own refusal says only "Invalid HEF")."""
        try:
            self._devices = list(self._vdevice.get_physical_devices())
            board = self._devices[0].control.identify()
        except Exception:  # e.g. not offered through the service: no sensors, no check
            return
        self.architecture = _name_of(board.device_architecture)
        self.firmware = str(getattr(board, "firmware_version", "")) or None
        try:
            control = self._devices[0].control
            features = control.get_extended_device_information().supported_features
            # Device::get_capabilities: power is measured where an INA231 current monitor
            # is (M.2/mPCIe modules with current monitoring, EVBs); Hailo-8L modules often
            # have none.
            self._power = bool(getattr(features, "current_monitoring", False)) or "EVB" in str(
                getattr(board, "product_name", "")
            )
        except Exception:
            self._power = False
        target = model.target
        runs = RUNS.get(self.architecture)
        if target and runs is not None and target not in runs:
            raise ModelError(
                f"{model.path}: compiled for {target}; {self.candidate.device} is a "
                f"{self.architecture}, which runs HEFs compiled for {', '.join(runs)} "
                "(compile it for this chip with the Dataflow Compiler's --hw-arch)"
            )

    def _input_spec(self, stream: Any) -> TensorSpec:
        kind = _name_of(stream.format.type)
        dtype = {"UINT16": "uint16", "FLOAT32": "float32"}.get(kind, "uint8")
        quant = list(stream.quant_infos or [])
        if quant and dtype != "float32":
            self.io_quantization[stream.name] = (float(quant[0].qp_scale), int(quant[0].qp_zp))
        return TensorSpec(stream.name, dtype, (None, *(int(d) for d in stream.shape)))

    def _output(self, hp: Any, infer_model: Any, name: str) -> _Output:
        stream = infer_model.output(name)
        order = _name_of(stream.format.order)
        if order in ("HAILO_NMS_WITH_BYTE_MASK", "HAILO_NMS_BY_SCORE"):
            raise ModelError(
                f"{self.model.path}: output {name!r} is {order}, which edged does not serve "
                "(compile the HEF with NMS by class, or without on-chip NMS)"
            )
        stream.set_format_type(hp.FormatType.FLOAT32)
        frame = tuple(int(d) for d in stream.shape)
        if stream.is_nms:
            info = next(i for i in infer_model.hef.get_output_vstream_infos() if i.name == name)
            nms = info.nms_shape
            # TF format: [classes, (y_min, x_min, y_max, x_max, score), max boxes per class],
            # padded: a fixed shape, unlike the default per-class lists.
            shape = (int(nms.number_of_classes), 5, int(nms.max_bboxes_per_class))
            return _Output(TensorSpec(name, "float32", (None, *shape)), frame, True)
        return _Output(TensorSpec(name, "float32", (None, *frame)), frame, False)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds, self.model.name)
        if self._failed:
            raise BackendError(
                f"{self.model.name}: {self.candidate.device} failed earlier ({self._failed}); "
                "load the model again"
            )
        counts = {len(array) for array in feeds.values()}
        if len(counts) > 1:
            raise InputError(
                f"{self.model.name}: the inputs' batch sizes differ ({sorted(counts)})"
            )
        frames = counts.pop() if counts else 0
        if frames == 0:
            return {
                o.spec.name: np.empty((0, *(d or 0 for d in o.spec.shape[1:])), np.float32)
                for o in self._outputs
            }
        # Plain outputs land in one batch array, a view of it per frame (first-axis views of
        # a C-contiguous array are C-contiguous, as set_buffer requires): no copy after.
        batch = {
            o.spec.name: np.empty((frames, *o.frame_shape), np.float32)
            for o in self._outputs
            if not o.nms
        }
        try:
            bindings = []
            for i in range(frames):
                binding = self._configured.create_bindings()
                for name, array in feeds.items():
                    binding.input(name).set_buffer(np.ascontiguousarray(array[i]))
                for out in self._outputs:
                    name = out.spec.name
                    raw = np.empty(out.frame_shape, np.float32) if out.nms else batch[name][i]
                    binding.output(name).set_buffer(raw)
                bindings.append(binding)
            # pyhailort releases the GIL while it waits for the device.
            self._configured.run(bindings, RUN_TIMEOUT_MS)
            results = {}
            for out in self._outputs:
                name = out.spec.name
                if out.nms:
                    frames_out = [b.output(name).get_buffer(tf_format=True) for b in bindings]
                    results[name] = np.stack(frames_out).astype(np.float32, copy=False)
                else:
                    results[name] = batch[name]
        except Exception as exc:
            self._failed = _describe(exc)
            raise BackendError(
                f"{self.model.name}: HailoRT run on {self.candidate.device} failed: {self._failed}"
            ) from None
        return results

    def info(self) -> dict[str, Any]:
        return {
            "precision": "int8",
            "device": self.candidate.options.get("device_node", self.candidate.device),
            "architecture": self.architecture,
            "firmware": self.firmware,
            "hailort": getattr(self._hp, "__version__", None),
            "multi_process_service": bool(self.candidate.options.get("multi_process_service")),
            "group_id": self.candidate.options.get("group_id", SHARED_GROUP),
            "api": "InferModel",
        }

    def sensors(self) -> dict[str, float]:
        """The chip's temperature (the hotter of its two sensors) and, where the module
        measures it, its power; {} when the device cannot tell or is gone. Never raises."""
        when, last = self._readings
        now = time.monotonic()
        if now - when < SENSOR_MIN_INTERVAL_S:
            return dict(last)
        readings: dict[str, float] = {}
        with self._device_lock:
            control = self._devices[0].control if self._devices and not self._failed else None
            if control is not None:
                try:
                    temps = control.get_chip_temperature()
                    readings["temperature_celsius"] = float(
                        max(temps.ts0_temperature, temps.ts1_temperature)
                    )
                except Exception:
                    pass
                if self._power:
                    try:
                        hp = self._hp
                        watts = control.power_measurement(
                            hp.DvmTypes.AUTO, hp.PowerMeasurementTypes.POWER
                        )
                        readings["power_watts"] = float(watts)
                    except Exception:
                        pass
        self._readings = (now, readings)
        return dict(readings)

    def close(self) -> None:
        """Release the configured model, the physical-device handles and the VDevice, in that
        order; each may fail on a device that is gone, and close goes on regardless."""
        configured, self._configured = self._configured, None
        if configured is not None:
            with contextlib.suppress(Exception):
                configured.shutdown()
        self._infer_model = None
        with self._device_lock:
            devices, self._devices = self._devices, []
        for device in devices:
            with contextlib.suppress(Exception):
                device.release()
        vdevice, self._vdevice = self._vdevice, None
        if vdevice is not None:
            with contextlib.suppress(Exception):
                vdevice.release()
