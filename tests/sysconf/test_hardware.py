"""sysconf.hardware: the live probe of this machine, and board roots built from real device trees.

Board roots are folders laid out like a device's `/`: the board's real .dtb materialized the
way the kernel shows it under /sys/firmware/devicetree/base, the /proc/cpuinfo its kernel
prints, and the sysfs links and /dev nodes its NPU/GPU drivers create. Nothing here writes to
this machine's /proc, /sys or /dev.

Creating a file costs about a millisecond on the test machine's disk, and a full tree is 500 to
2,400 files, so each board's tree is materialized once per session and hard-linked into each
test's root. Boards that only feed the CPU and memory checks get the real tree cut down to the
nodes those read (root properties, /cpus, the memory nodes).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from backends import device_nodes, probe_hardware
from sysconf.cpulist import parse_cpulist
from sysconf.fdt import DeviceTree, Node, load_fdt, materialize
from sysconf.hardware import Accelerator, DeviceNode, HardwareFacts, probe
from sysconf.sysroot import SysRoot

DT_BASE = "sys/firmware/devicetree/base"

# arm64 6.1 `Features` lines: Cortex-A53/A72 (ARMv8.0) and Cortex-A55 (ARMv8.2, dot product).
V80_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"
A55_FEATURES = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc "
    "dcpop asimddp"
)


@dataclass(frozen=True)
class Board:
    dtb: str
    clusters: tuple[tuple[int, int, int, int], ...]  # (count, CPU part, variant, revision)
    features: str
    bogomips: str  # the arch timer's rate: 8 MHz on i.MX8M, 24 MHz elsewhere
    full_tree: bool = False

    @property
    def ncpus(self) -> int:
        return sum(c[0] for c in self.clusters)


BOARDS = {
    "imx8mp": Board(
        "freescale/imx8mp-evk.dtb", ((4, 0xD03, 0x0, 4),), V80_FEATURES, "16.00", full_tree=True
    ),
    "imx93": Board(
        "freescale/imx93-11x11-evk.dtb",
        ((2, 0xD05, 0x2, 0),),
        A55_FEATURES,
        "48.00",
        full_tree=True,
    ),
    "rk3568": Board("rockchip/rk3568-rock-3a.dtb", ((4, 0xD05, 0x2, 0),), A55_FEATURES, "48.00"),
    "rk3399": Board(
        "rockchip/rk3399-rockpro64.dtb",
        ((4, 0xD03, 0x0, 4), (2, 0xD08, 0x0, 2)),
        V80_FEATURES,
        "48.00",
    ),
}


def arm64_cpuinfo(board: Board) -> str:
    """/proc/cpuinfo as arch/arm64/kernel/cpuinfo.c prints it (one block a CPU, blank line)."""
    blocks, n = [], 0
    for count, part, variant, revision in board.clusters:
        for _ in range(count):
            blocks.append(
                f"processor\t: {n}\n"
                f"BogoMIPS\t: {board.bogomips}\n"
                f"Features\t: {board.features}\n"
                "CPU implementer\t: 0x41\n"
                "CPU architecture: 8\n"
                f"CPU variant\t: 0x{variant:x}\n"
                f"CPU part\t: 0x{part:03x}\n"
                f"CPU revision\t: {revision}\n\n"
            )
            n += 1
    return "".join(blocks)


def probe_subset(tree: DeviceTree) -> DeviceTree:
    """The real tree with only the nodes the CPU and memory probes read."""
    keep = [
        n for n in tree.root.children if n.name == "cpus" or n.prop_str("device_type") == "memory"
    ]
    root = Node(name="", path="/", properties=dict(tree.root.properties), children=keep)
    return DeviceTree(root=root, source=tree.source)


@pytest.fixture(scope="session")
def materialized(
    dtb_corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, bool], Path]:
    """(dtb, full) -> a folder written by sysconf.fdt.materialize, once per session."""
    cache: dict[tuple[str, bool], Path] = {}

    def get(dtb: str, full: bool) -> Path:
        if (dtb, full) not in cache:
            tree = load_fdt(dtb_corpus / dtb)
            dest = tmp_path_factory.mktemp("dt") / "base"
            materialize(tree if full else probe_subset(tree), dest)
            cache[dtb, full] = dest
        return cache[dtb, full]

    return get


@pytest.fixture
def board_root(tmp_path: Path, materialized: Callable[[str, bool], Path]) -> Callable[..., Path]:
    """Build a board's root: device tree, and unless told otherwise cpuinfo and cpu/online."""
    count = 0

    def build(name: str, *, cpuinfo: bool = True, online: bool = True) -> Path:
        nonlocal count
        count += 1
        board = BOARDS[name]
        root = tmp_path / f"{name}-{count}"
        dt = root / DT_BASE
        dt.parent.mkdir(parents=True)
        shutil.copytree(materialized(board.dtb, board.full_tree), dt, copy_function=os.link)
        if cpuinfo:
            write(root, "proc/cpuinfo", arm64_cpuinfo(board))
        if online:
            write(root, "sys/devices/system/cpu/online", f"0-{board.ncpus - 1}\n")
        return root

    return build


