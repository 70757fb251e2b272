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
  was compiled for (`backends/hailo_backend.read_hef`).

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
import gzip
import importlib.util
import lzma
import os
import re
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import Candidate, LoadOptions, check_feeds, dist_version, unavailable
from backends.errors import BackendError, InputError, ModelError
from backends.formats import FormatFacts, ModelFormat
from backends.model_info import ModelInfo
from backends.tensors import TensorSpec
from sysconf.hardware import DeviceNode, HardwareFacts
from sysconf.sysroot import SysRoot

NAME = "hailo"
ALIASES = ("hailort",)  # other names config and --backend accept
ORDER = 50  # place among the candidates (backends.REGISTRY)

# -- the HEF file ------------------------------------------------------------------------------
# The header (hailort libhailort/src/hef/hef_internal.hpp, hef__header_t; packed, every field
# big-endian: hef.cpp converts each with BYTE_ORDER__htonl/htonll):
#   0 magic u32 = 0x01484546 ("\x01HEF")   4 version u32   8 hef_proto_size u32
# then by version (HEADER_VERSION_0..3), after which come the protobuf (ProtoHEFHef,
# hef.proto), then the compiled contexts (ccws):
#   v0: reserved u32, md5[16]                                    -> 32 bytes; file = proto
#   v1: crc32 u32, ccws_size u64, reserved u32                   -> 28 bytes; proto + ccws
#   v2: xxh3 u64, ccws_size u64, reserved u64 x2                 -> 44 bytes; proto + ccws
#   v3: xxh3 u64, ccws_size_with_padding u64, padding u32,
#       additional_info_size u64, proto_xxh3 u64, reserved u64   -> 56 bytes;
#       proto + ccws_with_padding + additional_info
# HailoRT checks exactly these lengths ("HEF file length does not match"), so a truncated
# file is caught here; its checksums (md5, crc32, xxh3) HailoRT verifies at load.
HEF_MAGIC = b"\x01HEF"
_HEADER_SIZES = {0: 32, 1: 28, 2: 44, 3: 56}
# The first HailoRT that reads each header version (from the header versions each release's
# hef_internal.hpp defines: v2 from 4.20, v3 from 4.21; v1 took this layout in 4.18).
HEADER_READERS = {0: (4, 0, 0), 1: (4, 18, 0), 2: (4, 20, 0), 3: (4, 21, 0)}
# ProtoHEFHwArch (hef.proto): ProtoHEFHef.header (field 1) is a ProtoHEFHeader whose field 1
# is hw_arch, "the target hw_arch the HEF is compiled to"; 3 is sdk_version. proto3: an
# absent hw_arch is 0. A Hailo-8 accepts HAILO8P (1), not 0 (is_hef_compatible), so Hailo-8
# HEFs carry 1; edged names both "hailo8", as the Dataflow Compiler's --hw-arch does.
HW_ARCH = {
    0: "hailo8",
    1: "hailo8",
    2: "hailo8r",
    3: "hailo8l",
    4: "hailo15m",
    5: "hailo10h",
    6: "hailo15l",
    100: "sage_a0",
    101: "sage_b0",
    102: "paprika_b0",
    103: "hailo15h",
    104: "ginger",
    105: "lavender",
    106: "pluto",
}
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


@dataclass(frozen=True)
class HefHeader:
    version: int
    proto_size: int
    target: str | None  # "hailo8l"; None when the protobuf has no header message
    sdk_version: str | None  # the Dataflow Compiler that wrote it

    @property
    def min_hailort(self) -> tuple[int, int, int]:
        return HEADER_READERS[self.version]


def recognise_hef(data: bytes) -> bool:
    return data[:4] == HEF_MAGIC


