"""DT: the device-tree rules of `sysconf.dtcheck` over every tree the audit is given (--dtb),
else the live tree.

One registered check for all the rules, rather than one per rule, because they share the
parsed tree, and each tree's report ends with one `pass` per rule that found nothing there.
Subjects are node paths; evidence paths are "<source>:<node path>".
"""

from __future__ import annotations

from collections.abc import Iterator

from sysconf.audit.findings import AuditContext, Catalogue, Evidence, Finding, Rule, register
from sysconf.dtcheck import CMA_MIN, MIB, find_hits
from sysconf.fdt import DeviceTree, read_tree_dir

LIVE_TREE = "/sys/firmware/devicetree/base"

# The rules of sysconf.dtcheck, each with the title of the `pass` it gives when it finds
# nothing; a tree's passes come in this order.
RULES = {
    "DT-DMA-DISABLED-CONTROLLER": Rule("fail", "no enabled device uses a disabled DMA controller"),
    "DT-DMA-NAMES-MISMATCH": Rule("warn", "every `dmas` has a matching `dma-names`"),
    "DT-PHANDLE-DANGLING": Rule("fail", "every phandle resolves to a node"),
    "DT-DMA-SHARED-REQUEST": Rule("warn", "no DMA request line is claimed by two enabled devices"),
    "DT-CMA-MISSING": Rule("warn", "a CMA pool exists for the enabled accelerators"),
    "DT-CMA-SMALL": Rule("fail", f"the CMA pool is at least {CMA_MIN // MIB} MiB"),
    "DT-CMA-NOMAP-REUSABLE": Rule(
        "fail", "no reserved-memory node is both `no-map` and `reusable`"
    ),
    "DT-DMA-PIO-FALLBACK": Rule("info", "UART/SPI/I2S/SAI instances use DMA like their siblings"),
    "DT-CMA-NOT-REUSABLE": Rule("warn", "the default CMA pool is `reusable`"),
    "DT-CMA-MISALIGNED": Rule("warn", "default CMA pools are aligned to 4 MiB (arm64, 4K pages)"),
    "DT-CMA-OUTSIDE-MEMORY": Rule("fail", "CMA `reg`/`alloc-ranges` lie inside a /memory node"),
    "DT-RESERVED-FOR-DISABLED": Rule("info", "reserved memory is used by an enabled device"),
    "DT-DMA-RANGES-BROKEN": Rule("warn", "no empty `dma-ranges` sits below a bus without them"),
    "DT-CMA-OUTSIDE-DMA-WINDOW": Rule(
        "fail", "CMA pools lie inside the DMA window of the devices that allocate from them"
    ),
}
CATALOGUE = Catalogue(
    prefix="DT",
    sections={"DT": 50},
    rules={
        **RULES,
        "DT-NO-TREE": Rule("info", "a device tree to check"),
    },
)


def check_tree(tree: DeviceTree, source: str) -> list[Finding]:
    """All device-tree rules over one tree, plus one `pass` per rule that found nothing."""
    found = [
        CATALOGUE.finding(
            hit.rule,
            hit.status,
            hit.title,
            evidence=(Evidence(f"{source}:{hit.node.path}", hit.observed, hit.expected),),
            remedy=hit.remedy,
            subject=hit.node.path,
        )
        for hit in find_hits(tree)
    ]
    fired = {f.id for f in found}
    found += [
        CATALOGUE.finding(
            rule_id, "pass", evidence=(Evidence(f"{source}:/", "nothing found", rule.title),)
        )
        for rule_id, rule in RULES.items()
        if rule_id not in fired
    ]
    return found


@register("devicetree", CATALOGUE, order=10)
def devicetree_check(ctx: AuditContext) -> Iterator[Finding]:
    trees = list(ctx.dtbs)
    if not trees and ctx.root.path(LIVE_TREE).is_dir():
        trees = [(LIVE_TREE, read_tree_dir(ctx.root.path(LIVE_TREE), source=LIVE_TREE))]
    if not trees:
        yield CATALOGUE.finding(
            "DT-NO-TREE",
            "skip",
            "no device tree",
            remedy=f"pass --dtb FILE (or audit a system with {LIVE_TREE})",
        )
        return
    for source, tree in trees:
        yield from check_tree(tree, source)