def write(root: Path, path: str, text: str | bytes = "") -> Path:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        target.write_bytes(text)
    else:
        target.write_text(text)
    return target


def rel_symlink(link: Path, target: Path) -> None:
    """A relative link, as sysfs makes them (an absolute one would point into this machine)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def class_device(root: Path, subsystem: str, name: str, parent: str, bus: str, driver: str) -> None:
    """sysfs for a class device as the driver core makes it: /sys/class/<subsystem>/<name>
    links to the device's folder under its parent, whose `device` links to the parent and the
    parent's `driver` to /sys/bus/<bus>/drivers/<driver>."""
    parent_dir = root / "sys/devices" / parent
    dev_dir = parent_dir / subsystem / name
    rel_symlink(root / "sys/class" / subsystem / name, dev_dir)
    rel_symlink(dev_dir / "device", parent_dir)
    if not (parent_dir / "driver").is_symlink():
        rel_symlink(parent_dir / "driver", root / "sys/bus" / bus / "drivers" / driver)


def usb_device(
    root: Path, name: str, parent: str, vendor: str | None, product: str | None, driver: str = "usb"
) -> None:
    dev_dir = root / "sys/devices" / parent / name
    rel_symlink(root / "sys/bus/usb/devices" / name, dev_dir)
    if vendor is not None and product is not None:
        write(dev_dir, "idVendor", f"{vendor}\n")
        write(dev_dir, "idProduct", f"{product}\n")
    rel_symlink(dev_dir / "driver", root / "sys/bus/usb/drivers" / driver)


def dt_memory(tree: DeviceTree) -> int | None:
    """Memory size from a parsed tree, independently of the probe (which reads the folder)."""
    (addr_cells,) = tree.root.prop_u32s("#address-cells") or [2]
    (size_cells,) = tree.root.prop_u32s("#size-cells") or [1]
    total = 0
    for node in tree.root.children:
        if node.prop_str("device_type") != "memory":
            continue
        cells = node.prop_u32s("reg")
        step = addr_cells + size_cells
        for i in range(0, len(cells), step):
            size = 0
            for cell in cells[i + addr_cells : i + step]:
                size = size << 32 | cell
            total += size
    return total or None


# --- live: this machine -----------------------------------------------------------------------


def _live_flags() -> set[str]:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags |= set(value.split())
    return flags


@pytest.fixture(scope="module")
def live() -> HardwareFacts:
    return probe_hardware(SysRoot())


def test_live_identity(live: HardwareFacts) -> None:
    assert live.arch == platform.machine()
    assert live.root == "/"
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert online, "this machine reports no online CPUs?"
    assert live.cpus_online == online
    assert live.cpu_count == len(online)
    for cpu in online:
        assert Path(f"/sys/devices/system/cpu/cpu{cpu}").is_dir()
    assert sorted(c for cpus in live.core_types.values() for c in cpus) == online


@pytest.mark.isa
def test_live_isa(live: HardwareFacts) -> None:
    """The ISA the runtimes' kernels will really use: cpuinfo's flags as far as this process
    can execute them. In the isa-avx2 lane (qemu-x86_64 -cpu Haswell on any host) cpuinfo
    still shows the host's flags, and the probe must not believe its VNNI."""
    flags = _live_flags()
    assert set(live.isa_int8) <= flags
    known = {
        "avx2",
        "avx512f",
        "avx512_vnni",
        "avx_vnni",
        "amx_int8",
        "amx_tile",
        "asimd",
        "asimddp",
        "i8mm",
        "sve",
        "sve2",
        "bf16",
    }
    if os.environ.get("EDGED_ISA_LANE") == "avx2":
        assert live.isa_int8 == ["avx2"] and not live.int8_dot_product
        assert live.isa_summary() == "avx2, no VNNI"
        return
    if "avx2" in flags:
        assert "avx2" in live.isa_int8
    assert set(live.isa_int8) == flags & known  # nothing int8-relevant left out
    assert live.int8_dot_product == bool(
        flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm"}
    )


