"""Interrupts: where they land, which can be moved off the inference cores, and the plan to.

/proc/interrupts has one column per online CPU (the header names them; after a hot-unplug the
numbers have gaps) and rows of two kinds:

    x86:  ` 24:   0   0  IR-PCI-MSI 512000-edge      ahci[0000:00:1f.2]`
          `LOC: 397935 438956   Local timer interrupts`      (per-CPU, named)
          `ERR:          0`                                  (one global counter)
    ARM:  ` 11: 1234 5678     GICv3  27 Level     arch_timer`
          `IPI0:  97 102       Rescheduling interrupts`

Numbered rows are chip, hardware IRQ number, trigger (x86 appends the flow handler to the
hwirq, `-edge`; ARM prints `Level`/`Edge` apart) and the action names, comma-separated
when shared (an action name may itself contain spaces: `fe2c0000.mmc cd`).

What cannot move, and how we know before writing:
- named rows and ARM per-CPU interrupts (GIC hwirq < 32: SGIs and PPIs such as arch_timer, or
  the GICv3.1 extended PPI range; every RISC-V INTC interrupt) are per-CPU by nature;
- kernel-managed queue interrupts (NVMe, virtio-blk, some NICs): debugfs says
  IRQD_AFFINITY_MANAGED when it is mounted under the root; and recent kernels create
  smp_affinity_list read-only (0444) for every IRQ whose affinity user space cannot set
  (register_irq_proc: managed, per-CPU, no-balancing, or a chip without irq_set_affinity such
  as a chained GPIO controller). On older kernels without debugfs a managed IRQ shows itself
  only when the write answers EIO; the journal records that as skipped.
- IRQs without /proc/irq/N/smp_affinity_list.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from sysconf.changes import Change
from sysconf.confined import PathRefused
from sysconf.cpulist import format_cpulist, format_cpumask, parse_cpulist, parse_cpumask
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot

DEFAULT_AFFINITY = "/proc/irq/default_smp_affinity"
DEBUGFS_IRQS = "/sys/kernel/debug/irq/irqs"
# Debian/Ubuntu, then RHEL/Fedora/SUSE: the EnvironmentFile of irqbalance.service.
IRQBALANCE_DEFAULTS = ("/etc/default/irqbalance", "/etc/sysconfig/irqbalance")
IRQBALANCE_BINARIES = ("/usr/sbin/irqbalance", "/usr/bin/irqbalance", "/sbin/irqbalance")

_X86_HWIRQ = re.compile(r"^(\d*)-(\S+)$")  # "512000-edge", "2-fasteoi", "-edge" (no domain)
_ARM_TRIGGER = re.compile(r"^(Level|Edge)(?:-(\S+))?$")
# System-wide counters printed with one number, not one per CPU (x86 ERR/MIS, ARM Err).
GLOBAL_COUNTERS = {"ERR", "MIS", "Err"}


@dataclass
class IrqLine:
    irq: str  # "24", "LOC", "IPI0"
    counts: list[int]  # one per header CPU, in header order (fewer for ERR:/MIS:)
    chip: str = ""  # "IR-PCI-MSI", "GICv3"; "" for named rows
    hwirq: str = ""  # "512000", "27"; "" when the IRQ has no domain and for named rows
    actions: str = ""  # "ahci[0000:00:1f.2]"; the description for named rows
    numeric: bool = False
    trigger: str = ""  # "edge", "fasteoi" (x86 flow handler) or "Level"/"Edge" (ARM)

    @property
    def name(self) -> str:
        return self.actions or self.chip or self.irq

    def count_on(self, header: list[int], cpus: set[int] | list[int]) -> int:
        """Interrupts counted since boot on `cpus` (`header`: the CPU of each column)."""
        wanted = set(cpus)
        return sum(n for cpu, n in zip(header, self.counts, strict=False) if cpu in wanted)


def parse_interrupts(text: str) -> tuple[list[int], list[IrqLine]]:
    """(CPU numbers of the columns, rows). Lines that fit neither row kind are skipped, so a
    format this parser does not know loses rows, not the whole report."""
    lines = text.splitlines()
    if not lines:
        return [], []
    cpus = [int(tok[3:]) for tok in lines[0].split() if tok.startswith("CPU") and tok[3:].isdigit()]
    rows: list[IrqLine] = []
    for line in lines[1:]:
        key, colon, rest = line.partition(":")
        key = key.strip()
        if not colon or not key or " " in key:
            continue
        tokens = rest.split()
        counts: list[int] = []
        while tokens and len(counts) < len(cpus) and tokens[0].isdigit():
            counts.append(int(tokens.pop(0)))
        if key.isdigit():
            rows.append(_numeric_row(key, counts, tokens))
        else:
            rows.append(IrqLine(key, counts, actions=" ".join(tokens)))
    return cpus, rows


def _numeric_row(irq: str, counts: list[int], tokens: list[str]) -> IrqLine:
    chip = hwirq = trigger = ""
    if tokens:
        chip = tokens.pop(0)
        if chip == "RISC-V" and tokens[:1] == ["INTC"]:  # the one chip name with a space
            chip += " " + tokens.pop(0)
    if tokens:
        x86 = _X86_HWIRQ.match(tokens[0])
        if x86:
            hwirq, trigger = x86.groups()
            tokens.pop(0)
        elif tokens[0].isdigit():
            hwirq = tokens.pop(0)
    if tokens:
        arm = _ARM_TRIGGER.match(tokens[0])
        if arm:
            trigger = arm.group(1)
            tokens.pop(0)
    return IrqLine(irq, counts, chip, hwirq, " ".join(tokens), True, trigger)


def read_interrupts(root: SysRoot) -> tuple[list[int], list[IrqLine]]:
    return parse_interrupts(root.read_text("/proc/interrupts", "") or "")


# -- per-IRQ facts ---------------------------------------------------------------------------


@dataclass
class IrqReport:
    """/proc/interrupts with each IRQ's affinity, for planning and for the audit."""

    cpus: list[int]
    lines: list[IrqLine]
    affinity: dict[str, list[int]] = field(default_factory=dict)  # smp_affinity_list
    effective: dict[str, list[int]] = field(default_factory=dict)  # absent: not known
    affinity_text: dict[str, str] = field(default_factory=dict)  # the file as read
    read_only: set[str] = field(default_factory=set)  # smp_affinity_list mode has no write bit
    debug: dict[str, str] = field(default_factory=dict)  # debugfs irq/irqs/N when mounted
    default_affinity: str | None = None  # /proc/irq/default_smp_affinity as read

    def effective_on(self, cpus: set[int] | list[int]) -> list[IrqLine]:
        """Rows that can interrupt `cpus` now: numbered IRQs by effective affinity (the
        affinity list when the kernel has no effective_affinity_list), per-CPU named rows
        always (they have a column on every CPU)."""
        wanted = set(cpus)
        found = []
        for line in self.lines:
            if line.numeric:
                where = self.effective.get(line.irq, self.affinity.get(line.irq, []))
                if wanted & set(where) or (_per_cpu(self, line) and wanted & set(self.cpus)):
                    found.append(line)
            elif (
                line.irq not in GLOBAL_COUNTERS
                and len(line.counts) == len(self.cpus)
                and wanted & set(self.cpus)
            ):
                found.append(line)
        return found


