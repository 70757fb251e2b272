"""What has to line up for HailoRT to open a Hailo device, read without opening it: the
driver (module and version), the library (libhailort's version), the Python binding, and
HailoRT's multi-process service (the backend module's docstring says why each matters).
Read through a SysRoot, so an image root is described as well as the live system."""

from __future__ import annotations

import gzip
import importlib.util
import lzma
import os
import re
from dataclasses import dataclass
from pathlib import Path

from backends.base import dist_version
from sysconf.sysroot import SysRoot

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
FIRST_INFER_MODEL = (4, 18, 0)  # the first HailoRT whose binding has the InferModel API
SERVICE_SOCKET = "/tmp/hailort_uds.sock"  # rpc_definitions.hpp HAILO_DEFAULT_SERVICE_ADDR
SERVICE_UNIT_LINKS = (
    "/etc/systemd/system/multi-user.target.wants/hailort.service",
    "/etc/systemd/system/default.target.wants/hailort.service",
)


def version_tuple(text: str | None) -> tuple[int, int, int] | None:
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
        library_files(root),
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


def library_files(root: SysRoot) -> tuple[str, ...]:
    found = set()
    for folder in LIBRARY_DIRS:
        for name in root.listdir(folder):
            match = re.fullmatch(r"libhailort\.so\.(\d+\.\d+\.\d+)", name)
            if match:
                found.add(match.group(1))
    return tuple(sorted(found, key=lambda v: version_tuple(v) or (0, 0, 0)))


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
    parsed = version_tuple(library)
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
    if driver and library and version_tuple(driver) != version_tuple(library):
        return (
            f"driver and library versions differ: {stack.driver_module} is {driver}, "
            f"HailoRT (libhailort) is {library}; HailoRT opens the device only when they are "
            "the same major.minor.revision (install matching hailo-dkms/hailort/python3-hailort, "
            "e.g. sudo apt install hailo-all, then reboot)"
        )
    return None


def pci_id(root: SysRoot, name: str) -> str | None:
    """The node's PCI device id ("2864"), from its PCI device or the driver's own attribute."""
    device = root.read_line(f"/sys/class/hailo_chardev/{name}/device/device")
    if device:
        return device.lower().removeprefix("0x").zfill(4)
    pair = root.read_line(f"/sys/class/hailo_chardev/{name}/device_id")  # "1e60:2864"
    return pair.partition(":")[2].lower().zfill(4) if pair and ":" in pair else None


def pci_address(root: SysRoot, name: str) -> str | None:
    """The node's PCIe address ("0000:01:00.0"): HailoRT's device id for it."""
    return root.read_line(f"/sys/class/hailo_chardev/{name}/board_location") or root.link_name(
        f"/sys/class/hailo_chardev/{name}/device"
    )