def test_isa_checked_against_what_the_process_can_run() -> None:
    """cpuinfo says VNNI (the host's), CPUID says AVX2 only (an emulated or masked CPU):
    the CPUID view wins, and flags it cannot check are dropped with the untrusted cpuinfo."""
    from sysconf.hardware import _isa_int8

    host = [{"flags": "fpu sse2 avx2 avx512f avx512_vnni avx_vnni amx_tile"}]
    haswell = {"AVX2": True, "AVX512F": False, "AVX512VNNI": False}
    assert _isa_int8(host, haswell) == ["avx2"]
    same = {"AVX2": True, "AVX512F": True, "AVX512VNNI": True}
    assert _isa_int8(host, same) == ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile"]
    assert _isa_int8(host, None) == ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile"]
    arm = [{"Features": "fp asimd evtstrm aes asimddp i8mm"}]
    assert _isa_int8(arm, {"ASIMD": True, "ASIMDDP": True}) == ["asimd", "asimddp", "i8mm"]
    assert _isa_int8(arm, {"ASIMD": True, "ASIMDDP": False}) == ["asimd"]


def test_live_memory(live: HardwareFacts) -> None:
    meminfo = Path("/proc/meminfo").read_text()
    kib = int(re.search(r"^MemTotal:\s+(\d+) kB$", meminfo, re.M).group(1))
    assert live.memory_bytes == kib * 1024


def test_live_accelerators_match_dev(live: HardwareFacts) -> None:
    """Every DRM render node and accel node this machine has is reported, and nothing else
    with a node under /dev/dri or /dev/accel (on the test VM: none at all)."""
    nodes = {str(p) for pat in ("dri/renderD*", "accel/accel*") for p in Path("/dev").glob(pat)}
    reported = {
        a.node
        for a in live.accelerators
        if a.node and a.node.startswith(("/dev/dri/", "/dev/accel/"))
    }
    assert reported == nodes
    for acc in live.accelerators:
        assert acc.kind in ("npu", "gpu", "tpu")
        assert acc.node is None or Path(acc.node).exists()


def test_live_fingerprint_and_json(live: HardwareFacts) -> None:
    again = probe_hardware()
    assert again.fingerprint() == live.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{16}", live.fingerprint())
    data = json.loads(json.dumps(live.to_dict()))
    assert data["cpu_count"] == len(live.cpus_online)
    assert data["cpus_online"] == live.cpus_online
    assert data["arch"] == live.arch


# --- boards from real device trees ------------------------------------------------------------


def test_imx8mp(board_root: Callable[..., Path], dtb_corpus: Path) -> None:
    root = board_root("imx8mp")
    facts = probe_hardware(SysRoot(root))
    tree = load_fdt(dtb_corpus / BOARDS["imx8mp"].dtb)
    assert facts.arch == "aarch64"
    assert facts.soc_compatible[0] == "fsl,imx8mp-evk"
    assert "fsl,imx8mp" in facts.soc_compatible
    assert facts.soc_compatible == tree.compatible()
    assert facts.soc_matches(("fsl,imx8mp",)) and not facts.soc_matches(("fsl,imx93",))
    assert facts.board_model == tree.model() == "NXP i.MX8MPlus EVK board"
    assert facts.cpus_online == [0, 1, 2, 3]
    assert facts.core_types == {"Cortex-A53": [0, 1, 2, 3]}
    assert facts.cpu_model == "Cortex-A53"
    assert facts.isa_int8 == ["asimd"]  # the A53 has no dot product (asimddp)
    assert facts.dmi == {}
    assert facts.accelerators == []
    assert facts.root == str(root)

    write(root, "dev/galcore")
    npu = probe_hardware(SysRoot(root))
    assert npu.accelerators == [Accelerator("npu", "Vivante NPU (galcore)", "/dev/galcore", None)]
    assert npu.has_node("/dev/galcore")


