"""Fixture roots: folders that hold the same relative paths as a live system (proc/interrupts,
proc/irq/N/..., sys/devices/system/cpu/..., etc/...), for everything that reads or writes
through a SysRoot.

- `snapshot_live`: a copy of this machine's IRQ and CPU files (read only, never written).
- `board_root`: a synthetic 4-8 core board in the kernel's own formats: an ARM GICv3 SoC
  modelled on Rockchip RK3568/RK3588 boards running a mainline kernel (arch_timer PPI, IPI0-6,
  dw-mmc/sdhci, 8250 UART, stmmac ethernet, xHCI/EHCI/OHCI, NPU, Mali, GPIO card detect,
  NVMe on GIC-ITS MSI-X with one managed queue per CPU), or an x86 industrial PC (IO-APIC,
  IR-PCI-MSI, igc, NVMe, the named x86 rows).
- `tree_state`: every file of a root with its bytes and mode, to prove a revert exact.

Rows are printed with the kernel's printf widths (kernel/irq/proc.c show_interrupts,
arch_show_interrupts), so parsers see the spacing real boards print.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sysconf.cpulist import format_cpulist, format_cpumask

JOURNAL_DIR = "var/lib/edged"

# -- snapshot of this machine ------------------------------------------------------------------

LIVE_FILES = (
    "/proc/interrupts",
    "/proc/softirqs",
    "/proc/cmdline",
    "/proc/irq/default_smp_affinity",
    "/sys/devices/system/cpu/online",
    "/sys/devices/system/cpu/possible",
    "/sys/devices/system/cpu/present",
    "/sys/devices/system/cpu/isolated",
    "/sys/devices/system/cpu/nohz_full",
    "/etc/default/irqbalance",
    "/etc/sysconfig/irqbalance",
)
LIVE_IRQ_FILES = ("smp_affinity_list", "effective_affinity_list")


def snapshot_live(dest: Path) -> Path:
    """A root mirroring this machine's IRQ and CPU files. Only reads the live system. File
    modes are kept: a read-only smp_affinity_list is how the kernel marks an IRQ that user
    space cannot move. Unreadable or absent files are left out, as they are absent there."""
    dest = Path(dest)
    paths = list(LIVE_FILES)
    for irq in sorted(os.listdir("/proc/irq"), key=lambda n: (not n.isdigit(), n.zfill(8))):
        if irq.isdigit():
            paths += [f"/proc/irq/{irq}/{name}" for name in LIVE_IRQ_FILES]
            paths.append(f"/sys/kernel/debug/irq/irqs/{irq}")  # only when debugfs is mounted
    for path in paths:
        _copy_live(path, dest)
    return dest


def _copy_live(path: str, dest: Path) -> None:
    try:
        data = Path(path).read_bytes()
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        return
    target = dest / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    os.chmod(target, mode)


# -- synthetic boards -------------------------------------------------------------------------


@dataclass
class BoardIrq:
    irq: int
    chip: str
    hwirq: str
    trigger: str
    action: str
    counts: list[int]
    affinity: str | None  # None: no /proc/irq/N/smp_affinity_list
    effective: str | None
    per_cpu: bool = False
    managed: bool = False
    settable: bool = True  # False: the chip cannot route it (chained GPIO)
    device: str = ""

    @property
    def read_only(self) -> bool:
        return self.per_cpu or self.managed or not self.settable


@dataclass
class Board:
    cpus: int
    arm: bool
    irqs: list[BoardIrq] = field(default_factory=list)
    # Named rows in print order: (key, counts, text); a global counter (ERR:, MIS:, Err:)
    # has one count and no text.
    named: list[tuple[str, list[int], str]] = field(default_factory=list)

    def by_action(self, action: str) -> BoardIrq:
        return next(i for i in self.irqs if i.action == action)

    @property
    def nvme_queues(self) -> list[int]:
        """IRQ numbers of the managed NVMe I/O queues (nvme0q1..)."""
        return [i.irq for i in self.irqs if i.managed]


def board(cpus: int = 4, arm: bool = True, seed: int = 1) -> Board:
    """The IRQ layout `board_root` writes, for tests that need to know IRQ numbers."""
    if not 2 <= cpus <= 64:
        raise ValueError(f"a board has 2-64 CPUs, not {cpus}")
    rng = random.Random(seed * 100 + cpus)
    return _arm_board(cpus, rng) if arm else _x86_board(cpus, rng)


def grown_board(cpus: int, rows: int) -> Board:
    """`board(cpus)` with more GPIO/MSI rows, up to `rows`, as real boards have (an RK3588's
    /proc/interrupts has hundreds): for the sampler's read cost."""
    b = board(cpus)
    while len(b.irqs) < rows:
        extra = b.irqs[len(b.irqs) % 20]
        b.irqs.append(
            type(extra)(
                1000 + len(b.irqs),
                extra.chip,
                extra.hwirq,
                extra.trigger,
                f"gpio-{len(b.irqs)}",
                list(extra.counts),
                extra.affinity,
                extra.effective,
            )
        )
    return b


