"""What has to line up for librknnrt to run on a Rockchip NPU, read without opening it: the
rknpu driver and its version, librknnrt.so and its version string, rknn-toolkit-lite2 (the
Python binding), and the minimum driver each library needs. Read through the hardware facts'
SysRoot, so an image root is described as well as the live system."""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from sysconf.hardware import HardwareFacts
from sysconf.sysroot import SysRoot

LIBRARY = "librknnrt.so"
# Where librknnrt.so is looked for (Rockchip's instructions put it in /usr/lib).
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/lib", "/usr/local/lib")
_LIBRARY_VERSION = re.compile(rb"librknnrt version: ([0-9]+\.[0-9]+\.[0-9]+[0-9A-Za-z.+-]*)")
DRIVER_VERSION_FILES = (
    "/sys/module/rknpu/version",  # MODULE_VERSION: "0.9.8"
    "/sys/kernel/debug/rknpu/version",  # "RKNPU driver: v0.9.8" (debugfs, root only)
    "/proc/rknpu/version",  # the same, with CONFIG_ROCKCHIP_RKNPU_PROC_FS
)
_DRIVER_VERSION = re.compile(r"v?([0-9]+)\.([0-9]+)\.([0-9]+)")
LOAD_FILES = ("/sys/kernel/debug/rknpu/load", "/proc/rknpu/load")
# librknnrt major version -> the oldest rknpu driver it is held to (see the module docstring).
MIN_DRIVER = {2: (0, 9, 6)}
# Where the image's Python keeps its packages (an image root: rknn-toolkit-lite2 in it).
SITE_DIRS = (
    "/usr/lib/python3*/*-packages",
    "/usr/local/lib/python3*/*-packages",
    "/opt/*/lib/python3*/site-packages",
    "/home/*/.local/lib/python3*/site-packages",
    "/root/.local/lib/python3*/site-packages",
)


@dataclass(frozen=True)
class Stack:
    """What the board has of the RKNN stack; None where it was not looked at (a .dtb alone,
    or a driver in an image, which only the running board shows)."""

    driver: str | None  # "rknpu", "rocket", "" (none), None (not checked)
    node: str | None
    driver_version: str | None
    library: str | None  # its path; "" when looked for and not found
    library_version: str | None
    toolkit: bool | None  # rknn-toolkit-lite2 importable (live) or in the image


def stack_facts(hw: HardwareFacts) -> Stack:
    if hw.offline and hw.root == "/":  # a .dtb alone: this machine is not the board
        return Stack(None, None, None, None, None, None)
    root = SysRoot.at(hw.root)
    # A root with a populated /sys is a running board (or a copy of one): its devices and
    # modules count. An image's /sys is empty: its kernel's driver shows only when it runs.
    running = not hw.offline or root.exists("/sys/devices")
    driver, node, version = _driver(hw, root) if running else (None, None, None)
    library, library_version = _library(root)
    toolkit = _toolkit_here() if not hw.offline else _toolkit_in(root)
    return Stack(driver, node, version, library, library_version, toolkit)


def _driver(hw: HardwareFacts, root: SysRoot) -> tuple[str, str | None, str | None]:
    rknpu = [a for a in hw.accelerators if (a.driver or "").lower() == "rknpu"]
    rknpu += [a for a in hw.accelerators if a.node == "/dev/rknpu" and a not in rknpu]
    version = next(
        (
            ".".join(match.groups())
            for path in DRIVER_VERSION_FILES
            if (match := _DRIVER_VERSION.search(root.read_line(path) or ""))
        ),
        None,
    )
    if rknpu:
        return "rknpu", rknpu[0].node, version
    rocket = [a for a in hw.accelerators if a.driver == "rocket"]
    if rocket:
        return "rocket", rocket[0].node, None
    return "", None, version


def _library(root: SysRoot) -> tuple[str, str | None]:
    for folder in LIBRARY_DIRS:
        path = root.path(f"{folder}/{LIBRARY}")
        try:
            stat = path.stat()
        except OSError:
            continue
        return f"{folder}/{LIBRARY}", _library_version(str(path), stat.st_mtime_ns, stat.st_size)
    return "", None


@functools.lru_cache(maxsize=8)
def _library_version(path: str, mtime_ns: int, size: int) -> str | None:
    """The version string librknnrt embeds (about 7 MB read once per file state: candidates
    are listed on every hot-plug and `edgectl backends`)."""
    try:
        match = _LIBRARY_VERSION.search(Path(path).read_bytes())
    except OSError:
        return None
    return match.group(1).decode() if match else None


def _toolkit_here() -> bool:
    # find_spec of a top-level name locates it without importing it.
    return importlib.util.find_spec("rknnlite") is not None


def _toolkit_in(root: SysRoot) -> bool:
    return any(True for pattern in SITE_DIRS for _ in root.glob(f"{pattern}/rknnlite/api"))


def _version(text: str | None) -> tuple[int, ...] | None:
    match = _DRIVER_VERSION.match(text or "")
    return tuple(int(g) for g in match.groups()) if match else None


def stack_problems(stack: Stack, offline: bool) -> list[str]:
    """Why the stack cannot run RKNN models, each with what was looked for; [] when it can
    (or was not looked at)."""
    problems = []
    if stack.driver == "rocket":
        problems.append(
            f"the NPU is driven by mainline Linux's rocket driver ({stack.node}), which "
            "librknnrt cannot use: it needs Rockchip's vendor rknpu driver (a vendor kernel); "
            "rocket is used through Mesa's Teflon TFLite delegate instead"
        )
    elif stack.driver == "":
        problems.append(
            "no rknpu driver: neither /dev/rknpu nor a DRM render node of the RKNPU driver "
            "(/dev/dri/renderD*) is there (Rockchip's vendor kernel has it: "
            "CONFIG_ROCKCHIP_RKNPU)"
        )
    if stack.library == "":
        where = "the image" if offline else "this system"
        problems.append(
            f"{LIBRARY} is not in {where}, looked for in {', '.join(LIBRARY_DIRS)} (it is not "
            "on PyPI: Rockchip's rknn-toolkit2 repository has it, under rknpu2/runtime/Linux/"
            "librknn_api/aarch64)"
        )
    if stack.toolkit is False:
        problems.append(
            "rknn-toolkit-lite2 is not in the image's Python"
            if offline
            else "rknn-toolkit-lite2 is not installed (pip install rknn-toolkit-lite2; "
            "aarch64 only)"
        )
    library, driver = _version(stack.library_version), _version(stack.driver_version)
    if library and driver and stack.driver == "rknpu":
        needed = MIN_DRIVER.get(library[0])
        if needed and driver < needed:
            want = ".".join(map(str, needed))
            problems.append(
                f"rknpu driver {stack.driver_version} is older than librknnrt "
                f"{stack.library_version} is known to work with (driver {want} or later; "
                f"librknnrt {library[0]}.x is reported failing on older ones)"
            )
    return problems
