"""Hailo (Hailo-8, Hailo-8L, Hailo-10H/15): HEF models on the NPU through HailoRT's Python API.

`hailo_platform` is not on PyPI: Raspberry Pi OS ships it as `python3-hailort` (with
`hailort` and the `hailo-dkms` driver, all in `hailo-all`), Hailo's developer zone as a wheel.
It runs `.hef` files that Hailo's Dataflow Compiler made for one chip.

API: the InferModel API (`VDevice.create_infer_model`, `configure`, `create_bindings`,
`ConfiguredInferModel.run`), which pyhailort has from HailoRT 4.18 on and still has in 5.x.
Raspberry Pi OS has shipped 4.17 to 4.20 and later; 4.17 is left out on purpose: its Python
binding has no InferModel, and its `VDeviceParams` ties the scheduler to the multi-process
service (setting a scheduling algorithm turns `multi_process_service` on, read-only), so one
process could not use the scheduler on its own. A 4.17 system is an unavailable candidate
that says so; the driver and library are upgraded together anyway (see below).

What has to line up, and where edged reads it without opening the device:
- the device node `/dev/hailoN` (the PCIe driver's `hailo_chardev` class; hailort-drivers
  linux/pcie/src/pcie.c), and its PCI id in sysfs: 1e60:2864 is the Hailo-8 family (8, 8L
  and 8R share it, so which one it is only the firmware says, at load), 45c4 the Hailo-10H,
  43a2 the Hailo-15L;
- the driver's version: `MODULE_VERSION(HAILO_DRV_VER)` puts it in
  /sys/module/hailo_pci/version (hailo1x_pci for the 5.x Hailo-10/15 driver); in an image,
  the `version=` entry of the module file's .modinfo;
- the library's version: libhailort's file name (libhailort.so.X.Y.Z: its CMake sets VERSION
  and no SOVERSION, so the binding links that exact name) and the `hailort` distribution's
  metadata. HailoRT refuses to open the device unless driver and library are the same
  major.minor.revision (hailort_driver.cpp, validate_driver_version: "Driver version (...)
  is different from library version (...)", HAILO_INVALID_DRIVER_VERSION), so edged checks
  that first and names both versions;
- the HEF: its header says which HailoRT can read it, and its protobuf header which chip it
  was compiled for (`backends/hef_file.py`).

Sharing one device: a VDevice marks its physical device used (vdevice.cpp, create_devices:
HAILO_OUT_OF_PHYSICAL_DEVICES for the next process). Within edged, every model's VDevice
uses the same `group_id`, so they share one device under the ROUND_ROBIN scheduler. Across
processes, HailoRT's multi-process service (hailort_service, the `hailort.service` unit,
listening on unix:///tmp/hailort_uds.sock or $HAILORT_SERVICE_ADDRESS) owns the device and
every application opens its VDevice through it (`multi_process_service=True`, the same
`group_id`, a scheduler). edged does so when the service is there: its socket exists (live),
or the unit is enabled (an image); `HailoBackend(multi_process_service=True/False)` forces
it. When the service holds the device, a direct open cannot work, so following the service
is not a preference but the only way that opens.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Candidate, LoadOptions, check_feeds, dist_version, unavailable
from backends.errors import BackendError, InputError, ModelError
from backends.formats import ModelFormat
from backends.hailo_stack import (
    library_files,
    pci_address,
    pci_id,
    stack_facts,
    stack_problem,
    version_tuple,
)
from backends.hef_file import HefHeader, read_hef, read_hef_header, recognise_hef
from backends.model_info import ModelInfo
from backends.tensors import TensorSpec
from sysconf.hardware import DeviceNode, HardwareFacts
from sysconf.sysroot import SysRoot

NAME = "hailo"
ALIASES = ("hailort",)  # other names config and --backend accept
ORDER = 50  # place among the candidates (backends.REGISTRY)

# Which HEFs each chip runs (device_internal.cpp, DeviceBase::is_hef_compatible): a Hailo-8
# also runs Hailo-8L HEFs (slower), a Hailo-8L only its own. Keys: the firmware's
# DeviceArchitectureTypes names.
RUNS = {
    "HAILO8": ("hailo8", "hailo8r", "hailo8l"),
    "HAILO8L": ("hailo8l",),
    "HAILO15H": ("hailo15h", "hailo15m", "hailo10h", "ginger", "lavender"),
    "HAILO10H": ("hailo15h", "hailo15m", "hailo10h", "ginger", "lavender"),
    "HAILO15L": ("hailo15l", "pluto"),
    "HAILO15M": ("hailo15m",),
}
# PCI device ids (hailort-drivers common/pcie_common.h) -> (family name, chips it may be).
PCI_FAMILIES = {
    "2864": ("Hailo-8/8L/8R", ("HAILO8", "HAILO8L")),
    "45c4": ("Hailo-10H", ("HAILO10H",)),
    "43a2": ("Hailo-15L", ("HAILO15L",)),
}


FORMATS = (
    ModelFormat(
        "hef",
        "Hailo HEF",
        (".hef",),
        "hailo",
        read_hef,
        recognise=recognise_hef,
        not_it="no HEF magic 01 48 45 46 at byte 0",
    ),
)
# The PCIe driver makes /dev/hailoN in its own class (class_create "hailo_chardev"), which
# no udev class edged knows describes; hot-plug events come from that subsystem.
DEVICES = (DeviceNode("npu", "/dev/hailo*", "Hailo AI accelerator", "hailo_chardev"),)
CPU_DEVICES: frozenset[str] = frozenset()  # an accelerator only

SHARED_GROUP = "SHARED"  # the group id Hailo's own applications share a device under
# run(): HailoRT's own timeout, so that a device that stopped answering gives the worker
# thread back (as BackendError) instead of holding it; the engine's watchdog may fail over
# sooner. HailoRT's default vstream timeout is the same 10 s.
RUN_TIMEOUT_MS = 10_000
HEAD_BYTES = 64 * 1024  # what candidates() reads of a HEF: its headers, not its contexts
SENSOR_MIN_INTERVAL_S = 0.5  # telemetry asking faster gets the last readings


def _hailo_nodes(hw: HardwareFacts) -> list[str]:
    pattern = DEVICES[0].pattern
    return sorted({a.node for a in hw.accelerators if a.node and fnmatch.fnmatch(a.node, pattern)})


class HailoBackend:
    name = NAME
    formats = ("hef",)

    def __init__(self, multi_process_service: bool | None = None) -> None:
        # None: through HailoRT's multi-process service when it runs (module docstring).
        self.multi_process_service = multi_process_service

    def version(self) -> str | None:
        # python3-hailort may come without package metadata: the library's file name says.
        libraries = library_files(SysRoot())
        return dist_version("hailort") or (libraries[-1] if libraries else None)

    def candidates(self, hw: HardwareFacts, model: ModelInfo | None) -> list[Candidate]:
        nodes = _hailo_nodes(hw)
        image = hw.offline and hw.root != "/"
        if not nodes:
            return [unavailable(NAME, "hailo", _no_device(hw, image))]
        if model is not None and model.format not in self.formats:
            return [
                unavailable(
                    NAME,
                    _label(node),
                    f"Hailo runs only HEF models (compiled by Hailo's Dataflow Compiler), "
                    f"not {model.format}",
                )
                for node in nodes
            ]
        root = SysRoot.at(hw.root)
        header = _model_header(model)
        return [self._candidate(root, image, node, len(nodes), model, header) for node in nodes]

    def _candidate(
        self,
        root: SysRoot,
        image: bool,
        node: str,
        count: int,
        model: ModelInfo | None,
        header: HefHeader | None,
    ) -> Candidate:
        label = _label(node)
        stack = stack_facts(root, not image, node)
        problem = stack_problem(stack, image)
        if problem:
            return unavailable(NAME, label, problem)
        what = model.name if model is not None else "the model"
        pci = pci_id(root, label)
        family = PCI_FAMILIES.get(pci or "")
        target = (model.target if model is not None else None) or (header and header.target)
        if family and target and not any(target in RUNS[chip] for chip in family[1]):
            runs = sorted({t for chip in family[1] for t in RUNS[chip]})
            return unavailable(
                NAME,
                label,
                f"{what} is compiled for {target}; {label} is a {family[0]} (PCI 1e60:{pci}), "
                f"which runs HEFs compiled for {', '.join(runs)}",
            )
        library = version_tuple(stack.library_version)
        if header is not None and library is not None and library < header.min_hailort:
            return unavailable(
                NAME,
                label,
                f"{what} has a v{header.version} HEF header, which HailoRT "
                f"{'.'.join(map(str, header.min_hailort[:2]))} and later read; this HailoRT "
                f"is {stack.library_version} (upgrade it, or compile with the Dataflow "
                "Compiler of this HailoRT's release)",
            )
        shared = self.multi_process_service
        if shared is None:
            shared = stack.service is not None
        options: dict[str, Any] = {
            "device_node": node,
            "multi_process_service": shared,
            # One group per device: the VDevices of a group must agree on their devices.
            "group_id": SHARED_GROUP if count == 1 else f"{SHARED_GROUP}-{label}",
        }
        bdf = pci_address(root, label)
        if bdf and count > 1:
            options["device_id"] = bdf
        parts = [
            f"Hailo AI accelerator {label}" + (f" ({family[0]})" if family else ""),
            f"{stack.driver_module} {stack.driver_version or '(version unknown)'}",
            f"HailoRT {stack.library_version or '(version unknown)'}",
            f"through the multi-process service ({stack.service or 'forced on'})"
            if shared
            else "this process only (no hailort_service)",
        ]
        return Candidate(NAME, label, "model", True, "", options, note="; ".join(parts))

    def load(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> HailoSession:
        return HailoSession(model, candidate, options)

    def reference(self, model: ModelInfo) -> Candidate | None:
        return None  # the NPU is all HailoRT runs on: the family's ONNX original is the reference

    def board_devices(self, hw: HardwareFacts) -> list[str]:
        """The Hailo devices present (a PCIe card: its node, not the device tree, says)."""
        return [_label(node) for node in _hailo_nodes(hw)]


def _label(node: str) -> str:
    return node.rsplit("/", 1)[-1]


def _no_device(hw: HardwareFacts, image: bool) -> str:
    """Why there is no Hailo candidate; for an image (whose /dev is made at boot) also what
    Hailo software it carries and whether that would open a device, so that CI sees a
    driver/library mismatch before the board does."""
    why = "no Hailo device: no /dev/hailo* node"
    if hw.dtb is not None and not image:
        return why + " (a .dtb does not list PCIe devices: give the image's root too)"
    if not image:
        return why
    stack = stack_facts(SysRoot.at(hw.root), False)
    if not (stack.driver_module or stack.libraries or stack.binding):
        return why + " in the image, and no Hailo software in it"
    found = [
        f"{stack.driver_module} {stack.driver_version or '(version unknown)'}"
        if stack.driver_module
        else "",
        f"libhailort {', '.join(stack.libraries)}" if stack.libraries else "",
        "hailo_platform" if stack.binding else "",
    ]
    problem = stack_problem(stack, True)
    return (
        f"{why} in the image (it appears at boot); the image has "
        f"{', '.join(f for f in found if f)}" + (f", but {problem}" if problem else "")
    )


def _model_header(model: ModelInfo | None) -> HefHeader | None:
    """The model file's HEF header (a few bytes of it: the header and the protobuf's own
    header come first), or None when it is not a readable HEF."""
    if model is None or model.format != "hef":
        return None
    try:
        with open(model.path, "rb") as f:
            head = f.read(HEAD_BYTES)
            size = os.fstat(f.fileno()).st_size
        return read_hef_header(model.path, head, size)
    except (OSError, ModelError):
        return None


# -- running -----------------------------------------------------------------------------------
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


BACKEND = HailoBackend()