def _all(cpus: int) -> str:
    return format_cpulist(range(cpus))


def _on(cpus: int, cpu: int, total: int) -> list[int]:
    return [total if c == cpu else 0 for c in range(cpus)]


def _spread(cpus: int, rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(cpus)]


def _arm_board(cpus: int, rng: random.Random) -> Board:
    n, last = cpus, cpus - 1
    b = Board(cpus, True)

    def spi(
        irq: int, hw: int, action: str, total: int, affinity: str | None = None, cpu: int = 0, **kw
    ) -> None:
        # GICv3 routes an SPI to one CPU (its effective affinity), CPU 0 unless moved.
        b.irqs.append(
            BoardIrq(
                irq,
                "GICv3",
                str(hw),
                "Level",
                action,
                _on(n, cpu, total),
                affinity or _all(n),
                str(cpu),
                **kw,
            )
        )

    # PPIs: per-CPU by nature (hwirq 16-31); the kernel shows every CPU as their affinity.
    b.irqs.append(
        BoardIrq(
            11,
            "GICv3",
            "27",
            "Level",
            "arch_timer",
            _spread(n, rng, 150_000, 420_000),
            _all(n),
            _all(n),
            per_cpu=True,
        )
    )
    b.irqs.append(
        BoardIrq(12, "GICv3", "25", "Level", "vgic", [0] * n, _all(n), _all(n), per_cpu=True)
    )
    b.irqs.append(
        BoardIrq(
            13,
            "GICv3",
            "23",
            "Level",
            "arm-pmu",
            _spread(n, rng, 0, 40),
            _all(n),
            _all(n),
            per_cpu=True,
        )
    )
    spi(14, 321, "rk_timer", 0)
    spi(19, 129, "fe2b0000.mmc", 0)  # SDIO (Wi-Fi module absent)
    spi(20, 130, "fe2c0000.mmc", 4_213)  # SD card (dw-mmc)
    spi(21, 237, "mmc0", 187_554)  # eMMC (sdhci-of-dwcmshc)
    spi(23, 365, "ttyS2", 1_893)  # debug UART, 1500000n8
    spi(24, 347, "fd880000.i2c", 12_044)  # PMIC/regulators
    spi(25, 259, "eth0", 96_412, affinity=format_cpulist(range(min(2, n - 1))))  # stmmac
    spi(26, 252, "xhci-hcd:usb1", 33_870, affinity=f"{last - 1}-{last}", cpu=last)
    spi(27, 247, "ehci_hcd:usb3", 0)
    spi(28, 248, "ohci_hcd:usb4", 0)
    spi(29, 142, "fdab0000.npu", 61_208, affinity=str(last), cpu=last)  # pinned there
    spi(30, 124, "panfrost-job", 5_120)
    spi(31, 125, "panfrost-mmu", 311)
    spi(32, 126, "panfrost-gpu", 44)
    spi(35, 429, "fec00000.tsadc", 2_117)
    spi(36, 326, "rockchip_thermal", 0)
    # Chained GPIO: the rockchip GPIO irqchip has no irq_set_affinity, so the kernel makes the
    # file read-only; such an IRQ runs wherever its parent SPI runs.
    b.irqs.append(
        BoardIrq(
            77,
            "rockchip_gpio_irq",
            "5",
            "Edge",
            "fe2c0000.mmc cd",
            _on(n, 0, 3),
            _all(n),
            _all(n),
            settable=False,
        )
    )
    b.irqs.append(
        BoardIrq(
            78,
            "rockchip_gpio_irq",
            "6",
            "Level",
            "rk806",
            _on(n, 0, 9),
            _all(n),
            _all(n),
            settable=False,
        )
    )
    # NVMe on PCIe: admin queue (movable) and one managed I/O queue per CPU.
    chip = "ITS-PCI-MSIX-0004:41:00.0"
    b.irqs.append(
        BoardIrq(
            96, chip, "0", "Edge", "nvme0q0", _on(n, 0, 61), _all(n), "0", device="0004:41:00.0"
        )
    )
    for q in range(1, n + 1):
        b.irqs.append(
            BoardIrq(
                96 + q,
                chip,
                str(q),
                "Edge",
                f"nvme0q{q}",
                _on(n, q - 1, rng.randint(3_000, 90_000)),
                str(q - 1),
                str(q - 1),
                managed=True,
                device="0004:41:00.0",
            )
        )
    ipis = (
        "Rescheduling interrupts",
        "Function call interrupts",
        "CPU stop interrupts",
        "CPU stop (for crash dump) interrupts",
        "Timer broadcast interrupts",
        "IRQ work interrupts",
        "CPU wake-up interrupts",
    )
    for index, text in enumerate(ipis):
        counts = _spread(n, rng, 2_000, 60_000) if index in (0, 1, 5) else [0] * n
        b.named.append((f"IPI{index}", counts, text))
    b.named.append(("Err", [0], ""))
    return b