def test_imx8mp_memory_from_device_tree(board_root: Callable[..., Path], dtb_corpus: Path) -> None:
    root = board_root("imx8mp")
    expected = dt_memory(load_fdt(dtb_corpus / BOARDS["imx8mp"].dtb))
    assert expected == 6 << 30  # the EVK's 6 GiB LPDDR4, in two banks: 3 GiB below 4 GiB + 3
    assert probe_hardware(SysRoot(root)).memory_bytes == expected

    # Live, the kernel's count wins over the DT (it excludes firmware and reserved memory).
    write(root, "proc/meminfo", "MemTotal:        5896560 kB\nMemFree:         5201124 kB\n")
    assert probe_hardware(SysRoot(root)).memory_bytes == 5896560 * 1024


@pytest.mark.parametrize(
    ("dtb", "size"),
    [
        ("broadcom/bcm2837-rpi-3-b-plus.dtb", 1 << 30),  # #size-cells = 1
        ("renesas/r8a774a1-hihope-rzg2m.dtb", 0x78000000 + 0x80000000),  # two memory nodes
        ("arm/juno-r2.dtb", 0x7F000000 + 0x180000000),  # two ranges, one above 4 GiB
        ("broadcom/bcm2711-rpi-4-b.dtb", None),  # size 0: the Pi firmware fills it in
        ("rockchip/rk3568-rock-3a.dtb", None),  # no memory node: U-Boot adds it
    ],
)
def test_memory_from_device_tree(
    dtb: str,
    size: int | None,
    materialized: Callable[[str, bool], Path],
    dtb_corpus: Path,
    tmp_path: Path,
) -> None:
    shutil.copytree(materialized(dtb, False), tmp_path / DT_BASE, copy_function=os.link)
    assert dt_memory(load_fdt(dtb_corpus / dtb)) == size
    assert probe_hardware(SysRoot(tmp_path)).memory_bytes == size


def test_vendor_nodes_are_the_ones_the_caller_names(tmp_path: Path) -> None:
    """sysconf knows no vendor driver by itself: the backends declare their device nodes
    (`DEVICES`) and edged's probe passes them; a bare probe lists only the udev classes."""
    write(tmp_path, "dev/galcore")
    write(tmp_path, "dev/rknpu")
    write(tmp_path, "dev/hailo0")
    assert probe(SysRoot(tmp_path)).accelerators == []
    own = DeviceNode("npu", "/dev/rknpu", "an NPU")
    assert probe(SysRoot(tmp_path), nodes=[own]).accelerators == [
        Accelerator("npu", "an NPU", "/dev/rknpu", None)
    ]
    found = {a.node for a in probe_hardware(SysRoot(tmp_path)).accelerators}
    assert found == {"/dev/galcore", "/dev/rknpu", "/dev/hailo0"} & {
        node for d in device_nodes() for node in SysRoot(tmp_path).glob(d.pattern)
    }
    assert "/dev/galcore" in found


def test_imx93(board_root: Callable[..., Path], dtb_corpus: Path) -> None:
    root = board_root("imx93")
    facts = probe_hardware(SysRoot(root))
    assert facts.arch == "aarch64"
    assert facts.soc_compatible == ["fsl,imx93-11x11-evk", "fsl,imx93"]
    assert facts.board_model == load_fdt(dtb_corpus / BOARDS["imx93"].dtb).model()
    assert facts.core_types == {"Cortex-A55": [0, 1]}
    assert "asimddp" in facts.isa_int8 and "asimd" in facts.isa_int8
    assert facts.memory_bytes is None  # this DT has no memory node, the root no meminfo
    assert facts.accelerators == []

    write(root, "dev/ethosu0")  # NXP's Ethos-U65 driver: a char device, no accel class
    npu = probe_hardware(SysRoot(root))
    assert npu.accelerators == [Accelerator("npu", "Arm Ethos-U NPU", "/dev/ethosu0", None)]