def read_hef_header(path: Path, data: bytes, size: int | None = None) -> HefHeader:
    """The header and the protobuf header of a HEF; ModelError names the path for a file
    that is not one, is cut short, or has a header HailoRT would refuse. `data` may be the
    file's first bytes only when `size` gives the whole file's length (the protobuf's own
    header comes first, so a few KiB tell the target)."""
    size = len(data) if size is None else size
    if size < 12 or len(data) < 12:
        raise ModelError(f"{path}: truncated HEF ({size} bytes, the header alone is 12+)")
    if not recognise_hef(data):
        raise ModelError(f"{path}: not a HEF (no magic 01 48 45 46 at byte 0)")
    version, proto_size = struct.unpack_from(">II", data, 4)
    if version not in _HEADER_SIZES:
        raise ModelError(
            f"{path}: HEF header version {version} is unknown (HailoRT up to 5.x writes 0-3)"
        )
    header_size = _HEADER_SIZES[version]
    if size < header_size or len(data) < header_size:
        raise ModelError(
            f"{path}: truncated HEF ({size} bytes, a v{version} header is {header_size})"
        )
    if version == 0:
        rest = 0
    elif version == 1:
        (rest,) = struct.unpack_from(">Q", data, 16)
    elif version == 2:
        (rest,) = struct.unpack_from(">Q", data, 20)
    else:
        (ccws,) = struct.unpack_from(">Q", data, 20)
        (additional,) = struct.unpack_from(">Q", data, 32)
        rest = ccws + additional
    expected = header_size + proto_size + rest
    if size != expected:
        cut = "truncated" if size < expected else "trailing bytes after the"
        raise ModelError(
            f"{path}: {cut} HEF: its v{version} header says {expected} bytes, the file has {size}"
        )
    proto = memoryview(data)[header_size : header_size + proto_size]
    target, sdk = _proto_header(path, proto, whole=len(data) == size)
    return HefHeader(version, proto_size, target, sdk)