def _x86_board(cpus: int, rng: random.Random) -> Board:
    n, last = cpus, cpus - 1
    b = Board(cpus, False)

    def irq(
        number: int,
        chip: str,
        hw: str,
        trig: str,
        action: str,
        total: int,
        cpu: int = 0,
        affinity: str | None = None,
        **kw,
    ) -> None:
        b.irqs.append(
            BoardIrq(
                number,
                chip,
                hw,
                trig,
                action,
                _on(n, cpu, total),
                affinity or _all(n),
                str(cpu),
                **kw,
            )
        )

    irq(0, "IO-APIC", "2", "edge", "timer", 27)
    irq(8, "IO-APIC", "8", "edge", "rtc0", 0)
    irq(9, "IO-APIC", "9", "fasteoi", "acpi", 0)
    irq(14, "IO-APIC", "14", "fasteoi", "INTC1020:00", 0)
    irq(16, "IO-APIC", "16", "fasteoi", "i801_smbus", 0)
    irq(120, "DMAR-MSI", "0", "edge", "dmar0", 0)
    irq(121, "IR-PCI-MSI", "327680", "edge", "xhci_hcd", 48_311, cpu=last)
    irq(122, "IR-PCI-MSI", "376832", "edge", "ahci[0000:00:17.0]", 21_006, cpu=1 % n)
    nic = "IR-PCI-MSIX-0000:01:00.0"
    irq(123, nic, "0", "edge", "enp1s0", 12, affinity="0", cpu=0)
    for q in range(min(4, n)):
        irq(
            124 + q, nic, str(q + 1), "edge", f"enp1s0-TxRx-{q}", rng.randint(10_000, 90_000), cpu=q
        )
    nvme = "IR-PCI-MSIX-0000:02:00.0"
    irq(130, nvme, "0", "edge", "nvme0q0", 44, device="0000:02:00.0")
    for q in range(1, n + 1):
        irq(
            130 + q,
            nvme,
            str(q),
            "edge",
            f"nvme0q{q}",
            rng.randint(3_000, 90_000),
            cpu=q - 1,
            affinity=str(q - 1),
            managed=True,
            device="0000:02:00.0",
        )
    irq(140, "IR-PCI-MSI", "32768", "edge", "i915", 8_802, cpu=last)
    for key, low, high, text in (
        ("NMI", 0, 3, "Non-maskable interrupts"),
        ("LOC", 120_000, 600_000, "Local timer interrupts"),
        ("SPU", 0, 0, "Spurious interrupts"),
        ("PMI", 0, 3, "Performance monitoring interrupts"),
        ("IWI", 0, 90, "IRQ work interrupts"),
        ("RTR", 0, 0, "APIC ICR read retries"),
        ("RES", 5_000, 90_000, "Rescheduling interrupts"),
        ("CAL", 10_000, 200_000, "Function call interrupts"),
        ("TLB", 1_000, 50_000, "TLB shootdowns"),
        ("TRM", 0, 0, "Thermal event interrupts"),
        ("THR", 0, 0, "Threshold APIC interrupts"),
        ("DFR", 0, 0, "Deferred Error APIC interrupts"),
        ("MCE", 0, 0, "Machine check exceptions"),
        ("MCP", 8, 30, "Machine check polls"),
    ):
        b.named.append((key, _spread(n, rng, low, high), text))
    b.named += [("ERR", [0], ""), ("MIS", [0], "")]
    for key, text in (
        ("PIN", "Posted-interrupt notification event"),
        ("NPI", "Nested posted-interrupt event"),
        ("PIW", "Posted-interrupt wakeup event"),
    ):
        b.named.append((key, [0] * n, text))
    return b