def test_coral_pcie_node_without_sysfs(tmp_path: Path) -> None:
    """An image root with Coral's /dev/apex_0 but no populated /sys/class/apex (a rootfs
    folder, a container): the node alone still shows the Edge TPU, once per node."""
    assert probe_hardware(SysRoot(tmp_path)).accelerators == []
    write(tmp_path, "dev/apex_0")
    write(tmp_path, "dev/apex_1")
    write(tmp_path, "dev/apexd")  # not an apex_N node
    assert probe_hardware(SysRoot(tmp_path)).accelerators == [
        Accelerator("tpu", "Coral Edge TPU (PCIe)", "/dev/apex_0", None),
        Accelerator("tpu", "Coral Edge TPU (PCIe)", "/dev/apex_1", None),
    ]
    # With sysfs, the class entry (and its driver) is the one reported, not a duplicate.
    write(tmp_path, "sys/class/apex/apex_0/uevent")
    (tmp_path / "drivers" / "apex").mkdir(parents=True)
    (tmp_path / "sys/class/apex/apex_0/device").mkdir()
    (tmp_path / "sys/class/apex/apex_0/device/driver").symlink_to(tmp_path / "drivers/apex")
    accs = probe_hardware(SysRoot(tmp_path)).accelerators
    assert [(a.node, a.driver) for a in accs] == [("/dev/apex_0", "apex"), ("/dev/apex_1", None)]


def test_rk3568_vendor_npu_and_mali(board_root: Callable[..., Path]) -> None:
    """Rockchip's vendor kernel: RKNPU in DRM mode (render node, platform driver "RKNPU", in
    capitals) next to the Mali-G52 under panfrost."""
    root = board_root("rk3568")
    facts = probe_hardware(SysRoot(root))
    assert facts.arch == "aarch64"
    assert facts.soc_matches(("rockchip,rk3568",))
    assert facts.board_model == "Radxa ROCK3 Model A"
    assert facts.core_types == {"Cortex-A55": [0, 1, 2, 3]}
    assert "asimddp" in facts.isa_int8
    assert facts.accelerators == []

    class_device(root, "drm", "renderD128", "platform/fde60000.gpu", "platform", "panfrost")
    class_device(root, "drm", "card0", "platform/fde60000.gpu", "platform", "panfrost")
    class_device(root, "drm", "renderD129", "platform/fde40000.npu", "platform", "RKNPU")
    class_device(root, "drm", "card1", "platform/fde40000.npu", "platform", "RKNPU")
    write(root, "sys/class/drm/version", "drm 1.1.0 20060810\n")
    for node in ("card0", "card1", "renderD128", "renderD129"):
        write(root, f"dev/dri/{node}")
    accs = probe_hardware(SysRoot(root)).accelerators
    assert accs == [
        Accelerator("gpu", "Arm Mali GPU", "/dev/dri/renderD128", "panfrost"),
        Accelerator("npu", "Rockchip NPU (rknpu)", "/dev/dri/renderD129", "RKNPU"),
    ]


@pytest.mark.parametrize(
    ("dtb", "expected"),
    [
        ("rockchip/rk3399-rockpro64.dtb", {"Cortex-A53": [0, 1, 2, 3], "Cortex-A72": [4, 5]}),
        ("amlogic/meson-g12b-odroid-n2.dtb", {"Cortex-A53": [0, 1], "Cortex-A73": [2, 3, 4, 5]}),
        ("arm/juno-r2.dtb", {"Cortex-A72": [0, 1], "Cortex-A53": [2, 3, 4, 5]}),
    ],
)
def test_big_little_from_device_tree_alone(
    dtb: str,
    expected: dict[str, list[int]],
    materialized: Callable[[str, bool], Path],
    dtb_corpus: Path,
    tmp_path: Path,
) -> None:
    """An image root has no cpuinfo: cores come from /cpus, numbered as the kernel numbers
    them (tree order; cpu@100 comes after cpu@3, though it sorts before it as text)."""
    shutil.copytree(materialized(dtb, False), tmp_path / DT_BASE, copy_function=os.link)
    cpus = load_fdt(dtb_corpus / dtb).root.child("cpus")
    names = {
        "arm,cortex-a53": "Cortex-A53",
        "arm,cortex-a72": "Cortex-A72",
        "arm,cortex-a73": "Cortex-A73",
    }
    from_tree: dict[str, list[int]] = {}
    cpu_nodes = [n for n in cpus.children if n.prop_str("device_type") == "cpu"]
    for index, node in enumerate(cpu_nodes):
        from_tree.setdefault(names[node.prop_strings("compatible")[0]], []).append(index)
    assert from_tree == expected
    facts = probe_hardware(SysRoot(tmp_path))
    assert facts.core_types == expected
    assert facts.cpus_online == list(range(6))
    assert facts.arch == "arm"  # a DT alone does not say whether the kernel is 32 or 64 bit