def read_irq_report(root: SysRoot) -> IrqReport:
    cpus, lines = read_interrupts(root)
    report = IrqReport(cpus, lines, default_affinity=root.read_text(DEFAULT_AFFINITY))
    for line in lines:
        if not line.numeric:
            continue
        base = f"/proc/irq/{line.irq}"
        text = root.read_text(f"{base}/smp_affinity_list")
        if text is not None:
            report.affinity_text[line.irq] = text
            report.affinity[line.irq] = _cpulist_or_empty(text)
            try:
                mode = os.stat(root.path(f"{base}/smp_affinity_list")).st_mode
            except OSError:
                mode = stat.S_IWUSR
            if not mode & stat.S_IWUSR:
                report.read_only.add(line.irq)
        effective = root.read_text(f"{base}/effective_affinity_list")
        if effective is not None:
            report.effective[line.irq] = _cpulist_or_empty(effective)
        debug = root.read_text(f"{DEBUGFS_IRQS}/{line.irq}")
        if debug is not None:
            report.debug[line.irq] = debug
    return report


def _cpulist_or_empty(text: str) -> list[int]:
    try:
        return parse_cpulist(text)
    except ValueError:
        return []


# -- what cannot move ------------------------------------------------------------------------


@dataclass(frozen=True)
class Unmovable:
    irq: str
    name: str
    why: str
    remedy: str

    def to_dict(self) -> dict:
        return {"irq": self.irq, "name": self.name, "why": self.why, "remedy": self.remedy}