def format_interrupts(b: Board) -> str:
    """/proc/interrupts as the kernel prints it (show_interrupts / arch_show_interrupts)."""
    prec = 3 if max((i.irq for i in b.irqs), default=0) < 1000 else 4
    out = [" " * (prec + 8) + "".join(f"CPU{c:<8d}" for c in range(b.cpus))]

    def counts(values: Iterable[int]) -> str:
        return "".join(f"{v:10d} " for v in values)

    for i in sorted(b.irqs, key=lambda i: i.irq):
        row = f"{i.irq:>{prec}}: {counts(i.counts)} {i.chip:>8} {i.hwirq:>{prec}}"
        row += f" {i.trigger:<8}" if b.arm else f"-{i.trigger:<8}"
        out.append(f"{row}  {i.action}")
    for key, values, text in b.named:
        if len(values) == 1 and not text:
            out.append(f"{key:>{prec}}: {values[0]:10d}")
        elif b.arm:  # arm64: "%*s%u:%s" for IPIs, then six spaces before the name
            out.append(f"{'IPI':>{prec - 1}}{key[3:]}:{counts(values)}      {text}")
        else:
            out.append(f"{key:>{prec}}: {counts(values)}  {text}")
    return "\n".join(out) + "\n"


SOFTIRQS = (
    "HI",
    "TIMER",
    "NET_TX",
    "NET_RX",
    "BLOCK",
    "IRQ_POLL",
    "TASKLET",
    "SCHED",
    "HRTIMER",
    "RCU",
)


def format_softirqs(cpus: int, rng: random.Random) -> str:
    """/proc/softirqs (kernel/softirq.c show_softirqs: "%12s:" then " %10u" per CPU)."""
    lines = [" " * 20 + "".join(f"CPU{c:<8d}" for c in range(cpus))]
    scale = {"HI": 0, "NET_TX": 50, "IRQ_POLL": 0, "TASKLET": 500, "HRTIMER": 3_000}
    for name in SOFTIRQS:
        top = scale.get(name, 200_000)
        lines.append(f"{name:>12}:" + "".join(f" {rng.randint(0, top):10d}" for _ in range(cpus)))
    return "\n".join(lines) + "\n"