def test_device_tree_and_cpuinfo_name_cores_alike(board_root: Callable[..., Path]) -> None:
    with_cpuinfo = probe_hardware(SysRoot(board_root("rk3399")))
    image = probe_hardware(SysRoot(board_root("rk3399", cpuinfo=False, online=False)))
    assert with_cpuinfo.core_types == {"Cortex-A53": [0, 1, 2, 3], "Cortex-A72": [4, 5]}
    assert image.core_types == with_cpuinfo.core_types
    assert image.cpus_online == with_cpuinfo.cpus_online == [0, 1, 2, 3, 4, 5]
    assert with_cpuinfo.cpu_model == "Cortex-A53 + Cortex-A72"


# --- accelerators from sysfs ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parent", "bus", "driver", "name"),
    [
        ("platform/fdab0000.npu", "platform", "rocket", "Rockchip NPU (rocket)"),  # RK3588
        ("pci0000:00/0000:00:0b.0", "pci", "intel_vpu", "Intel NPU"),  # Meteor Lake
    ],
)
def test_accel_class(tmp_path: Path, parent: str, bus: str, driver: str, name: str) -> None:
    class_device(tmp_path, "accel", "accel0", parent, bus, driver)
    link = tmp_path / "sys/class/accel/accel0/device/driver"
    assert not os.path.isabs(os.readlink(link))
    assert probe_hardware(SysRoot(tmp_path)).accelerators == [
        Accelerator("npu", name, None, driver)
    ]

    write(tmp_path, "dev/accel/accel0")
    assert probe_hardware(SysRoot(tmp_path)).accelerators == [
        Accelerator("npu", name, "/dev/accel/accel0", driver)
    ]


def test_unknown_accel_driver_is_still_an_npu(tmp_path: Path) -> None:
    class_device(tmp_path, "accel", "accel0", "platform/1000000.npu", "platform", "newnpu")
    write(tmp_path, "dev/accel/accel0")
    (acc,) = probe_hardware(SysRoot(tmp_path)).accelerators
    assert (acc.kind, acc.driver, acc.node) == ("npu", "newnpu", "/dev/accel/accel0")
    assert "newnpu" in acc.name


INTEL_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi "
    "mmx fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon "
    "pebs bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq "
    "dtes64 monitor ds_cpl vmx est tm2 ssse3 sdbg fma cx16 xtpr pdcm sse4_1 sse4_2 x2apic movbe "
    "popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault "
    "epb ssbd ibrs ibpb stibp ibrs_enhanced tpr_shadow flexpriority ept vpid ept_ad fsgsbase "
    "tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb intel_pt sha_ni "
    "xsaveopt xsavec xgetbv1 xsaves split_lock_detect avx_vnni dtherm ida arat pln pts hwp "
    "hwp_notify hwp_act_window hwp_epp hwp_pkg_req hfi umip pku ospke waitpkg gfni vaes "
    "vpclmulqdq rdpid movdiri movdir64b fsrm md_clear serialize arch_lbr ibt flush_l1d "
    "arch_capabilities"
)


def intel_cpuinfo(ncpus: int) -> str:
    """/proc/cpuinfo of a Core i5-1240P (4 P-cores with HT + 8 E-cores), as x86 prints it."""
    return "".join(
        f"processor\t: {n}\n"
        "vendor_id\t: GenuineIntel\n"
        "cpu family\t: 6\n"
        "model\t\t: 154\n"
        "model name\t: 12th Gen Intel(R) Core(TM) i5-1240P\n"
        "stepping\t: 3\n"
        "microcode\t: 0x432\n"
        "cpu MHz\t\t: 1700.000\n"
        "cache size\t: 12288 KB\n"
        "physical id\t: 0\n"
        f"siblings\t: {ncpus}\n"
        f"core id\t\t: {n // 2 if n < 8 else n - 4}\n"
        "cpu cores\t: 12\n"
        f"apicid\t\t: {n}\n"
        "fpu\t\t: yes\n"
        "fpu_exception\t: yes\n"
        "cpuid level\t: 32\n"
        "wp\t\t: yes\n"
        f"flags\t\t: {INTEL_FLAGS}\n"
        "bugs\t\t: spectre_v1 spectre_v2 swapgs eibrs_pbrsb\n"
        "bogomips\t: 4224.00\n"
        "clflush size\t: 64\n"
        "cache_alignment\t: 64\n"
        "address sizes\t: 39 bits physical, 48 bits virtual\n"
        "power management:\n\n"
        for n in range(ncpus)
    )


