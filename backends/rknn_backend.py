"""Rockchip RKNN: .rknn models on the NPU of the RK3562, RK3566/RK3568, RK3576 and RK3588,
through rknn-toolkit-lite2's `RKNNLite` (PyPI `rknn-toolkit-lite2`: aarch64 wheels only) and
Rockchip's runtime library librknnrt.so (not on any package registry: the board's image ships
it, or it is copied to /usr/lib from Rockchip's rknn-toolkit2 repository).

What has to line up, and where edged reads it without opening the device:
- the SoC: the device tree's root `compatible` ("rockchip,rk3588", "rockchip,rk3588s", ...).
  Which NPU each SoC has is the table rknn-toolkit-lite2 carries (rknnlite/config/
  cpu_npu_mapper.yml in the 2.5.0 wheel): RK3566 and RK3568 share one (RKNPU2-LITE), so a
  model built for either runs on both; every other SoC runs only models built for it.
- the driver: Rockchip's vendor kernels (drivers/rknpu) register a platform driver named
  "RKNPU" that makes either a DRM render node (CONFIG_ROCKCHIP_RKNPU_DRM_GEM: DRM driver name
  "rknpu", /dev/dri/renderD*) or a misc device /dev/rknpu (CONFIG_ROCKCHIP_RKNPU_DMA_HEAP).
  Its version: `MODULE_VERSION` gives /sys/module/rknpu/version ("0.9.8", built in or a
  module); with debugfs or procfs on, /sys/kernel/debug/rknpu/version and /proc/rknpu/version
  say "RKNPU driver: v0.9.8". (The DRM version ioctl says the same, but needs the device
  opened; the kernel log's "[drm] Initialized rknpu 0.9.8 ..." line may have rotated away.)
- mainline Linux's `rocket` accel driver (drivers/accel/rocket, 6.18) drives the same NPU but
  only powers it, maps buffers and submits jobs; the rest is Mesa's Gallium driver of the same
  name, used through Mesa's Teflon TFLite delegate. librknnrt speaks only the vendor driver's
  ioctls ("failed to open rknpu module, need to insmod rknpu driver"), so a board on rocket
  has no RKNN candidate: the reason says so.
- librknnrt.so: looked for in the library folders under the root; its version is the
  "librknnrt version: 2.5.0 (...)" string in its bytes, read without loading it (Rockchip's
  own rknn_server reads it the same way: `strings | grep "librknnrt version"`).
- driver against library: Rockchip publishes no table of which librknnrt needs which rknpu
  driver (asked in airockchip/rknn-toolkit2 issues #295, #405 and #465, unanswered by
  Rockchip). What is on record: librknnrt 1.6.0 fails to submit jobs on driver 0.9.3 and
  works on 0.8.2 and 0.9.6 (airockchip/rknn-toolkit2#38); a 2.3.2 runtime needs a newer driver
  than 0.9.2 (#465); rknn-toolkit-lite2 2.5.0 itself asks 0.9.4 and 0.9.7 for its memory
  report and pre-compiled models (EVAL_MEMORY_MIN_DRV_VER, PRECOMPILE_MIN_DRV_VER in
  rknnlite/api/rknn_runtime); RKLLM asks 0.9.7. So MIN_DRIVER below holds librknnrt 2.x to
  driver 0.9.6, the oldest release with no failure reported against 2.x, and the reason names
  both versions.
- the model: the .rknn file says which SoC it is built for (`target_platform`), read below.

Inputs: the session takes what the ONNX original takes (NCHW float32 for a model from ONNX)
and returns float32 outputs, so it is checked against the original like any other variant.
RKNNLite.inference(inputs, data_type, data_format) converts: float32 inputs are quantized (or
cast to float16) by librknnrt with the model's own parameters, and data_format="nchw" tells it
a 4-D input is NCHW (rknn-toolkit-lite2 1.6.0 added that, CHANGELOG; it transposes to the
NPU's NHWC itself); without it a 4-D input is taken as NHWC. Outputs come back as float32
arrays (dequantized by the runtime).
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Candidate, LoadOptions, check_feeds, dist_version, unavailable
from backends.errors import BackendError
from backends.formats import ModelFormat
from backends.model_info import ModelInfo
from backends.rknn_file import read, read_rknn, recognise, signature
from backends.rknn_stack import LOAD_FILES, stack_facts, stack_problems
from backends.tensors import TensorSpec
from sysconf.hardware import DeviceNode, HardwareFacts
from sysconf.sysroot import SysRoot

NAME = "rknn"
ALIASES = ("rockchip", "rknpu")  # other names config and --backend accept
ORDER = 40  # place among the candidates (backends.REGISTRY)
DEVICE = "NPU"

FORMATS = (
    ModelFormat(
        "rknn",
        "RKNN",
        (".rknn",),
        "rknn",
        read,
        recognise=recognise,
        not_it="no RKNN magic at byte 0",
        signature=signature,
    ),
)
DEVICES = (DeviceNode("npu", "/dev/rknpu", "Rockchip NPU (rknpu)", "misc"),)
CPU_DEVICES: frozenset[str] = frozenset()  # an accelerator only

# -- the SoC, its NPU cores and the core mask ---------------------------------------------------


@dataclass(frozen=True)
class Soc:
    name: str  # as target_platform spells it: "rk3588"
    npu: str  # the NPU (rknnlite's cpu_npu_mapper.yml): a model runs where this matches
    cores: int


SOCS = {
    "rockchip,rk3562": Soc("rk3562", "RKNPU2-T4", 1),
    "rockchip,rk3566": Soc("rk3566", "RKNPU2-LITE", 1),
    "rockchip,rk3568": Soc("rk3568", "RKNPU2-LITE", 1),
    "rockchip,rk3576": Soc("rk3576", "RKNPU2-F2", 2),
    "rockchip,rk3588": Soc("rk3588", "RKNPU2-V2", 3),
    "rockchip,rk3588s": Soc("rk3588", "RKNPU2-V2", 3),  # the same die, fewer I/Os
}
NPU_OF = {soc.name: soc.npu for soc in SOCS.values()}
# Rockchip SoCs whose NPU is the first generation (RKNPU1, VeriSilicon-based): Rockchip's
# older rknn-toolkit and librknn_api run those, not librknnrt.
RKNPU1 = ("rockchip,rk3399pro", "rockchip,rk1808", "rockchip,rv1109", "rockchip,rv1126")
# RKNNLite's core_mask constants (rknnlite/api/rknn_lite.py) by the cores they name. Only
# these combinations exist: one core, cores 0+1, or all three.
CORE_MASKS = {
    (0,): "NPU_CORE_0",
    (1,): "NPU_CORE_1",
    (2,): "NPU_CORE_2",
    (0, 1): "NPU_CORE_0_1",
    (0, 1, 2): "NPU_CORE_0_1_2",
}
AUTO = "NPU_CORE_AUTO"


def soc_of(hw: HardwareFacts) -> Soc | None:
    return next((SOCS[c] for c in hw.soc_compatible if c in SOCS), None)


def core_mask(soc: Soc, cores: Sequence[int] | None) -> str:
    """The name of RKNNLite's core_mask constant for `cores` (the per-model `npu_cores`) on
    `soc`; NPU_CORE_AUTO when none are given. ValueError says why a set cannot be run."""
    if not cores:
        return AUTO
    wanted = tuple(sorted(set(cores)))
    outside = [c for c in wanted if not 0 <= c < soc.cores]
    if outside:
        have = "one NPU core (0)" if soc.cores == 1 else f"NPU cores 0-{soc.cores - 1}"
        raise ValueError(f"{soc.name.upper()} has {have}; there is no core {outside[0]}")
    if soc.cores == 1:
        # librknnrt takes a core mask on the multi-core NPUs only ("The core_mask is only
        # supported by ... Please do not set this parameter on other platforms").
        return AUTO
    if wanted not in CORE_MASKS:
        raise ValueError(
            f"cores {list(wanted)} cannot be run together: RKNNLite runs one core, cores "
            "[0, 1] or cores [0, 1, 2]"
        )
    return CORE_MASKS[wanted]


def model_problems(soc: Soc, model: ModelInfo | None) -> list[str]:
    if model is None:
        return []
    if model.format != "rknn":
        return [f"RKNN runs only .rknn models (made with rknn-toolkit2), not {model.format}"]
    if model.target is None:
        return []  # the file does not say; librknnrt checks at load
    npu = NPU_OF.get(model.target)
    if npu == soc.npu:
        return []
    theirs = f" ({npu})" if npu else ""
    return [
        f"the model is built for {model.target}{theirs}, this board is {soc.name} ({soc.npu}): "
        f"build it again with rknn-toolkit2, config(target_platform='{soc.name}')"
    ]


def _not_rockchip(hw: HardwareFacts) -> str:
    old = next((c for c in hw.soc_compatible if c in RKNPU1), None)
    if old:
        return (
            f"{old.split(',')[1].upper()} has a first-generation Rockchip NPU (RKNPU1): "
            "Rockchip's older rknn-toolkit and librknn_api run it, not librknnrt"
        )
    said = ", ".join(hw.soc_compatible[:3]) if hw.soc_compatible else "no device tree"
    wanted = ", ".join(dict.fromkeys(SOCS))
    return f"not a Rockchip NPU SoC (looked for {wanted} in the device tree; it says: {said})"


class RknnBackend:
    name = NAME
    formats = ("rknn",)

    def version(self) -> str | None:
        return dist_version("rknn-toolkit-lite2")

    def candidates(self, hw: HardwareFacts, model: ModelInfo | None) -> list[Candidate]:
        soc = soc_of(hw)
        if soc is None:
            return [unavailable(NAME, DEVICE, _not_rockchip(hw))]
        stack = stack_facts(hw)
        image = hw.offline and hw.root != "/"
        problems = stack_problems(stack, image) + model_problems(soc, model)
        label = f"Rockchip {soc.name.upper()} NPU"
        if problems:
            return [unavailable(NAME, DEVICE, f"{label}: {'; '.join(problems)}")]
        cores = "1 core" if soc.cores == 1 else f"{soc.cores} cores"
        note = f"{label} ({soc.npu}, {cores})"
        if stack.driver is None and stack.library is None:
            note += " (driver, librknnrt and rknn-toolkit-lite2 not checked: no --root image)"
        elif stack.driver is None:
            note += f" (librknnrt {stack.library_version or '?'} in the image; driver not checked)"
        else:
            note += (
                f", rknpu {stack.driver_version or '?'}, librknnrt {stack.library_version or '?'}"
            )
        options = {"soc": soc.name, "cores": soc.cores, "npu": soc.npu, "root": hw.root}
        return [Candidate(NAME, DEVICE, "model", True, "", options, note=note)]

    def load(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> RknnSession:
        return RknnSession(model, candidate, options)

    def reference(self, model: ModelInfo) -> Candidate | None:
        return None  # NPU only: the family's original (ONNX) is the reference

    def board_devices(self, hw: HardwareFacts) -> list[str]:
        """The board's RKNPU2, from its device tree (offline plans ask this)."""
        return [DEVICE] if soc_of(hw) is not None else []


