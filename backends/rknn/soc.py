"""Rockchip's NPU SoCs: which NPU each has, how many cores, and the RKNNLite core mask for a
set of cores (the backend and its candidates: `backends.rknn`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backends.model_info import ModelInfo
from sysconf.hardware import HardwareFacts


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
