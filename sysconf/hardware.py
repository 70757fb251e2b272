"""Hardware probe: the facts that decide which INT8 backend can run fast on this device.

One plain data object out (`HardwareFacts`). Everything is read through a `SysRoot`, so the
same probe runs live and on a folder built from a real board's files (device tree, cpuinfo,
sysfs links, /dev nodes). Live, devices are enumerated with pyudev; under a root folder, the
same records are read from the folder's sysfs, since udev's database only describes `/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sysconf.cpulist import parse_cpulist
from sysconf.sysroot import SysRoot

# ISA features that give INT8 dot-product throughput (what the runtimes' int8 kernels use).
X86_INT8_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")
ARM_INT8_FEATURES = ("asimd", "asimddp", "i8mm", "sve", "sve2", "bf16")
# Of those, the ones with an 8-bit dot-product instruction. Without one, onnxruntime's x86
# U8S8 kernels multiply with vpmaddubsw, whose int16 pair sums saturate (its quantization
# guide: use reduce_range or U8U8 there), and INT8 gains less over FP32.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")
# cpuinfo spelling -> numpy's runtime CPU-dispatch name (read from CPUID / AT_HWCAP).
NUMPY_FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX512F",
    "avx512_vnni": "AVX512VNNI",
    "asimd": "ASIMD",
    "asimddp": "ASIMDDP",
    "sve": "SVE",
}

# (implementer, part) from /proc/cpuinfo -> core name; the kernel prints only the numbers.
ARM_CORE_NAMES = {
    (0x41, 0xC07): "Cortex-A7",
    (0x41, 0xC09): "Cortex-A9",
    (0x41, 0xC0F): "Cortex-A15",
    (0x41, 0xD01): "Cortex-A32",
    (0x41, 0xD03): "Cortex-A53",
    (0x41, 0xD04): "Cortex-A35",
    (0x41, 0xD05): "Cortex-A55",
    (0x41, 0xD07): "Cortex-A57",
    (0x41, 0xD08): "Cortex-A72",
    (0x41, 0xD09): "Cortex-A73",
    (0x41, 0xD0A): "Cortex-A75",
    (0x41, 0xD0B): "Cortex-A76",
    (0x41, 0xD0C): "Neoverse-N1",
    (0x41, 0xD0D): "Cortex-A77",
    (0x41, 0xD40): "Neoverse-V1",
    (0x41, 0xD41): "Cortex-A78",
    (0x41, 0xD42): "Cortex-A78AE",
    (0x41, 0xD44): "Cortex-X1",
    (0x41, 0xD46): "Cortex-A510",
    (0x41, 0xD47): "Cortex-A710",
    (0x41, 0xD48): "Cortex-X2",
    (0x41, 0xD49): "Neoverse-N2",
    (0x41, 0xD4D): "Cortex-A715",
    (0x41, 0xD4E): "Cortex-X3",
    (0x41, 0xD80): "Cortex-A520",
    (0x41, 0xD81): "Cortex-A720",
    (0x41, 0xD82): "Cortex-X4",
    (0x4E, 0x004): "NVIDIA Carmel",
}

# The same names keyed by the device tree's spelling ("arm,cortex-a53" -> "cortex-a53"), so an
# image probed from its DT alone names its cores as the live board's cpuinfo does.
_DT_CORE_NAMES = {name.lower(): name for name in ARM_CORE_NAMES.values()}

# DRM render-node drivers that are inference-capable GPUs or NPUs (kind, human name).
DRM_DRIVERS = {
    "i915": ("gpu", "Intel GPU"),
    "xe": ("gpu", "Intel GPU"),
    "amdgpu": ("gpu", "AMD GPU"),
    "panfrost": ("gpu", "Arm Mali GPU"),
    "panthor": ("gpu", "Arm Mali GPU"),
    "etnaviv": ("gpu", "Vivante GPU/NPU (etnaviv)"),
    "v3d": ("gpu", "Broadcom V3D GPU"),
    "msm": ("gpu", "Qualcomm Adreno GPU"),
    "nouveau": ("gpu", "NVIDIA GPU (nouveau)"),
    "tegra": ("gpu", "NVIDIA Tegra GPU"),
    "nvgpu": ("gpu", "NVIDIA Tegra GPU"),
    "rknpu": ("npu", "Rockchip NPU (rknpu)"),
    "vc4": ("gpu", "Broadcom VC4 GPU"),
}  # keys are lower case: Rockchip's vendor NPU driver registers itself as "RKNPU"
ACCEL_DRIVERS = {
    "intel_vpu": "Intel NPU",
    "rocket": "Rockchip NPU (rocket)",
    "amdxdna": "AMD XDNA NPU",
    "ethosu": "Arm Ethos-U NPU",
    "qaic": "Qualcomm Cloud AI",
    "habanalabs": "Habana Gaudi",
}
# Coral Edge TPU over USB: before its firmware is loaded / after (the id changes).
CORAL_USB_IDS = {("1a6e", "089a"): "Coral USB (no firmware yet)", ("18d1", "9302"): "Coral USB"}


@dataclass(frozen=True)
class DeviceNode:
    """A vendor driver's character device, which no udev class describes (galcore, ethosu,
    rknpu, hailo): declared by the backend that uses it (`DEVICES` in its module) and listed
    by the probe as an Accelerator when a node matches."""

    kind: str  # "npu", "tpu"
    pattern: str  # a /dev glob: "/dev/hailo*"
    name: str  # for people: "Hailo AI accelerator"
    subsystem: str | None = None  # the udev subsystem its hot-plug events come from


@dataclass(frozen=True)
class Accelerator:
    kind: str  # "npu", "gpu", "tpu"
    name: str
    node: str | None  # device node, e.g. /dev/galcore
    driver: str | None


@dataclass(frozen=True)
class HardwareFacts:
    arch: str
    cpu_model: str
    cpus_online: list[int]
    core_types: dict[str, list[int]]  # core name -> CPU numbers
    isa_int8: list[str]
    soc_compatible: list[str]  # device-tree root `compatible`, most specific first
    board_model: str | None  # device-tree `model`, or DMI vendor + product on x86
    dmi: dict[str, str]
    memory_bytes: int | None
    accelerators: list[Accelerator] = field(default_factory=list)
    root: str = "/"
    dtb: str | None = None  # the .dtb the device-tree facts came from (offline planning)

    @property
    def offline(self) -> bool:
        """Facts of another machine (an image root, a board's .dtb), not of this one."""
        return self.root != "/" or self.dtb is not None

    @property
    def cpu_count(self) -> int:
        return len(self.cpus_online)

    def has_node(self, node: str) -> bool:
        return any(acc.node == node for acc in self.accelerators)

    @property
    def int8_dot_product(self) -> bool:
        """An 8-bit dot-product instruction (VNNI, AMX, Arm dotprod/i8mm) is there."""
        return any(f in INT8_DOT_FLAGS for f in self.isa_int8)

    def isa_summary(self) -> str:
        """One phrase for evidence lines: "avx2, avx512f, avx512_vnni" or "avx2, no VNNI"."""
        flags = ", ".join(self.isa_int8) or "no SIMD int8 extensions found"
        if self.int8_dot_product or not self.isa_int8:
            return flags
        return flags + (", no VNNI" if self.arch == "x86_64" else ", no dotprod")

    def soc_matches(self, prefixes: tuple[str, ...]) -> bool:
        return any(c.startswith(p) for c in self.soc_compatible for p in prefixes)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["cpu_count"] = self.cpu_count
        return data

    def fingerprint(self) -> str:
        """Stable id of what decides backend speed; part of the selection cache key."""
        stable = {
            "arch": self.arch,
            "cpu_model": self.cpu_model,
            "cpus": self.cpus_online,
            "core_types": self.core_types,
            "isa": self.isa_int8,
            "soc": self.soc_compatible,
            "acc": sorted((a.kind, a.name, a.driver or "") for a in self.accelerators),
        }
        return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def probe(
    root: SysRoot | None = None,
    dtb: str | os.PathLike[str] | None = None,
    nodes: Sequence[DeviceNode] = (),
) -> HardwareFacts:
    """The facts of `root` (live `/` by default). `dtb`: a board's .dtb that stands for the
    root's device tree (an image folder has none of its own): its SoC, board model, CPUs and
    memory come from the file; with `dtb` and no image root, nothing is read from this
    machine (its CPUs, ISA and devices are not the board's). FdtError names a bad .dtb.
    `nodes`: the vendor device nodes to look for besides the udev classes (the backends
    declare theirs: `backends.probe_hardware` passes them all)."""
    root = root or SysRoot()
    if dtb is None:
        return _probe(root, root, nodes)
    from sysconf.fdt import load_fdt, materialize

    tree = load_fdt(dtb)
    with tempfile.TemporaryDirectory(prefix="edged-dtb-") as tmp:
        materialize(tree, Path(tmp) / "proc" / "device-tree")
        board = SysRoot.at(tmp)
        facts = _probe(board if root.is_live else root, board, nodes)
        return replace(facts, dtb=str(dtb), root=str(root.root))  # "/": no image given


def _probe(root: SysRoot, dt_root: SysRoot, nodes: Sequence[DeviceNode]) -> HardwareFacts:
    """`dt_root` is where the device tree is read (the root itself, or a .dtb's folder)."""
    cpuinfo = _parse_cpuinfo(root.read_text("/proc/cpuinfo", ""))
    dt_base = _device_tree_base(dt_root)
    compatible = _dt_strings(dt_root, f"{dt_base}/compatible") if dt_base else []
    cpus = _read_cpulist(root, "/sys/devices/system/cpu/online") or _cpuinfo_cpus(cpuinfo)
    if not cpus and dt_base:
        cpus = list(range(len(_dt_cpu_nodes(dt_root, dt_base))))
    dmi = _read_dmi(root)
    models = _dt_strings(dt_root, f"{dt_base}/model") if dt_base else []
    model = models[0] if models else None
    if model is None and dmi:
        model = " ".join(v for k, v in dmi.items() if k in ("sys_vendor", "product_name")) or None
    return HardwareFacts(
        arch=_arch(root, cpuinfo, compatible),
        cpu_model=_cpu_model(cpuinfo),
        cpus_online=cpus,
        core_types=_core_types(root, cpuinfo, dt_base, cpus, dt_root),
        isa_int8=_isa_int8(cpuinfo, _runtime_features() if root.is_live else None),
        soc_compatible=compatible,
        board_model=model,
        dmi=dmi,
        memory_bytes=_memory_bytes(root, dt_base, dt_root),
        accelerators=find_accelerators(root, nodes),
        root=str(root.root),
    )


def _parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """One dict per `processor` block; ARM's trailing global block (Hardware:) is dropped."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if "processor" in current:
                blocks.append(current)
            current = {}
            continue
        key, _, value = line.partition(":")
        current[key.strip()] = value.strip()
    return blocks


def _read_cpulist(root: SysRoot, path: str) -> list[int]:
    """A kernel CPU-list file; missing or malformed (a damaged image) means "not known"."""
    try:
        return parse_cpulist(root.read_line(path) or "")
    except ValueError:
        return []


def _processor_number(block: dict[str, str]) -> int | None:
    try:
        return int(block["processor"])
    except (KeyError, ValueError):  # a damaged cpuinfo must not stop the probe
        return None


def _cpuinfo_cpus(cpuinfo: list[dict[str, str]]) -> list[int]:
    return sorted({n for n in map(_processor_number, cpuinfo) if n is not None})


def _arch(root: SysRoot, cpuinfo: list[dict[str, str]], compatible: list[str]) -> str:
    if root.is_live:
        return platform.machine()
    first = cpuinfo[0] if cpuinfo else {}
    if "vendor_id" in first or "flags" in first:
        return "x86_64" if " lm " in f" {first.get('flags', '')} " else "i686"
    if "CPU architecture" in first:
        return "aarch64" if first["CPU architecture"] in ("8", "AArch64") else "armv7l"
    return "unknown" if not compatible else "arm"


def _cpu_model(cpuinfo: list[dict[str, str]]) -> str:
    names = [b["model name"] for b in cpuinfo if b.get("model name")]
    if names:
        return names[0]
    cores = sorted({_arm_core_name(b) for b in cpuinfo if "CPU part" in b})
    return " + ".join(cores) if cores else "unknown"


def _arm_core_name(block: dict[str, str]) -> str:
    try:
        key = (int(block.get("CPU implementer", "0"), 16), int(block["CPU part"], 16))
    except (KeyError, ValueError):
        return "unknown ARM core"
    return ARM_CORE_NAMES.get(key, f"ARM core {key[0]:#x}/{key[1]:#05x}")


def _core_types(
    root: SysRoot,
    cpuinfo: list[dict[str, str]],
    dt_base: str | None,
    cpus: list[int],
    dt_root: SysRoot,
) -> dict[str, list[int]]:
    types: dict[str, list[int]] = {}
    # Intel hybrid (Alder Lake and later): the PMU folders list P- and E-cores.
    for pmu, label in (("cpu_core", "P-core"), ("cpu_atom", "E-core")):
        pmu_cpus = _read_cpulist(root, f"/sys/devices/{pmu}/cpus")
        if pmu_cpus:
            types[label] = pmu_cpus
    if types:
        return types
    for block in cpuinfo:
        number = _processor_number(block)
        if "CPU part" in block and number is not None:
            types.setdefault(_arm_core_name(block), []).append(number)
    if not types and dt_base:
        for index, node in enumerate(_dt_cpu_nodes(dt_root, dt_base)):
            compat = _dt_strings(dt_root, f"{node}/compatible")
            name = compat[0].split(",")[-1] if compat else "unknown"
            types.setdefault(_DT_CORE_NAMES.get(name.lower(), name), []).append(index)
    if not types and cpuinfo and cpus:
        types[_cpu_model(cpuinfo)] = cpus
    return types


def _isa_int8(cpuinfo: list[dict[str, str]], runtime: dict[str, bool] | None = None) -> list[str]:
    """The INT8-relevant flags of cpuinfo, checked against what this process can execute.

    /proc/cpuinfo describes the host's CPU, which is not always the one the runtimes'
    kernels run on: under an emulator (qemu-user -cpu Haswell on an AVX-512 host) or a
    CPUID mask, cpuinfo lists VNNI while the kernels dispatch (by CPUID) to AVX2 code. So on
    the live system each flag numpy's runtime dispatch knows is taken from there, and when
    the two disagree, cpuinfo's other flags are not trusted either."""
    if not cpuinfo:
        return []
    first = cpuinfo[0]
    flags = set((first.get("flags") or first.get("Features") or "").split())
    wanted = X86_INT8_FLAGS if "flags" in first else ARM_INT8_FEATURES
    found = [f for f in wanted if f in flags]
    if not runtime:
        return found
    known = {f: runtime.get(NUMPY_FEATURES[f], False) for f in wanted if f in NUMPY_FEATURES}
    trusted = all(known[f] for f in found if f in known)
    if not trusted:
        return [f for f in wanted if known.get(f)]
    return [f for f in found if known.get(f, True)]


def _runtime_features() -> dict[str, bool] | None:
    """numpy's CPU-dispatch table (CPUID on x86, AT_HWCAP on Arm) for this process, or None
    where it is not there. numpy reads it at import to pick its own SIMD kernels; no public
    API exposes it besides `numpy.show_runtime()`, which prints."""
    try:
        from numpy._core import _multiarray_umath as umath  # type: ignore[attr-defined]
    except ImportError:
        try:
            from numpy.core import _multiarray_umath as umath  # numpy 1.x
        except ImportError:
            return None
    features = getattr(umath, "__cpu_features__", None)
    return dict(features) if isinstance(features, dict) else None


def _device_tree_base(root: SysRoot) -> str | None:
    for base in ("/proc/device-tree", "/sys/firmware/devicetree/base"):
        if root.exists(f"{base}/compatible"):
            return base
    return None


def _dt_strings(root: SysRoot, path: str) -> list[str]:
    raw = root.read_bytes(path)
    if not raw:
        return []
    return [s.decode(errors="replace") for s in raw.rstrip(b"\x00").split(b"\x00")]


def _dt_cpu_nodes(root: SysRoot, dt_base: str) -> list[str]:
    """CPU nodes in the order the kernel numbers them (the tree's order, which on real boards
    is ascending `reg`). A folder has no tree order and its names sort as text, which puts
    cpu@100 before cpu@2 and scrambles big.LITTLE clusters, so sort by the unit address."""
    names = [
        name
        for name in root.listdir(f"{dt_base}/cpus")
        if name.startswith("cpu@")
        and _dt_strings(root, f"{dt_base}/cpus/{name}/device_type") == ["cpu"]
    ]
    return [f"{dt_base}/cpus/{name}" for name in sorted(names, key=_unit_address_key)]


def _unit_address_key(name: str) -> tuple[int, tuple[int, ...]]:
    try:
        return (0, tuple(int(part, 16) for part in name.partition("@")[2].split(",")))
    except ValueError:  # not a hex address: after the numbered ones, in name order
        return (1, ())


def _read_dmi(root: SysRoot) -> dict[str, str]:
    dmi = {}
    for key in ("sys_vendor", "product_name", "board_vendor", "board_name", "bios_version"):
        value = root.read_line(f"/sys/class/dmi/id/{key}")
        if value:
            dmi[key] = value
    return dmi


def _memory_bytes(root: SysRoot, dt_base: str | None, dt_root: SysRoot) -> int | None:
    for line in (root.read_text("/proc/meminfo", "") or "").splitlines():
        fields = line.split()
        if fields[:1] == ["MemTotal:"] and len(fields) > 1 and fields[1].isdecimal():
            return int(fields[1]) * 1024  # meminfo counts kB; facts leave in bytes
    if dt_base:
        return _dt_memory_bytes(dt_root, dt_base)
    return None


def _dt_memory_bytes(root: SysRoot, dt_base: str) -> int | None:
    """Sum of /memory@*/reg sizes: an image has no /proc/meminfo, but its board's DT says."""
    cells = root.read_bytes(f"{dt_base}/#address-cells")
    size_cells = root.read_bytes(f"{dt_base}/#size-cells")
    addr_n = struct.unpack(">I", cells)[0] if cells and len(cells) == 4 else 2
    size_n = struct.unpack(">I", size_cells)[0] if size_cells and len(size_cells) == 4 else 1
    stride = 4 * (addr_n + size_n)
    if size_n == 0:  # a malformed root (#size-cells = 0) describes no sizes at all
        return None
    total = 0
    for name in root.listdir(dt_base):
        if not (name == "memory" or name.startswith("memory@")):
            continue
        reg = root.read_bytes(f"{dt_base}/{name}/reg") or b""
        for off in range(0, len(reg) - stride + 1, stride):
            size = 0
            for i in range(size_n):
                start = off + 4 * (addr_n + i)
                size = (size << 32) | struct.unpack(">I", reg[start : start + 4])[0]
            total += size
    return total or None


@dataclass(frozen=True)
class DeviceRecord:
    """One device as udev or sysfs describes it; the classifier below works on these."""

    subsystem: str
    sys_name: str
    node: str | None
    driver: str | None
    usb_id: tuple[str, str] | None = None


def find_accelerators(root: SysRoot, nodes: Sequence[DeviceNode] = ()) -> list[Accelerator]:
    found: list[Accelerator] = []
    records = _udev_records() if root.is_live else None
    if records is None:
        records = _sysfs_records(root)
    for rec in records:
        acc = classify(rec)
        if acc and acc not in found:
            found.append(acc)
    # Vendor drivers that register only a character device, not a class udev lists (and an
    # image root whose /sys is not populated still has its /dev nodes, e.g. Coral's apex).
    for device in nodes:
        for node in root.glob(device.pattern):
            if not any(a.node == node for a in found):
                found.append(Accelerator(device.kind, device.name, node, None))
    return found


ACCELERATOR_SUBSYSTEMS = ("accel", "drm", "apex", "usb")


def classify(rec: DeviceRecord) -> Accelerator | None:
    """The accelerator a device record is, if it is one."""
    if rec.subsystem == "accel":
        name = ACCEL_DRIVERS.get(rec.driver or "", f"accelerator ({rec.driver or 'no driver'})")
        return Accelerator("npu", name, rec.node, rec.driver)
    if rec.subsystem == "drm" and rec.sys_name.startswith("renderD"):
        kind, name = DRM_DRIVERS.get(
            (rec.driver or "").lower(), ("gpu", f"GPU ({rec.driver or '?'})")
        )
        return Accelerator(kind, name, rec.node, rec.driver)
    if rec.subsystem == "apex":
        return Accelerator("tpu", "Coral Edge TPU (PCIe)", rec.node, rec.driver)
    if rec.subsystem == "usb" and rec.usb_id in CORAL_USB_IDS:
        return Accelerator("tpu", CORAL_USB_IDS[rec.usb_id], rec.node, rec.driver)
    return None


def _udev_records() -> list[DeviceRecord] | None:
    try:
        import pyudev
    except ImportError:
        return None
    try:
        context = pyudev.Context()
    except Exception:  # no libudev on this system: fall back to reading sysfs
        return None
    records = []
    for subsystem in ACCELERATOR_SUBSYSTEMS:
        for dev in context.list_devices(subsystem=subsystem):
            rec = udev_record(dev)
            if rec is not None:
                records.append(rec)
    return records


def udev_record(dev) -> DeviceRecord | None:
    """A pyudev Device as a DeviceRecord (None for USB interfaces and id-less devices)."""
    usb_id = None
    if dev.subsystem == "usb":
        if dev.device_type != "usb_device":
            return None
        attrs = dev.attributes
        vendor, product = attrs.get("idVendor"), attrs.get("idProduct")
        if vendor is None or product is None:
            return None
        usb_id = (vendor.decode().strip(), product.decode().strip())
    driver = dev.driver or (dev.parent.driver if dev.parent is not None else None)
    return DeviceRecord(dev.subsystem, dev.sys_name, dev.device_node, driver, usb_id)


def _sysfs_records(root: SysRoot) -> list[DeviceRecord]:
    records = []
    for subsystem, devdir in (("accel", "/dev/accel"), ("drm", "/dev/dri"), ("apex", "/dev")):
        for name in root.listdir(f"/sys/class/{subsystem}"):
            driver = root.link_name(f"/sys/class/{subsystem}/{name}/device/driver")
            node = f"{devdir}/{name}"
            records.append(
                DeviceRecord(subsystem, name, node if root.exists(node) else None, driver)
            )
    for name in root.listdir("/sys/bus/usb/devices"):
        base = f"/sys/bus/usb/devices/{name}"
        vendor, product = root.read_line(f"{base}/idVendor"), root.read_line(f"{base}/idProduct")
        if vendor and product:
            records.append(
                DeviceRecord("usb", name, None, root.link_name(f"{base}/driver"), (vendor, product))
            )
    return records