def read_hef(path: Path, data: bytes) -> FormatFacts:
    header = read_hef_header(path, data)
    built = f"compiled for {header.target}" if header.target else "target not stated"
    sdk = f" by Dataflow Compiler {header.sdk_version}" if header.sdk_version else ""
    return FormatFacts(
        "int8",  # the Dataflow Compiler quantizes (8-bit, some layers 16-bit)
        f"Hailo HEF v{header.version} ({built}{sdk}; HailoRT "
        f"{'.'.join(map(str, header.min_hailort[:2]))}+ reads it)",
        target=header.target,
    )


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("varint runs past the message")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview):
    """(field number, wire type, value) of one protobuf message level: a varint's value, or
    a length-delimited field's bytes. Only what the HEF header needs; no protobuf library."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | memoryview | None
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError(f"field {number} runs past the message")
            value, pos = buf[pos : pos + length], pos + length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"wire type {wire} at field {number}")
        yield number, wire, value


def _proto_header(path: Path, proto: memoryview, whole: bool) -> tuple[str | None, str | None]:
    """hw_arch and sdk_version of ProtoHEFHef.header. Serializers write fields in number
    order, so the header (field 1) comes first and the walk stops there. Of a file's first
    bytes only (`whole` false), what they do not hold is not known, not corrupt."""
    try:
        for number, wire, value in _fields(proto):
            if number == 1 and wire == 2:
                arch, sdk = 0, None
                for sub, sub_wire, sub_value in _fields(value):
                    if sub == 1 and sub_wire == 0:
                        arch = sub_value
                    elif sub == 3 and sub_wire == 2:
                        sdk = bytes(sub_value).decode(errors="replace")
                return HW_ARCH.get(arch, f"unknown hw_arch {arch}"), sdk
    except ValueError as exc:
        if not whole:
            return None, None
        raise ModelError(f"{path}: corrupt HEF: its protobuf part is unreadable ({exc})") from None
    return None, None


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

# -- the driver, the library and the service -----------------------------------------------
DRIVER_MODULES = {"hailo": "hailo_pci", "hailo1x": "hailo1x_pci"}  # PCI driver -> module
# Where a module file is in an image: hailo-dkms, Raspberry Pi's in-tree driver, a build.
MODULE_GLOBS = (
    "/lib/modules/*/updates/dkms/{}.ko*",
    "/lib/modules/*/kernel/drivers/media/pci/hailo/{}.ko*",
    "/lib/modules/*/kernel/drivers/misc/{}.ko*",
    "/lib/modules/*/extra/{}.ko*",
)
LIBRARY_DIRS = (
    "/usr/lib",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/local/lib",
    "/lib",
    "/usr/lib64",
)
# The Python binding in an image's system Python (python3-hailort, or a wheel installed there).
BINDING_DIRS = (
    "/usr/lib/python3/dist-packages",
    "/usr/lib/python3*/site-packages",
    "/usr/local/lib/python3*/dist-packages",
    "/usr/local/lib/python3*/site-packages",
)
SERVICE_SOCKET = "/tmp/hailort_uds.sock"  # rpc_definitions.hpp HAILO_DEFAULT_SERVICE_ADDR
SERVICE_UNIT_LINKS = (
    "/etc/systemd/system/multi-user.target.wants/hailort.service",
    "/etc/systemd/system/default.target.wants/hailort.service",
)
SHARED_GROUP = "SHARED"  # the group id Hailo's own applications share a device under
FIRST_INFER_MODEL = (4, 18, 0)
# run(): HailoRT's own timeout, so that a device that stopped answering gives the worker
# thread back (as BackendError) instead of holding it; the engine's watchdog may fail over
# sooner. HailoRT's default vstream timeout is the same 10 s.
RUN_TIMEOUT_MS = 10_000
HEAD_BYTES = 64 * 1024  # what candidates() reads of a HEF: its headers, not its contexts
SENSOR_MIN_INTERVAL_S = 0.5  # telemetry asking faster gets the last readings


def _version_tuple(text: str | None) -> tuple[int, int, int] | None:
    match = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", text or "")
    return tuple(int(g) for g in match.groups()) if match else None  # type: ignore[return-value]


@dataclass(frozen=True)
class HailoStack:
    """The host side of a Hailo device: what the root has installed and running."""

    driver_module: str | None  # "hailo_pci"
    driver_version: str | None
    libraries: tuple[str, ...]  # versions of the libhailort.so.X.Y.Z files found
    binding: bool  # hailo_platform is importable (live) / in the image's Python
    binding_version: str | None  # the hailort distribution's version
    service: str | None  # why the multi-process service counts as there, or None

    @property
    def library_version(self) -> str | None:
        """The HailoRT the binding runs: its own version, else the one library file."""
        if self.binding_version:
            return self.binding_version
        return self.libraries[0] if len(self.libraries) == 1 else None


def stack_facts(root: SysRoot, live: bool, node: str | None = None) -> HailoStack:
    module, driver = _driver(root, node)
    return HailoStack(
        module,
        driver,
        _libraries(root),
        *_binding(root, live),
        _service(root, live),
    )


def _driver(root: SysRoot, node: str | None) -> tuple[str | None, str | None]:
    name = node.rsplit("/", 1)[-1] if node else None
    owner = root.link_name(f"/sys/class/hailo_chardev/{name}/device/driver") if name else None
    modules = [DRIVER_MODULES[owner]] if owner in DRIVER_MODULES else list(DRIVER_MODULES.values())
    for module in modules:
        version = root.read_line(f"/sys/module/{module}/version")
        if version:
            return module, version
        if root.exists(f"/sys/module/{module}"):
            return module, None  # loaded, its version file unreadable
    for module in modules:  # an image: the module files' own version
        versions = sorted(
            {
                v
                for pattern in MODULE_GLOBS
                for path in root.glob(pattern.format(module))
                if (v := _modinfo_version(root.path(path)))
            }
        )
        if versions:
            return module, versions[-1] if len(versions) == 1 else ", ".join(versions)
    return None, None


def _modinfo_version(path: Path) -> str | None:
    """The `version=` string of a kernel module's .modinfo (plain, .xz or .gz)."""
    try:
        raw = path.read_bytes()
        if path.name.endswith(".xz"):
            raw = lzma.decompress(raw)
        elif path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, lzma.LZMAError, EOFError):
        return None
    # NUL-separated key=value entries; the NUL before keeps "srcversion=" out.
    match = re.search(rb"\x00version=([^\x00]+)\x00", raw)
    return match.group(1).decode(errors="replace") if match else None


def _libraries(root: SysRoot) -> tuple[str, ...]:
    found = set()
    for folder in LIBRARY_DIRS:
        for name in root.listdir(folder):
            match = re.fullmatch(r"libhailort\.so\.(\d+\.\d+\.\d+)", name)
            if match:
                found.add(match.group(1))
    return tuple(sorted(found, key=lambda v: _version_tuple(v) or (0, 0, 0)))