def debugfs_irq(i: BoardIrq, arm: bool) -> str:
    """/sys/kernel/debug/irq/irqs/N (kernel/irq/debugfs.c irq_debug_show)."""
    flags = ["IRQD_ACTIVATED", "IRQD_IRQ_STARTED"]
    if i.trigger in ("Level", "fasteoi"):
        flags.append("IRQD_LEVEL")
    if i.per_cpu:
        flags += ["IRQD_PER_CPU"]
    else:
        flags += (
            ["IRQD_SINGLE_TARGET", "IRQD_AFFINITY_SET"] if not i.managed else ["IRQD_SINGLE_TARGET"]
        )
    if i.managed:
        flags += ["IRQD_AFFINITY_MANAGED", "IRQD_AFFINITY_ON_ACTIVATE", "IRQD_CAN_RESERVE"]
    handler = (
        "handle_percpu_devid_irq"
        if i.per_cpu
        else ("handle_fasteoi_irq" if arm else "handle_edge_irq")
    )
    lines = [
        f"handler:  {handler}",
        f"device:   {i.device}",
        f"status:   0x{0x00031600 if i.per_cpu else 0x00004000:08x}",
        "istate:   0x00000000",
        "ddepth:   0",
        "wdepth:   0",
        f"dstate:   0x{0x3540_1200 if i.managed else 0x1040_2200:08x}",
        *(f"            {flag}" for flag in flags),
        "node:     0",
        f"affinity: {i.affinity or ''}",
        f"effectiv: {i.effective or ''}",
        f"domain:  {i.chip}",
        f" hwirq:   0x{int(i.hwirq or 0):x}",
        f" chip:    {i.chip}",
        "  flags:   0x10",
    ]
    return "\n".join(lines) + "\n"


DEBIAN_IRQBALANCE = """\
# irqbalance is a daemon process that distributes interrupts across
# CPUs on SMP systems.  The default is to rebalance once every 10
# seconds.  This is the environment file that is specified to systemd via the
# EnvironmentFile key in the service unit file (or via whatever method the init
# system you're using has).
#
# ONESHOT=yes
#	after starting, wait for ten seconds, then look at the interrupt
#	load and balance it once; after balancing exit and do not change
#	it again.
#IRQBALANCE_ONESHOT=

#
# IRQBALANCE_BANNED_CPUS
# 64 bit bitmask which allows you to indicate which CPUs should
# be skipped when reblancing IRQs.  CPU numbers which have their
# corresponding bits set to one in this mask will not have any
# IRQs assigned to them on rebalance.
#
#IRQBALANCE_BANNED_CPUS=

#
# IRQBALANCE_BANNED_CPULIST
# The CPUs list which allows you to indicate which CPUs should
# be skipped when reblancing IRQs. CPUs which are in this list
# will not have any IRQs assigned to them on rebalance.
#
#      The format of CPUs list is:
#        <cpu number>,...,<cpu number>
#      or a range:
#        <cpu number>-<cpu number>
#      or a mixture:
#        <cpu number>,...,<cpu number>-<cpu number>
#
#IRQBALANCE_BANNED_CPULIST=

#
# IRQBALANCE_ARGS
# Append any args here to the irqbalance daemon as documented in the man
# page.
#
#IRQBALANCE_ARGS=
"""

RHEL_IRQBALANCE = """\
# irqbalance is a daemon process that distributes interrupts across
# CPUs on SMP systems.  The default is to rebalance once every 10
# seconds.
#
# IRQBALANCE_BANNED_CPULIST
# The CPUs list which allows you to indicate which CPUs should be
# skipped when reblancing IRQs.
#
#IRQBALANCE_BANNED_CPULIST=

#
# IRQBALANCE_ARGS
# append any args here to the irqbalance daemon as documented in the man page
#
IRQBALANCE_ARGS=
"""


