"""Device-tree rules: cross-node facts dtc and dt-validate do not look at.

Each rule reads the parsed tree (`sysconf.fdt.DeviceTree`) and yields a `Hit` per problem:
its stable `DT-...` id, the status, and the node it is about. The audit check
`sysconf.audit.checks.devicetree` declares the ids with their severities, turns hits into
findings and adds one `pass` for each rule that found nothing, so a report shows what was
checked.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from sysconf.fdt import DeviceTree, Node

__all__ = ["CMA_MIN", "MIB", "Hit", "find_hits"]

MIB = 1024 * 1024
CMA_MIN = 64 * MIB

# rmem_cma_setup() refuses a pool whose base or size is off CMA_MIN_ALIGNMENT_BYTES ("incorrect
# alignment of CMA region"). On arm64 with 4K pages that was max(MAX_ORDER - 1, pageblock_order)
# = order 10 = 4 MiB up to Linux 5.18; since 5.19 (commit "mm: cma: use pageblock_order as the
# single alignment") it is pageblock_order = 9 = 2 MiB with hugetlb. We check the stricter
# 4 MiB, which every kernel accepts.
CMA_ALIGN = 4 * MIB

# phandle-list properties and the provider property that gives the cells after each phandle
# (None: a plain list of phandles).
PHANDLE_PROPS: dict[str, str | None] = {
    "dmas": "#dma-cells",
    "clocks": "#clock-cells",
    "assigned-clock-parents": "#clock-cells",
    "resets": "#reset-cells",
    "power-domains": "#power-domain-cells",
    "phys": "#phy-cells",
    "iommus": "#iommu-cells",
    "mboxes": "#mbox-cells",
    "interrupt-parent": None,
    "memory-region": None,
    "interrupts-extended": "#interrupt-cells",
    "nvmem-cells": None,
}


def _phandle_cells(prop: str) -> tuple[bool, str | None]:
    """(whether `prop` holds phandles, the provider's cells property or None)."""
    if prop in PHANDLE_PROPS:
        return True, PHANDLE_PROPS[prop]
    if prop == "gpios" or prop.endswith("-gpios"):
        return True, "#gpio-cells"
    if prop.endswith("-supply"):  # a single regulator phandle
        return True, None
    if prop.startswith("pinctrl-") and prop[8:].isdigit():
        return True, None
    return False, None


# Compatible substrings of devices that allocate large contiguous DMA buffers (NPU/GPU/VPU).
ACCEL_COMPATIBLES = (
    "vivante,gc", "arm,mali", "rockchip,rk3588-rknn", "rockchip,rknn", "verisilicon",
    "npu", "hantro", "amlogic,meson-g12a-vdec", "nvidia,gk20a", "nvidia,gm20b", "nvidia,gp10b",
    "qcom,adreno", "img,powervr", "brcm,2711-v3d", "brcm,bcm2711-v3d", "brcm,v3d",
)  # fmt: skip
# Display controllers: they scan out from large contiguous buffers (dumb buffers, CMA helpers).
DISPLAY_COMPATIBLES = (
    "-vop", "lcdif", "dcss", "-dss", "ltdc", "display-engine", "-hvs", "-vc5", "-vc4",
    "meson-g12a-vpu", "mxsfb", "-dpu",
)  # fmt: skip
# Register blocks named after a display controller ("rockchip,rk3588-vop-grf").
DISPLAY_EXCLUDE = ("grf", "syscon")
# Companions that match the above but allocate no big buffers (SMMUs, GPU management units).
ACCEL_EXCLUDE = ("smmu", "gmu", "iommu", "interconnect", "-cc", "qfprom")

# (family, compatible substrings) for the PIO-fallback rule.
PIO_FAMILIES = (
    ("uart", ("uart", "serial", "lpuart", "scif")),
    ("spi", ("spi", "ecspi")),
    ("i2s", ("i2s",)),
    ("sai", ("sai",)),
)
_SKIP_TOP = ("/__fixups__", "/__local_fixups__", "/__symbols__", "/aliases", "/chosen")


@dataclass(frozen=True)
class Hit:
    """What one rule found at one node (the node is the finding's subject and evidence)."""

    rule: str  # the stable id, e.g. "DT-DMA-DISABLED-CONTROLLER"
    status: str  # warn | fail
    title: str
    node: Node
    observed: str
    expected: str
    remedy: str


def _ancestors(node: Node) -> Iterator[Node]:
    """The node, its parent, ... up to the root; stops if a (hand-built) chain loops."""
    seen: set[int] = set()
    cur: Node | None = node
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.parent


def _enabled(node: Node) -> bool:
    """Enabled itself and every ancestor (a disabled bus disables what sits on it)."""
    return all(n.status_ok for n in _ancestors(node))


def _cells(node: Node, prop: str) -> list[int]:
    try:
        return node.prop_u32s(prop)
    except ValueError:  # FdtError: not whole cells; nothing sane to parse
        return []


def _specifiers(
    tree: DeviceTree, node: Node, prop: str, cells_prop: str | None
) -> Iterator[tuple[int, Node | None, tuple[int, ...]]]:
    """(phandle, provider or None when dangling, argument cells) per entry of `prop`.

    Parsing stops at a dangling phandle or a provider without its cells property, since the
    rest of the list cannot be split reliably after that. Phandle 0 is an empty entry.
    """
    cells = _cells(node, prop)
    i = 0
    while i < len(cells):
        ph = cells[i]
        i += 1
        if ph == 0 and cells_prop is not None:
            continue
        provider = tree.by_phandle(ph)
        if provider is None:
            yield ph, None, ()
            return
        if cells_prop is None:
            yield ph, provider, ()
            continue
        count = _cells(provider, cells_prop)
        if len(count) != 1:
            return
        args = tuple(cells[i : i + count[0]])
        i += count[0]
        yield ph, provider, args


def _nodes(tree: DeviceTree) -> Iterator[Node]:
    for node in tree.walk():
        if not node.path.startswith(_SKIP_TOP):
            yield node


def _dma_rules(tree: DeviceTree) -> Iterator[Hit]:
    claims: dict[tuple[str, tuple[int, ...]], list[Node]] = defaultdict(list)
    for node in _nodes(tree):
        if "dmas" not in node.properties or not _enabled(node):
            continue
        entries = list(_specifiers(tree, node, "dmas", "#dma-cells"))
        reported: set[str] = set()
        for _ph, provider, args in entries:
            if provider is None:
                continue
            if not provider.status_ok and provider.path not in reported:
                reported.add(provider.path)
                yield Hit(
                    "DT-DMA-DISABLED-CONTROLLER",
                    "fail",
                    f"{node.path} uses DMA controller {provider.path}, which is disabled "
                    "(the driver defers probe forever)",
                    node,
                    f"{provider.path} status = {provider.prop_str('status')!r}",
                    'status = "okay"',
                    f'enable {provider.path} (status = "okay") or delete `dmas`/`dma-names` '
                    f"from {node.path}; e.g. fdtput -t s FILE.dtb {provider.path} status okay",
                )
            if args and provider.status_ok:
                users = claims[(provider.path, args)]
                if node not in users:
                    users.append(node)
        names = node.prop_strings("dma-names")
        if "dma-names" not in node.properties:
            yield Hit(
                "DT-DMA-NAMES-MISMATCH",
                "warn",
                f"{node.path} has `dmas` but no `dma-names`",
                node,
                f"{len(entries)} dmas entries, no dma-names",
                f"{len(entries)} dma-names",
                f"add dma-names (one per dmas entry) to {node.path}",
            )
        elif entries and len(names) != len(entries) and _fully_parsed(tree, node):
            yield Hit(
                "DT-DMA-NAMES-MISMATCH",
                "warn",
                f"{node.path} has {len(entries)} dmas entries but {len(names)} dma-names",
                node,
                f"dma-names = {names}",
                f"{len(entries)} names",
                f"make dmas and dma-names of {node.path} the same length",
            )
    for (provider_path, args), users in claims.items():
        if len(users) < 2:
            continue
        paths = ", ".join(u.path for u in users)
        for user in users:
            yield Hit(
                "DT-DMA-SHARED-REQUEST",
                "warn",
                f"DMA request {provider_path} {list(args)} is claimed by {len(users)} enabled "
                "devices",
                user,
                f"also used by {paths}",
                "one device per request line",
                "disable all but one of these devices or give each its own request line",
            )


def _fully_parsed(tree: DeviceTree, node: Node) -> bool:
    """Whether `dmas` split cleanly (no dangling phandle, no provider without #dma-cells)."""
    cells = _cells(node, "dmas")
    used = 0
    for _ph, provider, args in _specifiers(tree, node, "dmas", "#dma-cells"):
        if provider is None:
            return False
        used += 1 + len(args)
    return used == len(cells)


def _phandle_rule(tree: DeviceTree) -> Iterator[Hit]:
    for node in _nodes(tree):
        if not _enabled(node):
            continue
        for prop in list(node.properties):
            is_ref, cells_prop = _phandle_cells(prop)
            # a gpio-hog's `gpios` are cells of its parent controller, not phandle references
            if not is_ref or (prop == "gpios" and "gpio-hog" in node.properties):
                continue
            for ph, provider, _args in _specifiers(tree, node, prop, cells_prop):
                if provider is None:
                    yield Hit(
                        "DT-PHANDLE-DANGLING",
                        "fail",
                        f"{node.path}: {prop} refers to phandle 0x{ph:x}, which is no node",
                        node,
                        f"{prop} -> 0x{ph:x} (missing)",
                        "an existing phandle",
                        f"fix {prop} of {node.path} (rebuild the dtb/overlay with the right "
                        "label) or disable the node",
                    )


def _reg_size(node: Node, parent: Node | None) -> int | None:
    """The size of a reserved-memory child: its `size`, or the sum of `reg` sizes."""
    size = node.prop("size")
    if size:
        return int.from_bytes(size, "big")
    ac = _cells(parent, "#address-cells") if parent else []
    sc = _cells(parent, "#size-cells") if parent else []
    a, s = (ac[0] if ac else 2), (sc[0] if sc else 1)
    reg = _cells(node, "reg")
    if not reg or not s or len(reg) % (a + s):
        return None
    total = 0
    for i in range(0, len(reg), a + s):
        total += int("".join(f"{c:08x}" for c in reg[i + a : i + a + s]), 16)
    return total


def _is_accel(node: Node) -> bool:
    compats = node.prop_strings("compatible")
    if any(x in c for c in compats for x in ACCEL_EXCLUDE):
        return False
    return any(k in c for c in compats for k in ACCEL_COMPATIBLES)


def _cma_rules(tree: DeviceTree) -> Iterator[Hit]:
    resmem = tree.find("/reserved-memory")
    pools = list(resmem.children) if resmem else []
    cmas = []
    for pool in pools:
        reusable = "reusable" in pool.properties
        if reusable and "no-map" in pool.properties:
            yield Hit(
                "DT-CMA-NOMAP-REUSABLE",
                "fail",
                f"{pool.path} is both `no-map` and `reusable` (the kernel refuses it as CMA)",
                pool,
                "no-map; reusable;",
                "reusable without no-map",
                f"fdtput -d FILE.dtb {pool.path} no-map",
            )
        if reusable and "shared-dma-pool" in pool.prop_strings("compatible") and pool.status_ok:
            cmas.append(pool)
    accels = [
        n for n in _nodes(tree) if "compatible" in n.properties and _is_accel(n) and _enabled(n)
    ]
    if not accels:
        return
    names = ", ".join(a.path for a in accels[:4]) + (" ..." if len(accels) > 4 else "")
    if not cmas:
        yield Hit(
            "DT-CMA-MISSING",
            "warn",
            f"no CMA pool (reserved-memory shared-dma-pool, reusable) for {names}",
            resmem or tree.root,
            "no reusable shared-dma-pool",
            f"a linux,cma pool of at least {CMA_MIN // MIB} MiB",
            'add /reserved-memory/linux,cma { compatible = "shared-dma-pool"; reusable; '
            "size = <0 0x10000000>; linux,cma-default; } or boot with cma=256M",
        )
        return
    for pool in cmas:
        size = _reg_size(pool, resmem)
        if size is not None and size < CMA_MIN:
            yield Hit(
                "DT-CMA-SMALL",
                "fail",
                f"CMA pool {pool.path} is {size // MIB} MiB, too small for {names}",
                pool,
                f"{size} bytes ({size / MIB:.1f} MiB)",
                f">= {CMA_MIN // MIB} MiB",
                f"raise `size` of {pool.path} to at least "
                f"{CMA_MIN // MIB} MiB (e.g. <0 0x10000000>) or boot with cma=256M",
            )


def _addr_cells(parent: Node | None) -> tuple[int, int]:
    """(#address-cells, #size-cells) that `parent` gives its children (spec defaults 2, 1)."""
    ac = _cells(parent, "#address-cells") if parent else []
    sc = _cells(parent, "#size-cells") if parent else []
    return (ac[0] if len(ac) == 1 else 2), (sc[0] if len(sc) == 1 else 1)


def _num(cells: list[int]) -> int:
    return int("".join(f"{c:08x}" for c in cells) or "0", 16)


def _ranges(node: Node, prop: str, parent: Node | None) -> list[tuple[int, int]]:
    """(base, size) pairs of a reg-style property in `parent`'s cells ([] if unparsable)."""
    a, s = _addr_cells(parent)
    cells = _cells(node, prop)
    if not cells or not a or not s or len(cells) % (a + s):
        return []
    return [
        (_num(cells[i : i + a]), _num(cells[i + a : i + a + s]))
        for i in range(0, len(cells), a + s)
    ]


def _default_cmas(tree: DeviceTree) -> list[Node]:
    """shared-dma-pool nodes meant as the default CMA (`linux,cma-default` or named linux,cma)."""
    resmem = tree.find("/reserved-memory")
    return [
        n
        for n in (resmem.children if resmem else [])
        if "shared-dma-pool" in n.prop_strings("compatible")
        and n.status_ok
        and ("linux,cma-default" in n.properties or n.base_name == "linux,cma")
    ]


def _memory(tree: DeviceTree) -> list[tuple[int, int]]:
    """RAM from the /memory nodes; sizes of 0 (filled in by the bootloader) are left out."""
    out: list[tuple[int, int]] = []
    for node in tree.root.children:
        if node.prop_str("device_type") == "memory" or node.base_name == "memory":
            out.extend(r for r in _ranges(node, "reg", tree.root) if r[1])
    return out


def _cma_extra_rules(tree: DeviceTree) -> Iterator[Hit]:
    resmem = tree.find("/reserved-memory")
    memory = _memory(tree)
    for pool in _default_cmas(tree):
        if "reusable" not in pool.properties:
            yield Hit(
                "DT-CMA-NOT-REUSABLE",
                "warn",
                f"default CMA pool {pool.path} is not `reusable`: the kernel does not use it "
                "as CMA (a plain carve-out, lost to the page allocator)",
                pool,
                "no `reusable`",
                "reusable;",
                f"fdtput FILE.dtb {pool.path} reusable",
            )
        checks = [
            (prop, _num(_cells(pool, prop))) for prop in ("size", "alignment") if pool.prop(prop)
        ]
        for base, size in _ranges(pool, "reg", resmem):
            checks += [("reg base", base), ("reg size", size)]
        bad = [(what, v) for what, v in checks if v % CMA_ALIGN]
        if bad:
            shown = ", ".join(f"{what} 0x{v:x}" for what, v in bad)
            yield Hit(
                "DT-CMA-MISALIGNED",
                "warn",
                f"CMA pool {pool.path}: {shown} not a multiple of 4 MiB (the CMA alignment of "
                "arm64 with 4K pages; the kernel refuses an unaligned pool)",
                pool,
                shown,
                "multiples of 0x400000 (4 MiB)",
                f"round {', '.join(w for w, _ in bad)} of {pool.path} to 4 MiB "
                "(e.g. alignment = <0 0x400000>)",
            )
        if not memory:
            continue
        for prop in ("reg", "alloc-ranges"):
            for base, size in _ranges(pool, prop, resmem):
                # `reg` must lie inside RAM; `alloc-ranges` only bounds where the kernel may
                # place the pool, so it is broken only when it misses RAM entirely.
                if prop == "reg" and any(m <= base and base + size <= m + ms for m, ms in memory):
                    continue
                if prop != "reg" and any(base < m + ms and m < base + size for m, ms in memory):
                    continue
                yield Hit(
                    "DT-CMA-OUTSIDE-MEMORY",
                    "fail",
                    f"CMA pool {pool.path}: {prop} 0x{base:x}+0x{size:x} is outside every "
                    "/memory range (the pool cannot be set up)",
                    pool,
                    f"{prop} 0x{base:x}..0x{base + size:x}",
                    "inside " + ", ".join(f"0x{m:x}..0x{m + ms:x}" for m, ms in memory),
                    f"move {prop} of {pool.path} inside RAM or drop it and let the kernel place "
                    "the pool",
                )


def _dma_ranges_entries(bus: Node) -> list[tuple[int, int, int]]:
    """(child bus address, parent bus address, size) per entry of a non-empty `dma-ranges`:
    child addresses in the bus's own #address-cells, parent ones in its parent's ([] when the
    cells do not add up)."""
    child_cells, size_cells = _addr_cells(bus)
    parent_cells, _ = _addr_cells(bus.parent)
    width = child_cells + parent_cells + size_cells
    cells = _cells(bus, "dma-ranges")
    if not cells or not size_cells or len(cells) % width:
        return []
    return [
        (
            _num(cells[i : i + child_cells]),
            _num(cells[i + child_cells : i + child_cells + parent_cells]),
            _num(cells[i + child_cells + parent_cells : i + width]),
        )
        for i in range(0, len(cells), width)
    ]


def _dma_window(node: Node) -> list[tuple[int, int]] | None:
    """The CPU-physical (base, size) ranges `node` can reach by DMA, from the `dma-ranges` of
    its buses up to the root; None when nothing limits it.

    Per the DT spec a bus without `dma-ranges` gives no DMA translation information, so the
    walk ends there (the kernel's of_dma_get_range likewise uses no window then, and the
    device keeps its driver's own mask), and `dma-ranges;` (empty) is 1:1. Each non-empty
    one maps the window found so far (in its child address space) into its parent's, keeping
    only what its entries cover. The walk is cycle-safe (`_ancestors`)."""
    window: list[tuple[int, int]] | None = None  # None: identity, unlimited
    for bus in list(_ancestors(node))[1:]:
        if bus.parent is None:  # the root's address space is the CPU's
            break
        raw = bus.prop("dma-ranges")
        if raw is None:
            break
        if not raw:
            continue
        entries = _dma_ranges_entries(bus)
        if not entries:
            break  # unparsable: claim no limit rather than a wrong one
        mapped = []
        for child, parent, size in entries:
            if window is None:
                mapped.append((parent, size))
                continue
            for base, length in window:
                low, high = max(base, child), min(base + length, child + size)
                if low < high:
                    mapped.append((parent + low - child, high - low))
        window = mapped
    return window


def _uses_cma(node: Node) -> bool:
    """Devices that allocate big contiguous buffers: accelerators and display controllers."""
    if _is_accel(node):
        return True
    compats = node.prop_strings("compatible")
    if any(x in c for c in compats for x in ACCEL_EXCLUDE + DISPLAY_EXCLUDE):
        return False
    return any(k in c for c in compats for k in DISPLAY_COMPATIBLES)


def _pool_spans(
    pool: Node, resmem: Node | None, memory: list[tuple[int, int]]
) -> tuple[str, list[tuple[int, int]]]:
    """Where the pool is or may be placed: ("reg", its ranges) when fixed, else
    ("alloc-ranges", those ranges cut to RAM when /memory is known); ("", []) when the kernel
    places it freely."""
    reg = _ranges(pool, "reg", resmem)
    if reg:
        return "reg", reg
    spans = _ranges(pool, "alloc-ranges", resmem)
    if spans and memory:
        spans = [
            (max(b, m), min(b + s, m + ms) - max(b, m))
            for b, s in spans
            for m, ms in memory
            if max(b, m) < min(b + s, m + ms)
        ] or spans
    return ("alloc-ranges", spans) if spans else ("", [])


def _outside(spans: list[tuple[int, int]], window: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `spans` that no range of `window` covers."""
    left = list(spans)
    for w_base, w_size in window:
        rest = []
        for base, size in left:
            if base < w_base:
                rest.append((base, min(size, w_base - base)))
            if base + size > w_base + w_size:
                start = max(base, w_base + w_size)
                rest.append((start, base + size - start))
        left = rest
    return left


def _cma_window_rule(tree: DeviceTree) -> Iterator[Hit]:
    """DT-CMA-OUTSIDE-DMA-WINDOW: a CMA pool a device cannot reach.

    A device allocates from the pool its `memory-region` names (a shared-dma-pool), else
    from the default CMA pool. dma-direct hands out a CMA page only if it lies below the
    device's DMA limit; otherwise it falls back to ordinary pages, where large contiguous
    buffers (an NPU's or a display's) fail. Devices behind an IOMMU (`iommus`) are skipped:
    there the IOMMU maps any physical page. `reg` wholly outside the window fails; a pool
    whose `alloc-ranges` (cut to RAM) reach outside it may land there (warn)."""
    resmem = tree.find("/reserved-memory")
    if resmem is None:
        return
    memory = _memory(tree)
    defaults = [n for n in _default_cmas(tree) if "reusable" in n.properties]
    reported: set[tuple[str, str]] = set()
    for node in _nodes(tree):
        if "compatible" not in node.properties or "iommus" in node.properties:
            continue
        if not _uses_cma(node) or not _enabled(node):
            continue
        window = _dma_window(node)
        if window is None:
            continue
        named = [
            p
            for _ph, p, _a in _specifiers(tree, node, "memory-region", None)
            if p is not None
            and p.parent is resmem
            and "shared-dma-pool" in p.prop_strings("compatible")
            and p.status_ok
        ]
        for pool in named or defaults:
            prop, spans = _pool_spans(pool, resmem, memory)
            outside = _outside(spans, window)
            if not outside or (node.path, pool.path) in reported:
                continue
            reported.add((node.path, pool.path))
            whole = sum(s for _b, s in outside) == sum(s for _b, s in spans)
            fixed = prop == "reg"
            shown = ", ".join(f"0x{b:x}..0x{b + s:x}" for b, s in spans)
            reach = ", ".join(f"0x{b:x}..0x{b + s:x}" for b, s in window) or "nothing"
            verb = "lies" if fixed and whole else "lies partly" if fixed else "may be placed"
            yield Hit(
                "DT-CMA-OUTSIDE-DMA-WINDOW",
                "fail" if fixed and whole else "warn",
                f"CMA pool {pool.path} {verb} outside the DMA window of {node.path} (its "
                "buses' dma-ranges): its contiguous buffers cannot come from that pool",
                pool,
                f"{prop} {shown}",
                f"inside {reach}",
                f"place {pool.path} inside {reach} (alloc-ranges = <the window>, or a `reg` "
                f"there), or give {node.path} a memory-region pool it can reach",
            )


def _reserved_rule(tree: DeviceTree) -> Iterator[Hit]:
    resmem = tree.find("/reserved-memory")
    if resmem is None:
        return
    users: dict[str, list[Node]] = defaultdict(list)
    for node in _nodes(tree):
        for _ph, region, _args in _specifiers(tree, node, "memory-region", None):
            if region is not None and region.parent is resmem and node not in users[region.path]:
                users[region.path].append(node)
    for region in resmem.children:
        refs = users.get(region.path, [])
        if not refs or any(_enabled(u) for u in refs) or not region.status_ok:
            continue
        sizes = [s for _b, s in _ranges(region, "reg", resmem)]
        size = _num(_cells(region, "size")) if "size" in region.properties else sum(sizes)
        yield Hit(
            "DT-RESERVED-FOR-DISABLED",
            "warn",  # status; severity stays info
            f"{region.path} ({size / MIB:.1f} MiB) is reserved only for disabled device(s) "
            f"{', '.join(u.path for u in refs)}",
            region,
            "memory-region users all disabled",
            "an enabled user or no region",
            f"disable the region too (fdtput -t s FILE.dtb {region.path} status disabled) or "
            "enable its device",
        )


def _dma_ranges_rule(tree: DeviceTree) -> Iterator[Hit]:
    """An empty `dma-ranges;` (1:1 pass-through) below a bus without `dma-ranges`.

    Kept simple and on the kernel's own terms: of_dma_get_range() walks up from a device's
    bus; empty `dma-ranges` are passed through, the first non-empty one ends the walk, and
    "once we find 'dma-ranges', then a missing one is an error" (-ENODEV): the device then
    gets no DMA window from the tree (default mask, no offset). So a bus that declares
    `dma-ranges;` under a non-root bus lacking the property has a broken chain. Buses with
    non-empty `dma-ranges` are not flagged (the kernel stops there). Only the nearest
    offending bus is reported; the walk is cycle-safe (`_ancestors`).
    """
    for node in _nodes(tree):
        value = node.prop("dma-ranges")
        if value is None or value or not _enabled(node):
            continue
        for up in list(_ancestors(node))[1:]:
            if up.parent is None:  # the root needs none
                break
            ranges = up.prop("dma-ranges")
            if ranges:  # a real mapping: the kernel's walk ends here
                break
            if ranges is None:
                yield Hit(
                    "DT-DMA-RANGES-BROKEN",
                    "warn",
                    f"{node.path} has `dma-ranges;` but its parent bus {up.path} has none: the "
                    "DMA translation chain is broken (of_dma_get_range: -ENODEV)",
                    node,
                    f"{up.path}: no dma-ranges",
                    "dma-ranges on every bus up to /",
                    f"add `dma-ranges;` (1:1) or the real mapping to {up.path}",
                )
                break


def _family(node: Node) -> str | None:
    compats = node.prop_strings("compatible")
    if not compats:
        return None
    first = compats[0].lower()
    for family, keys in PIO_FAMILIES:
        if any(k in first for k in keys):
            return family
    return None


def _pio_rule(tree: DeviceTree) -> Iterator[Hit]:
    groups: dict[str, list[Node]] = defaultdict(list)
    for node in _nodes(tree):
        if _family(node) and _enabled(node):
            groups[node.prop_strings("compatible")[0]].append(node)
    for compat, nodes in groups.items():
        with_dma = [n for n in nodes if "dmas" in n.properties]
        if not with_dma:
            continue
        for node in nodes:
            if "dmas" in node.properties:
                continue
            yield Hit(
                "DT-DMA-PIO-FALLBACK",
                "warn",  # status; severity stays info
                f"{node.path} ({compat}) has no `dmas` while {len(with_dma)} enabled sibling(s) "
                "do: it falls back to PIO (CPU time per byte)",
                node,
                "no dmas",
                f"dmas like {with_dma[0].path}",
                f"add dmas/dma-names to {node.path} if its DMA controller has free requests",
            )


# Every rule, in the order their hits are reported.
RULE_FUNCTIONS = (
    _dma_rules,
    _phandle_rule,
    _cma_rules,
    _cma_extra_rules,
    _cma_window_rule,
    _reserved_rule,
    _dma_ranges_rule,
    _pio_rule,
)


def find_hits(tree: DeviceTree) -> list[Hit]:
    """What every rule finds in one tree."""
    return [hit for rule in RULE_FUNCTIONS for hit in rule(tree)]