def _binding(root: SysRoot, live: bool) -> tuple[bool, str | None]:
    if live:
        # find_spec of a top-level name locates it without importing it.
        try:
            found = importlib.util.find_spec("hailo_platform") is not None
        except (ImportError, ValueError):  # a broken entry in sys.modules
            found = False
        return found, dist_version("hailort")
    found, version = False, None
    for pattern in BINDING_DIRS:
        for folder in root.glob(pattern):
            names = root.listdir(folder)
            found = found or "hailo_platform" in names
            for name in names:
                match = re.match(r"hailort-(\d+\.\d+\.\d+)[-.]", name)
                if match:
                    version = match.group(1)
    return found, version


def _service(root: SysRoot, live: bool) -> str | None:
    """Why HailoRT's multi-process service counts as running here, or None."""
    address = os.environ.get("HAILORT_SERVICE_ADDRESS") if live else None
    if address and not address.startswith("unix://"):
        return f"$HAILORT_SERVICE_ADDRESS={address}"
    socket = address.removeprefix("unix://") if address else SERVICE_SOCKET
    if root.exists(socket):
        return f"hailort_service listens on {socket}"
    if not live:
        for link in SERVICE_UNIT_LINKS:
            if os.path.lexists(root.path(link)):  # an absolute link points into the image
                return "hailort.service is enabled in the image"
    return None


def stack_problem(stack: HailoStack, offline: bool) -> str | None:
    """What stops HailoRT from running on this host at all, or None."""
    where = "in the image's Python" if offline else "for this Python"
    if not stack.binding:
        return (
            f"hailo_platform (HailoRT's Python API) is not installed {where}: "
            "sudo apt install python3-hailort (part of hailo-all); a virtualenv sees it "
            "only when made with --system-site-packages"
        )
    library = stack.library_version
    parsed = _version_tuple(library)
    if parsed is not None and parsed < FIRST_INFER_MODEL:
        return (
            f"HailoRT {library} is too old: edged uses the InferModel API of HailoRT 4.18 "
            "and later (upgrade hailort, python3-hailort and the driver together: "
            "sudo apt install hailo-all)"
        )
    if stack.driver_module is None:
        return (
            "no Hailo PCIe driver (hailo_pci) is loaded"
            if not offline
            else "no Hailo PCIe driver (hailo_pci.ko) in the image's /lib/modules"
        )
    driver = stack.driver_version
    if library is None and stack.libraries:
        if driver and driver not in stack.libraries:
            return (
                f"the {stack.driver_module} driver is {driver} but the HailoRT libraries "
                f"installed are {', '.join(stack.libraries)}: HailoRT opens the device only "
                "when driver and library versions are the same"
            )
        return None
    if driver and library and _version_tuple(driver) != _version_tuple(library):
        return (
            f"driver and library versions differ: {stack.driver_module} is {driver}, "
            f"HailoRT (libhailort) is {library}; HailoRT opens the device only when they are "
            "the same major.minor.revision (install matching hailo-dkms/hailort/python3-hailort, "
            "e.g. sudo apt install hailo-all, then reboot)"
        )
    return None


def _pci_id(root: SysRoot, name: str) -> str | None:
    """The node's PCI device id ("2864"), from its PCI device or the driver's own attribute."""
    device = root.read_line(f"/sys/class/hailo_chardev/{name}/device/device")
    if device:
        return device.lower().removeprefix("0x").zfill(4)
    pair = root.read_line(f"/sys/class/hailo_chardev/{name}/device_id")  # "1e60:2864"
    return pair.partition(":")[2].lower().zfill(4) if pair and ":" in pair else None


def _bdf(root: SysRoot, name: str) -> str | None:
    """The node's PCIe address ("0000:01:00.0"): HailoRT's device id for it."""
    return root.read_line(f"/sys/class/hailo_chardev/{name}/board_location") or root.link_name(
        f"/sys/class/hailo_chardev/{name}/device"
    )


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
        libraries = _libraries(SysRoot())
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
        pci = _pci_id(root, label)
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
        library = _version_tuple(stack.library_version)
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
        bdf = _bdf(root, label)
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
