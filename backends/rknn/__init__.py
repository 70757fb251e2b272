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

from typing import TYPE_CHECKING, Any

from backends.base import (
    BackendOption,
    Candidate,
    LoadOptions,
    dist_version,
    unavailable,
)
from backends.errors import BackendError
from backends.formats import ModelFormat
from backends.model_info import ModelInfo
from backends.rknn.rknn_file import read, recognise, signature
from backends.rknn.soc import RKNPU1, SOCS, core_mask, model_problems, soc_of
from backends.rknn.stack import stack_facts, stack_problems
from sysconf.hardware import DeviceNode, HardwareFacts

if TYPE_CHECKING:
    from backends.rknn.session import RknnSession

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
MAX_NPU_CORE = 15  # the highest core number an option may name (RK3588 has 0-2)


def _npu_cores(value: Any) -> tuple[int, ...]:
    """NPU core numbers, each once, sorted (whether this board's NPU has them is said at
    load, where the SoC is known: `core_mask`)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a list of core numbers, e.g. [0, 1], got {value!r}")
    if any(type(c) is not int or not 0 <= c <= MAX_NPU_CORE for c in value):
        raise ValueError(f"each core is a number 0-{MAX_NPU_CORE}, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"lists a core twice: {value!r}")
    return tuple(sorted(value))


# Written as a [[models]] key before backend_options: the same option.
OLDER_KEYS = ("npu_cores",)
# [models.backend_options.rknn]
OPTIONS = (
    BackendOption(
        "npu_cores", _npu_cores, "npu_cores: the NPU cores to run on (RK3588: 0-2; default: auto)"
    ),
)


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
        from backends.rknn.session import RknnSession

        soc = next((s for s in SOCS.values() if s.name == candidate.options.get("soc")), None)
        if soc is None:
            raise BackendError(f"{model.name}: candidate {candidate.key} names no Rockchip SoC")
        cores = options.own(NAME).get("npu_cores")
        try:
            mask = core_mask(soc, cores)
        except ValueError as exc:
            raise BackendError(f"{model.name}: npu_cores {list(cores or ())}: {exc}") from None
        return RknnSession(model, candidate, soc, mask)

    def reference(self, model: ModelInfo) -> Candidate | None:
        return None  # NPU only: the family's original (ONNX) is the reference

    def board_devices(self, hw: HardwareFacts) -> list[str]:
        """The board's RKNPU2, from its device tree (offline plans ask this)."""
        return [DEVICE] if soc_of(hw) is not None else []


BACKEND = RknnBackend()