def _per_cpu_why(line: IrqLine) -> str | None:
    """Why a numbered row is a per-CPU interrupt, judged from its chip and hwirq alone."""
    if line.chip.startswith("GIC") and line.hwirq.isdigit():
        hw = int(line.hwirq)
        if hw < 16:
            return f"GIC SGI {hw}: an inter-processor interrupt, one per CPU"
        if hw < 32 or 1056 <= hw < 1120:  # PPIs and GICv3.1 extended PPIs
            return f"GIC PPI {hw}: a private per-CPU peripheral interrupt"
    if line.chip in ("RISC-V INTC", "riscv-intc"):
        return "RISC-V local interrupt: per-CPU"
    return None


def _debug_flags(text: str) -> set[str]:
    return {word for word in text.split() if word.startswith(("IRQD_", "_IRQ_"))}


def _named_remedy(description: str, cores: str) -> str:
    """What reduces a per-CPU interrupt on the inference cores, by what it is for."""
    text = description.lower()
    if "timer" in text or "irq work" in text:
        return (
            f"nohz_full={cores} (with rcu_nocbs={cores}) stops the scheduler tick while a "
            "single task runs there"
        )
    if "resched" in text or "function call" in text or "tlb" in text or "call function" in text:
        return (
            f"keep every other task off the cores: isolcpus=domain,{cores} and housekeeping "
            "affinity for services; these follow the work scheduled there"
        )
    if "non-maskable" in text or "performance monitoring" in text or "backtrace" in text:
        return "kernel.nmi_watchdog=0 and no perf sampling on these cores"
    if "pmu" in text:
        return "no perf sampling on these cores"
    return "none: the kernel raises it on every CPU by design"


MANAGED_WHY = (
    "kernel-managed queue interrupt: the kernel spreads a device's queues over the "
    "CPUs and user space cannot move them (writes answer EIO)"
)


def _managed_remedy(cores: str) -> str:
    return (
        f"boot with isolcpus=managed_irq,{cores}: the kernel then keeps managed queue "
        "interrupts off those cores whenever a housekeeping CPU in the queue's set is "
        "online"
    )


def classify(report: IrqReport, line: IrqLine, plan: CpuPlan) -> Unmovable | None:
    """Why `line` cannot be moved off the inference cores, or None when it can or when it does
    not concern them (a per-CPU interrupt that never fired there, a managed queue whose CPUs
    are all housekeeping)."""
    blocker = _blocker(report, line, format_cpulist(plan.inference))
    if blocker is None or not _concerns(report, line, set(plan.inference)):
        return None
    return Unmovable(line.irq, line.name, *blocker)


def _concerns(report: IrqReport, line: IrqLine, inference: set[int]) -> bool:
    """Per-CPU rows and IRQs of unknown affinity concern the inference cores when they fired
    there since boot; the others when their affinity (or effective affinity) includes them."""
    if line.numeric and line.irq in report.affinity and not _per_cpu(report, line):
        where = set(report.affinity[line.irq]) | set(report.effective.get(line.irq, []))
        return bool(where & inference)
    return line.count_on(report.cpus, inference) > 0


def _per_cpu(report: IrqReport, line: IrqLine) -> str | None:
    if "IRQD_PER_CPU" in _debug_flags(report.debug.get(line.irq, "")):
        return _per_cpu_why(line) or "debugfs marks it per-CPU (IRQD_PER_CPU)"
    return _per_cpu_why(line)