def test_intel_hybrid_pc_with_igpu(tmp_path: Path) -> None:
    write(tmp_path, "proc/cpuinfo", intel_cpuinfo(16))
    write(tmp_path, "sys/devices/system/cpu/online", "0-15\n")
    write(tmp_path, "sys/devices/cpu_core/cpus", "0-7\n")
    write(tmp_path, "sys/devices/cpu_atom/cpus", "8-15\n")
    dmi = {
        "sys_vendor": "Intel(R) Client Systems",
        "product_name": "NUC12WSHi5",
        "board_vendor": "Intel Corporation",
        "board_name": "NUC12WSBi5",
        "bios_version": "WSADL357.0088.2023.0505.1623",
        "chassis_type": "35",
    }
    for key, value in dmi.items():
        write(tmp_path, f"sys/class/dmi/id/{key}", f"{value}\n")
    write(tmp_path, "proc/meminfo", "MemTotal:       32562852 kB\n")
    class_device(tmp_path, "drm", "card0", "pci0000:00/0000:00:02.0", "pci", "i915")
    class_device(tmp_path, "drm", "renderD128", "pci0000:00/0000:00:02.0", "pci", "i915")
    write(tmp_path, "sys/class/drm/version", "drm 1.1.0 20060810\n")
    write(tmp_path, "dev/dri/card0")
    write(tmp_path, "dev/dri/renderD128")

    facts = probe_hardware(SysRoot(tmp_path))
    assert facts.arch == "x86_64"  # from the ` lm ` (long mode) flag
    assert facts.cpu_model == "12th Gen Intel(R) Core(TM) i5-1240P"
    assert facts.cpus_online == list(range(16))
    assert facts.core_types == {"P-core": list(range(8)), "E-core": list(range(8, 16))}
    assert facts.isa_int8 == ["avx2", "avx_vnni"]
    assert facts.board_model == "Intel(R) Client Systems NUC12WSHi5"
    del dmi["chassis_type"]  # not one of the keys the probe keeps
    assert facts.dmi == dmi
    assert facts.soc_compatible == []
    assert facts.memory_bytes == 32562852 * 1024
    assert facts.accelerators == [Accelerator("gpu", "Intel GPU", "/dev/dri/renderD128", "i915")]
    json.dumps(facts.to_dict())


def test_x86_without_long_mode_is_i686(tmp_path: Path) -> None:
    write(tmp_path, "proc/cpuinfo", intel_cpuinfo(2).replace(" lm ", " "))
    assert probe_hardware(SysRoot(tmp_path)).arch == "i686"


@pytest.mark.parametrize(
    ("vendor", "product", "name"),
    [("18d1", "9302", "Coral USB"), ("1a6e", "089a", "Coral USB (no firmware yet)")],
)
def test_coral_usb(tmp_path: Path, vendor: str, product: str, name: str) -> None:
    usb_device(tmp_path, "usb2", "pci0000:00/0000:00:14.0", "1d6b", "0003")  # root hub
    usb_device(tmp_path, "2-1", "pci0000:00/0000:00:14.0/usb2", vendor, product)
    usb_device(tmp_path, "2-1:1.0", "pci0000:00/0000:00:14.0/usb2/2-1", None, None)  # interface
    assert probe_hardware(SysRoot(tmp_path)).accelerators == [Accelerator("tpu", name, None, "usb")]


def test_other_usb_devices_are_not_accelerators(tmp_path: Path) -> None:
    usb_device(tmp_path, "usb1", "pci0000:00/0000:00:14.0", "1d6b", "0002")
    usb_device(tmp_path, "1-2", "pci0000:00/0000:00:14.0/usb1", "046d", "c52b")  # a receiver
    assert probe_hardware(SysRoot(tmp_path)).accelerators == []


# --- nothing, or damage ----------------------------------------------------------------------