# -- the session --------------------------------------------------------------------------------


def _import():
    from rknnlite.api import RKNNLite  # type: ignore[import-not-found]

    return RKNNLite


def _message(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


class RknnSession:
    """One model on the NPU. RKNNLite runs an inference as set_inputs, run and get_outputs on
    one context, so concurrent run() calls of one session take turns (a lock of this session
    only, held for one inference)."""

    def __init__(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> None:
        self.model = model
        self.candidate = candidate
        soc = next((s for s in SOCS.values() if s.name == candidate.options.get("soc")), None)
        if soc is None:
            raise BackendError(f"{model.name}: candidate {candidate.key} names no Rockchip SoC")
        cores = getattr(options, "npu_cores", None)
        try:
            self._mask = core_mask(soc, cores)
        except ValueError as exc:
            raise BackendError(f"{model.name}: npu_cores {list(cores or ())}: {exc}") from None
        described = read_rknn(model.path, model.path.read_bytes())
        self.inputs = [t.spec for t in described.inputs]
        self.outputs = [t.spec for t in described.outputs]
        # "nchw" when the original takes a 4-D NCHW input; the runtime transposes it.
        nchw = any(t.layout == "nchw" and len(t.spec.shape) == 4 for t in described.inputs)
        self._format = "nchw" if nchw else None
        self._soc = soc
        self._root = SysRoot.at(candidate.options.get("root") or "/")
        self._lock = threading.Lock()
        try:
            rknnlite = _import()
        except ImportError as exc:
            raise BackendError(f"{model.name}: rknn-toolkit-lite2 does not import: {exc}") from None
        # rknn-toolkit-lite2 prints some of its loading messages (a missing device or
        # library, "It is detected that some necessary files are missing") on stdout, which
        # is edgectl's --json output: they go to stderr with its other messages.
        try:
            with contextlib.redirect_stdout(sys.stderr):
                self._rk = rknnlite(verbose=False)
                if self._rk.load_rknn(str(model.path)) != 0:
                    raise BackendError(f"{model.name}: RKNNLite.load_rknn({model.path}) failed")
                ret = self._rk.init_runtime(core_mask=getattr(rknnlite, self._mask))
                if ret != 0:
                    raise BackendError(
                        f"{model.name}: RKNNLite.init_runtime failed on {soc.name} "
                        f"({self._mask}): returned {ret} (librknnrt says why on stderr)"
                    )
                self._sdk = self._rk.get_sdk_version()
        except BackendError:
            self._release()
            raise
        except Exception as exc:  # the runtime's own errors, from its Cython modules
            self._release()
            raise BackendError(
                f"{model.name}: RKNNLite failed to load it: {_message(exc)}"
            ) from None
        self._load_file, self._temperature_file = self._sensor_files()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds, self.model.name)
        arrays = [np.ascontiguousarray(feeds[s.name]) for s in self.inputs]
        with self._lock:
            if self._rk is None:
                raise BackendError(f"{self.model.name}: the RKNN session is closed")
            try:
                values = self._rk.inference(inputs=arrays, data_format=self._format)
            except Exception as exc:
                raise BackendError(
                    f"{self.model.name}: RKNNLite.inference failed: {_message(exc)}"
                ) from None
        if values is None:
            raise BackendError(
                f"{self.model.name}: RKNNLite.inference failed (it returned None: the NPU is "
                "gone or hung, or librknnrt refused the inputs; it says why on stderr)"
            )
        if len(values) != len(self.outputs):
            raise BackendError(
                f"{self.model.name}: RKNNLite returned {len(values)} outputs, the model has "
                f"{len(self.outputs)}"
            )
        return {
            spec.name: self._output(spec, v) for spec, v in zip(self.outputs, values, strict=True)
        }

    def _output(self, spec: TensorSpec, value: Any) -> np.ndarray:
        array = np.asarray(value)
        if array.dtype.name != spec.dtype:
            array = array.astype(spec.dtype)
        if None not in spec.shape and array.shape != spec.shape:
            if array.size != math.prod(d for d in spec.shape if d is not None):
                raise BackendError(
                    f"{self.model.name}: output {spec.name!r} came back with shape "
                    f"{array.shape}, the model says {spec.shape}"
                )
            array = array.reshape(tuple(d for d in spec.shape if d is not None))
        return array

    def info(self) -> dict[str, Any]:
        return {
            "precision": self.model.precision,  # what the compiled graph computes in
            "device": f"{self._soc.name} NPU",
            "core_mask": self._mask,
            "runtime": self._sdk,
        }

    def sensors(self) -> dict[str, float]:
        """The NPU's load (its driver's last one-second sample, as a 0-1 ratio: the mean over
        its cores, and each core's) and the NPU thermal zone's temperature, where readable."""
        readings: dict[str, float] = {}
        try:
            if self._load_file:
                loads = _loads(self._root.read_line(self._load_file) or "")
                if loads:
                    readings["load_ratio"] = sum(loads) / len(loads)
                    if len(loads) > 1:
                        readings.update({f"core{i}_load_ratio": v for i, v in enumerate(loads)})
            if self._temperature_file:
                millis = self._root.read_line(self._temperature_file)
                if millis and millis.lstrip("-").isdigit():
                    readings["temperature_celsius"] = int(millis) / 1000  # sysfs: millidegrees
        except Exception:  # telemetry must never break on a sensor
            return readings
        return readings

    def _sensor_files(self) -> tuple[str | None, str | None]:
        load = next((p for p in LOAD_FILES if self._root.read_line(p)), None)
        temperature = next(
            (
                zone.removesuffix("/type") + "/temp"
                for zone in self._root.glob("/sys/class/thermal/thermal_zone*/type")
                if self._root.read_line(zone) in ("npu-thermal", "npu_thermal")
            ),
            None,
        )
        return load, temperature

    def _release(self) -> None:
        rk, self._rk = getattr(self, "_rk", None), None
        if rk is not None:
            with contextlib.suppress(Exception):  # releasing a context whose device is gone
                rk.release()

    def close(self) -> None:
        with self._lock:
            self._release()


def _loads(text: str) -> list[float]:
    """Per-core loads from the driver's "NPU load:  Core0: 12%, Core1:  0%," (one core:
    "NPU load:  5%"). It prints with "%2.d", so a zero load is blank before the "%"."""
    if not text.startswith("NPU load:"):
        return []
    cores = re.findall(r"Core\d+:\s*(\d*)%", text)
    if not cores:
        cores = re.findall(r"(\d*)%", text)
    return [int(c or 0) / 100 for c in cores]  # percent -> ratio, the base unit


BACKEND = RknnBackend()