def _blocker(report: IrqReport, line: IrqLine, cores: str) -> tuple[str, str] | None:
    """(why, remedy) when `line` cannot be moved at all, None when it can."""
    if not line.numeric:
        if line.irq in GLOBAL_COUNTERS or len(line.counts) != len(report.cpus):
            return None  # a global counter: nothing is delivered to a CPU
        return "per-CPU interrupt", _named_remedy(line.actions, cores)
    per_cpu = _per_cpu(report, line)
    if per_cpu:
        return per_cpu, _named_remedy(line.name, cores)
    if line.irq not in report.affinity:
        return (
            f"no /proc/irq/{line.irq}/smp_affinity_list: the kernel offers no affinity "
            "control for it",
            "none from user space",
        )
    debug = _debug_flags(report.debug.get(line.irq, ""))
    if "IRQD_AFFINITY_MANAGED" in debug:
        return MANAGED_WHY + " (debugfs: IRQD_AFFINITY_MANAGED)", _managed_remedy(cores)
    if "IRQD_NO_BALANCING" in debug or "_IRQ_NO_BALANCING" in debug:
        return (
            "its driver marked it no-balancing (debugfs)",
            "none from user space; the driver decides where it runs",
        )
    if line.irq in report.read_only:
        return (
            "the kernel made its smp_affinity_list read-only: a managed queue interrupt, or "
            "one whose interrupt controller cannot route it (e.g. a chained GPIO interrupt)",
            _managed_remedy(cores) + "; a chained interrupt follows its parent interrupt, "
            "which is moved",
        )
    return None


# -- the plan --------------------------------------------------------------------------------


def plan_irqs(root: SysRoot, plan: CpuPlan) -> tuple[list[Change], list[Unmovable]]:
    """Changes that move every movable IRQ and the default affinity off the inference cores,
    and keep irqbalance from moving them back; plus what cannot move, with the remedy.

    Order: the default affinity first (IRQs requested while apply runs start on housekeeping),
    then each IRQ, then irqbalance's ban list. A moved IRQ keeps what it had outside the
    inference cores (a NIC queue pinned to CPUs 0-1 stays on 0-1 when CPU 3 is taken away);
    only when nothing would be left does it get every housekeeping core. Only reads."""
    if not plan.inference:
        return [], []
    if not plan.housekeeping:
        raise ValueError(f"CPU plan ({plan.source}) leaves no housekeeping CPU to move IRQs to")
    report = read_irq_report(root)
    inference, housekeeping = set(plan.inference), list(plan.housekeeping)
    cores = format_cpulist(plan.inference)
    changes: list[Change] = []
    unmovable: list[Unmovable] = []

    default = _default_change(root, report, inference, housekeeping, cores)
    if default is not None:
        changes.append(default)

    for line in report.lines:
        blocker = _blocker(report, line, cores)
        if blocker is not None:
            if _concerns(report, line, inference):
                unmovable.append(Unmovable(line.irq, line.name, *blocker))
            continue
        if not line.numeric or line.irq not in report.affinity:
            continue
        current = report.affinity[line.irq]
        if not set(current) & inference:
            continue
        target = [cpu for cpu in current if cpu in housekeeping] or housekeeping
        new = format_cpulist(target)
        if line.irq in report.effective:
            effective = format_cpulist(report.effective[line.irq]) or "none"
        else:
            effective = "unknown"
        changes.append(
            Change(
                kind="irq",
                path=f"/proc/irq/{line.irq}/smp_affinity_list",
                old=report.affinity_text[line.irq].strip(),
                new=new,
                reason=f"IRQ {line.irq} ({line.name}) off inference cores {cores}: "
                f"effective {effective} -> {new}",
            )
        )

    changes.extend(plan_irqbalance(root, plan))
    return changes, unmovable


def _default_change(
    root: SysRoot, report: IrqReport, inference: set[int], housekeeping: list[int], cores: str
) -> Change | None:
    current = report.default_affinity
    if current is None or not current.strip():
        return None
    try:
        cpus = parse_cpumask(current)
    except ValueError:
        cpus = []  # unreadable mask: replace it with a known one
    if cpus and not set(cpus) & inference:
        return None
    target = [cpu for cpu in cpus if cpu in housekeeping] or housekeeping
    new = format_cpumask(target, like=current)
    if new == current.strip():
        return None
    reason = (
        f"IRQs requested from now on start on housekeeping CPUs "
        f"{format_cpulist(target)}, not on inference cores {cores}"
    )
    if _irqbalance_installed(root) and not any(root.exists(p) for p in IRQBALANCE_DEFAULTS):
        reason += (
            "; note: irqbalance is installed but has no defaults file "
            f"({' or '.join(IRQBALANCE_DEFAULTS)}), so nothing bans it from moving "
            f"IRQs back unless the cores are isolated or nohz_full"
        )
    return Change(
        kind="irq-default", path=DEFAULT_AFFINITY, old=current.strip(), new=new, reason=reason
    )