def board_root(
    dest: Path,
    cpus: int = 4,
    arm: bool = True,
    isolated: str = "",
    cmdline: str | None = None,
    managed: Sequence[int] = (),
    irqbalance: str | None = "debian",
    readonly_modes: bool = True,
    seed: int = 1,
) -> Path:
    """Write a board's /proc, /sys and /etc files under `dest` and return it.

    `isolated`: the kernel's isolated (and nohz_full) CPU list; with the default `cmdline`
    it is also on the command line as `isolcpus=managed_irq,domain,...`.
    `managed`: IRQs that debugfs marks IRQD_AFFINITY_MANAGED (`board(...).nvme_queues` are
    the managed ones); when given, debugfs is written for every IRQ, as if mounted.
    `irqbalance`: "debian" (/etc/default/irqbalance), "rhel" (/etc/sysconfig/irqbalance),
    "binary" (installed without a defaults file) or None.
    `readonly_modes`: smp_affinity_list is 0444 where the kernel cannot move the IRQ, as
    recent kernels create it; False models an older kernel where every file is 0644."""
    dest = Path(dest)
    b = board(cpus, arm, seed)
    rng = random.Random(seed)

    def put(path: str, text: str, mode: int = 0o644) -> None:
        target = dest / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        os.chmod(target, mode)

    put("/proc/interrupts", format_interrupts(b), 0o444)
    put("/proc/softirqs", format_softirqs(cpus, rng), 0o444)
    put("/proc/irq/default_smp_affinity", format_cpumask(range(cpus)) + "\n")
    for i in b.irqs:
        base = f"/proc/irq/{i.irq}"
        if i.affinity is not None:
            mode = 0o444 if readonly_modes and i.read_only else 0o644
            put(f"{base}/smp_affinity_list", i.affinity + "\n", mode)
        if i.effective is not None:
            put(f"{base}/effective_affinity_list", i.effective + "\n", 0o444)
        if managed:
            put(
                f"/sys/kernel/debug/irq/irqs/{i.irq}",
                debugfs_irq(_with_managed(i, i.irq in managed), arm),
                0o444,
            )

    online = _all(cpus)
    for name, value in (
        ("online", online),
        ("possible", online),
        ("present", online),
        ("offline", ""),
        ("isolated", isolated),
        ("nohz_full", isolated),
    ):
        put(f"/sys/devices/system/cpu/{name}", value + "\n", 0o444)

    if cmdline is None:
        if arm:
            cmdline = (
                "console=ttyS2,1500000n8 earlycon=uart8250,mmio32,0xfe660000 "
                "root=PARTUUID=614e0000-0000-4b53-8000-1d28000054a9 rw rootwait"
            )
        else:
            cmdline = (
                "BOOT_IMAGE=/boot/vmlinuz-6.1.0-25-amd64 "
                "root=UUID=3f1c7b2e-9a51-4c4e-bf0e-5d2a1e6f9c10 ro quiet"
            )
        if isolated:
            cmdline += (
                f" isolcpus=managed_irq,domain,{isolated} nohz_full={isolated} rcu_nocbs={isolated}"
            )
    put("/proc/cmdline", cmdline + "\n", 0o444)

    if irqbalance == "debian":
        put("/etc/default/irqbalance", DEBIAN_IRQBALANCE)
    elif irqbalance == "rhel":
        put("/etc/sysconfig/irqbalance", RHEL_IRQBALANCE)
    elif irqbalance not in (None, "binary"):
        raise ValueError(
            f"irqbalance must be 'debian', 'rhel', 'binary' or None, not {irqbalance!r}"
        )
    if irqbalance is not None:
        put("/usr/sbin/irqbalance", "", 0o755)  # a stand-in: only its presence matters
    return dest


def _with_managed(i: BoardIrq, managed: bool) -> BoardIrq:
    return BoardIrq(**{**i.__dict__, "managed": managed})


# -- comparing trees --------------------------------------------------------------------------

TreeState = dict[str, tuple]


def tree_state(root: Path, exclude: Sequence[str] = (JOURNAL_DIR,)) -> TreeState:
    """Every file's bytes and mode, every directory and symlink under `root`, minus `exclude`
    folders: what "revert is byte-identical" compares (a left-over folder counts too)."""
    root = Path(root)
    state: TreeState = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if any(rel == e or rel.startswith(e.rstrip("/") + "/") for e in exclude):
            continue
        if path.is_dir() and any(e.startswith(rel + "/") for e in exclude):
            continue  # a parent the journal created for its state dir
        if path.is_symlink():
            state[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            state[rel] = ("dir",)
        else:
            state[rel] = (path.read_bytes(), path.stat().st_mode & 0o7777)
    return state
