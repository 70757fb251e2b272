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
  was compiled for (`backends/hailo/hef_file.py`).

Sharing one device: a VDevice marks its physical device used (vdevice.cpp, create_devices:
HAILO_OUT_OF_PHYSICAL_DEVICES for the next process). Within edged, every model's VDevice
uses the same `group_id`, so they share one device under the ROUND_ROBIN scheduler. Across
processes, HailoRT's multi-process service (hailort_service, the `hailort.service` unit,
listening on unix:///tmp/hailort_uds.sock or $HAILORT_SERVICE_ADDRESS) owns the device and
every application opens its VDevice through it (`multi_process_service=True`, the same
`group_id`, a scheduler). edged does so when the service is there: its socket exists (live),
or the unit is enabled (an image); a model's `[models.backend_options.hailo]
multi_process_service = true/false` (or `HailoBackend(multi_process_service=...)`) forces
it. When the service holds the device, a direct open cannot work, so following the service
is not a preference but the only way that opens.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from backends.base import (
    BackendOption,
    Candidate,
    LoadOptions,
    dist_version,
    read_bool,
    unavailable,
)
from backends.errors import ModelError
from backends.formats import ModelFormat
from backends.hailo.hef_file import RUNS, HefHeader, read_hef, read_hef_header, recognise_hef
from backends.hailo.session import SHARED_GROUP
from backends.hailo.stack import (
    library_files,
    pci_address,
    pci_id,
    stack_facts,
    stack_problem,
    version_tuple,
)
from backends.model_info import ModelInfo
from sysconf.hardware import DeviceNode, HardwareFacts
from sysconf.sysroot import SysRoot

if TYPE_CHECKING:
    from backends.hailo.session import HailoSession

NAME = "hailo"
ALIASES = ("hailort",)  # other names config and --backend accept
ORDER = 50  # place among the candidates (backends.REGISTRY)

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
# [models.backend_options.hailo]
OPTIONS = (
    BackendOption(
        "multi_process_service",
        read_bool,
        "multi_process_service: open the device through HailoRT's multi-process service "
        "(true), or alone (false); default: through it when the service runs",
    ),
)

HEAD_BYTES = 64 * 1024  # what candidates() reads of a HEF: its headers, not its contexts


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
        from backends.hailo.session import HailoSession

        forced = options.own(NAME).get("multi_process_service")
        if forced is not None:  # the model's own choice over what the probe found
            options_now = {**candidate.options, "multi_process_service": forced}
            candidate = replace(candidate, options=options_now)
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


BACKEND = HailoBackend()