def _irqbalance_installed(root: SysRoot) -> bool:
    return any(root.exists(p) for p in IRQBALANCE_BINARIES)


# -- irqbalance ------------------------------------------------------------------------------

_ASSIGNMENT = re.compile(
    r"^(?P<comment>\s*#\s*)?(?P<export>export\s+)?(?P<key>IRQBALANCE_BANNED_CPU(?:LIST|S))"
    r"\s*=(?P<value>.*)$"
)


def plan_irqbalance(root: SysRoot, plan: CpuPlan) -> list[Change]:
    """IRQBALANCE_BANNED_CPULIST=<inference cores> in irqbalance's defaults file, so the
    daemon never puts an IRQ back on them. irqbalance (1.8+, misc/cputree.c) reads the
    deprecated hex IRQBALANCE_BANNED_CPUS first and ignores the list when that one is set, so
    an active BANNED_CPUS line is rewritten to the same CPUs (older irqbalance reads only it).
    An empty value counts as unset: irqbalance then bans only the isolated and nohz_full CPUs.
    Every other line stays byte for byte; takes effect when irqbalance restarts."""
    changes = []
    cores = format_cpulist(plan.inference)
    for path in IRQBALANCE_DEFAULTS:
        try:
            text = root.files.read(path)  # inside the root: the content is written back
        except (OSError, PathRefused):
            continue
        if text is None:
            continue
        new = set_banned_cpus(text, plan.inference)
        if new == text:
            continue
        changes.append(
            Change(
                kind="irqbalance",
                path=path,
                old=text,
                new=new,
                reason=f"irqbalance must not move IRQs back onto inference cores {cores}: "
                f"IRQBALANCE_BANNED_CPULIST={cores} (takes effect when irqbalance restarts)",
            )
        )
    return changes


def set_banned_cpus(text: str, cpus: list[int] | tuple[int, ...]) -> str:
    """`text` (an irqbalance defaults file) with IRQBALANCE_BANNED_CPULIST set to `cpus`: the
    last assignment (an active one if any, else a commented one) is replaced, others untouched;
    appended when there is none. An active IRQBALANCE_BANNED_CPUS gets the same CPUs as a
    mask (see plan_irqbalance). A line that already bans exactly `cpus` is kept as it is."""
    wanted = sorted(set(cpus))
    lines = text.splitlines(keepends=True)
    found: dict[tuple[str, bool], int] = {}
    for index, line in enumerate(lines):
        match = _ASSIGNMENT.match(line.rstrip("\r\n"))
        if match:
            found[(match["key"], match["comment"] is None)] = index
    list_index = found.get(
        ("IRQBALANCE_BANNED_CPULIST", True), found.get(("IRQBALANCE_BANNED_CPULIST", False))
    )
    if list_index is not None:
        lines[list_index] = _assign(lines[list_index], wanted, mask=False)
    else:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines.append(f"IRQBALANCE_BANNED_CPULIST={format_cpulist(wanted)}\n")
    mask_index = found.get(("IRQBALANCE_BANNED_CPUS", True))
    if mask_index is not None:
        match = _ASSIGNMENT.match(lines[mask_index].rstrip("\r\n"))
        if match and _unquote(match["value"]):
            lines[mask_index] = _assign(lines[mask_index], wanted, mask=True)
    return "".join(lines)


def _assign(line: str, cpus: list[int], mask: bool) -> str:
    """The assignment on `line`, uncommented, set to `cpus`; its line ending kept."""
    body = line.rstrip("\r\n")
    ending = line[len(body) :]
    match = _ASSIGNMENT.match(body)
    assert match is not None  # only called for lines the pattern matched
    current = _unquote(match["value"])
    try:
        same = (parse_cpumask(current) if mask else parse_cpulist(current)) == cpus
    except ValueError:
        same = False
    if match["comment"] is None and current and same:
        return line
    value = format_cpumask(cpus, like=current or None) if mask else format_cpulist(cpus)
    return f"{match['export'] or ''}{match['key']}={value}{ending}"


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1].strip()
    return value