@pytest.mark.parametrize("make", [True, False], ids=["empty-folder", "missing-folder"])
def test_empty_root(tmp_path: Path, make: bool) -> None:
    root = tmp_path / "image"
    if make:
        root.mkdir()
    facts = probe_hardware(SysRoot(root))
    assert facts.arch == "unknown"
    assert facts.cpu_model == "unknown"
    assert facts.cpus_online == [] and facts.cpu_count == 0
    assert facts.core_types == {}
    assert facts.isa_int8 == []
    assert facts.soc_compatible == [] and facts.board_model is None
    assert facts.dmi == {}
    assert facts.memory_bytes is None
    assert facts.accelerators == []
    json.dumps(facts.to_dict())
    assert re.fullmatch(r"[0-9a-f]{16}", facts.fingerprint())


GARBAGE_CPUINFO = {
    "binary": bytes(range(256)) * 8,
    "bad-numbers": "processor\t: zero\nCPU implementer\t: banana\nCPU architecture: 8\n"
    "CPU part\t: 0xzz\n\nprocessor\t: 1.5\nflags\t\t: lm avx2\n",
    "truncated": arm64_cpuinfo(BOARDS["imx93"])[:75],
    "no-colons": "this is not\ncpuinfo at all\n\n\n",
    "only-colons": ":::\n:\n\n: :\n",
}


@pytest.mark.parametrize("content", GARBAGE_CPUINFO.values(), ids=GARBAGE_CPUINFO.keys())
def test_garbage_cpuinfo(tmp_path: Path, content: str | bytes) -> None:
    write(tmp_path, "proc/cpuinfo", content)
    facts = probe_hardware(SysRoot(tmp_path))
    json.dumps(facts.to_dict())
    facts.fingerprint()
    assert facts.accelerators == []
    assert all(isinstance(c, int) for cpus in facts.core_types.values() for c in cpus)


def test_garbage_cpuinfo_on_a_board(board_root: Callable[..., Path]) -> None:
    """Damaged cpuinfo in a board image: the device tree still answers."""
    root = board_root("rk3399", online=False)
    write(root, "proc/cpuinfo", GARBAGE_CPUINFO["bad-numbers"])
    facts = probe_hardware(SysRoot(root))
    assert facts.cpus_online == [0, 1, 2, 3, 4, 5]
    assert facts.soc_matches(("rockchip,rk3399",))


def test_damaged_kernel_files(tmp_path: Path) -> None:
    write(tmp_path, "proc/cpuinfo", intel_cpuinfo(4))
    write(tmp_path, "sys/devices/system/cpu/online", "0-\n")
    write(tmp_path, "sys/devices/cpu_core/cpus", "P-cores\n")
    write(tmp_path, "proc/meminfo", "MemTotal:       lots kB\nMemTotal:\n")
    facts = probe_hardware(SysRoot(tmp_path))
    assert facts.cpus_online == [0, 1, 2, 3]  # from cpuinfo, as if `online` were missing
    assert facts.core_types == {"12th Gen Intel(R) Core(TM) i5-1240P": [0, 1, 2, 3]}
    assert facts.memory_bytes is None


# --- fingerprint -----------------------------------------------------------------------------


def test_fingerprint_follows_accelerators_not_memory(board_root: Callable[..., Path]) -> None:
    root = board_root("imx8mp")
    write(root, "proc/meminfo", "MemTotal:        5896560 kB\n")
    base = probe_hardware(SysRoot(root))
    assert re.fullmatch(r"[0-9a-f]{16}", base.fingerprint())

    write(root, "proc/meminfo", "MemTotal:        1871660 kB\n")  # the 2 GiB EVK variant
    less_memory = probe_hardware(SysRoot(root))
    assert less_memory.memory_bytes != base.memory_bytes
    assert less_memory.fingerprint() == base.fingerprint()

    galcore = write(root, "dev/galcore")
    with_npu = probe_hardware(SysRoot(root))
    assert with_npu.fingerprint() != base.fingerprint()

    galcore.unlink()
    assert probe_hardware(SysRoot(root)).fingerprint() == base.fingerprint()

    # Another folder with the same board gives the same id: the root path is not part of it.
    assert probe_hardware(SysRoot(board_root("imx8mp"))).fingerprint() == base.fingerprint()


def test_fingerprint_tells_boards_apart(board_root: Callable[..., Path]) -> None:
    prints = {
        name: probe_hardware(SysRoot(board_root(name))).fingerprint()
        for name in ("imx8mp", "imx93", "rk3568")
    }
    assert len(set(prints.values())) == 3
