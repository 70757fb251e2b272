"""CPU sets: which cores the kernel already keeps quiet, and which cores inference gets.

Facts come from sysfs (online, isolated, nohz_full: what the running kernel does) and from the
kernel command line (isolcpus with its flags, rcu_nocbs, irqaffinity: what was asked for at
boot). Both are read, because they disagree in telling ways: `isolcpus=managed_irq,2-3` without
`domain` leaves /sys/devices/system/cpu/isolated empty, and a kernel built without NO_HZ_FULL
ignores nohz_full= and has no nohz_full file at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sysconf.cpulist import MAX_CPUS, format_cpulist, parse_cpulist
from sysconf.sysroot import SysRoot

CPU_DIR = "/sys/devices/system/cpu"
# isolcpus= sub-parameters the kernel knows (kernel/sched/isolation.c); "nohz" is the old
# spelling of what nohz_full= does.
ISOLCPUS_FLAGS = ("nohz", "domain", "managed_irq")


@dataclass(frozen=True)
class CpuSets:
    online: list[int]
    isolated: list[int]  # /sys/devices/system/cpu/isolated: isolcpus' "domain" CPUs
    nohz_full: list[int]  # /sys/devices/system/cpu/nohz_full (absent without NO_HZ_FULL)
    isolcpus: list[int]  # from the command line
    # As the kernel applies them: written flags in order, or ["domain"] when none is given
    # (a bare `isolcpus=2-3` means domain isolation).
    isolcpus_flags: list[str]
    rcu_nocbs: list[int]
    irqaffinity: list[int]
    cmdline: str

    def to_dict(self) -> dict:
        return {
            "online": self.online,
            "isolated": self.isolated,
            "nohz_full": self.nohz_full,
            "isolcpus": self.isolcpus,
            "isolcpus_flags": self.isolcpus_flags,
            "rcu_nocbs": self.rcu_nocbs,
            "irqaffinity": self.irqaffinity,
            "cmdline": self.cmdline,
        }


def read_cpusets(root: SysRoot) -> CpuSets:
    """Missing files mean empty sets; so does a malformed value (a damaged image must not stop
    the audit, and an empty set is what the kernel falls back to as well)."""
    online = _sysfs_cpus(root, "online")
    possible = _sysfs_cpus(root, "possible") or online
    cmdline = (root.read_text("/proc/cmdline", "") or "").strip().rstrip("\x00")
    params = parse_cmdline(cmdline)
    last = max(possible) if possible else None

    flags: list[str] = []
    isolcpus: list[int] = []
    if "isolcpus" in params:
        flags, isolcpus = parse_isolcpus(params["isolcpus"] or "", last)
    return CpuSets(
        online=online,
        isolated=_sysfs_cpus(root, "isolated"),
        nohz_full=_sysfs_cpus(root, "nohz_full"),
        isolcpus=isolcpus,
        isolcpus_flags=flags,
        rcu_nocbs=_cmdline_cpus(params.get("rcu_nocbs"), last),
        irqaffinity=_cmdline_cpus(params.get("irqaffinity"), last),
        cmdline=cmdline,
    )


def _sysfs_cpus(root: SysRoot, name: str) -> list[int]:
    try:
        return parse_cpulist(root.read_line(f"{CPU_DIR}/{name}") or "")
    except ValueError:
        return []


def parse_cmdline(text: str) -> dict[str, str | None]:
    """Kernel parameters as the kernel splits them (lib/cmdline.c next_arg): whitespace
    separates, double quotes group (`a="x y"` and `"a=x y"` both give a -> "x y"), a bare word
    is a flag (value None), `a=` is an empty value. The last occurrence wins. Parsing stops at
    a bare `--`: what follows is init's arguments, not the kernel's. Names are normalised to
    underscores, since the kernel treats `-` and `_` in parameter names as the same."""
    params: dict[str, str | None] = {}
    for arg in _split_args(text):
        name, equals, value = arg.partition("=")
        if not equals and name == "--":
            break
        if not name:
            continue
        params[name.replace("-", "_")] = value if equals else None
    return params


def _split_args(text: str) -> list[str]:
    """One string per argument, quotes removed the way next_arg removes them."""
    args: list[str] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        quoted = text[i] == '"'
        if quoted:
            i += 1
        start, in_quote = i, quoted
        while i < n and (in_quote or not text[i].isspace()):
            if text[i] == '"':
                in_quote = not in_quote
            i += 1
        raw = text[start:i]
        name, equals, value = raw.partition("=")
        if equals and value.startswith('"'):  # don't include quotes in the value
            value = value[1:]
            if value.endswith('"'):
                value = value[:-1]
            raw = f"{name}={value}"
        elif quoted and raw.endswith('"'):
            raw = raw[:-1]
        args.append(raw)
    return args


def parse_isolcpus(value: str, last_cpu: int | None = None) -> tuple[list[str], list[int]]:
    """`isolcpus=[flag,...,]<cpu list>` -> (flags, cpus). Flags are the leading alphabetic
    items (kernel/sched/isolation.c); with none, the kernel applies "domain"."""
    parts = value.split(",")
    flags: list[str] = []
    while parts and parts[0][:1].isalpha() and parts[0] not in ("all", "N"):
        flags.append(parts.pop(0))
    if not any(flag in ISOLCPUS_FLAGS for flag in flags):
        flags.append("domain")
    return flags, _cmdline_cpus(",".join(parts), last_cpu)


def _cmdline_cpus(value: str | None, last_cpu: int | None) -> list[int]:
    """A command-line CPU list, with the extras of the kernel's bitmap_parselist that sysfs
    never prints: `all`, `N` (the last CPU) and `a-b:used/group` strides. Unparseable -> []
    (the kernel ignores such a parameter too, with a warning in dmesg)."""
    if not value:
        return []
    value = value.strip()
    if value.lower() == "all":
        return list(range(last_cpu + 1)) if last_cpu is not None else []
    cpus: set[int] = set()
    try:
        for part in value.split(","):
            span, colon, stride = part.partition(":")
            if last_cpu is not None:
                span = "-".join(str(last_cpu) if x == "N" else x for x in span.split("-"))
            listed = parse_cpulist(span)
            if colon:
                used, _, group = stride.partition("/")
                used_n, group_n = int(used), int(group)
                if not 0 < used_n <= group_n:
                    return []
                listed = [c for c in listed if (c - listed[0]) % group_n < used_n]
            cpus.update(listed)
    except ValueError:
        return []
    return sorted(c for c in cpus if c < MAX_CPUS)


@dataclass(frozen=True)
class CpuPlan:
    inference: tuple[int, ...]
    housekeeping: tuple[int, ...]
    source: str  # "override", "isolated", "configured" or "default"
    # Why the choice may surprise: configured cores that differ from the isolated set.
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "inference": list(self.inference),
            "housekeeping": list(self.housekeeping),
            "source": self.source,
            "inference_list": format_cpulist(self.inference),
            "housekeeping_list": format_cpulist(self.housekeeping),
            "notes": list(self.notes),
        }


def decide(
    cpusets: CpuSets,
    configured: Sequence[int] | None = None,
    count: int = 1,
    *,
    override: Sequence[int] | None = None,
) -> CpuPlan:
    """Inference cores: `override` when given (an operator's explicit choice, e.g. edgectl
    --inference-cpus), else the kernel's isolated set, else `configured` (the models' cpus
    from the config), else the last `count` online cores; housekeeping: every other online
    core.

    The isolated set comes before the configured cores because it is what the kernel already
    keeps quiet (isolcpus/nohz_full take a reboot to change), as the isolation issue asks; when
    configured cores differ from it, the plan carries a note, since the daemon pins models to
    their configured cores. The last cores are the default because on big.LITTLE SoCs (RK3588,
    most Cortex-A7x/A5x pairs) the big cores come last, and CPU 0 takes the boot-time and
    legacy interrupts that cannot move.

    Raises ValueError when housekeeping would be empty (nothing left for the kernel, the API
    and telemetry), or an override or configured list is empty or names offline cores
    (configured ones are checked even when the isolated set wins: the daemon pins to them)."""
    online = sorted(set(cpusets.online))
    if not online:
        raise ValueError(f"no online CPUs known ({CPU_DIR}/online is missing or empty)")
    wanted_override = _checked(override, "override", online)
    wanted_configured = _checked(configured, "configured", online)
    isolated = sorted(set(cpusets.isolated) & set(online))
    notes: list[str] = []
    if wanted_override is not None:
        inference, source = wanted_override, "override"
        if isolated and isolated != wanted_override:
            notes.append(
                f"the override {format_cpulist(wanted_override)} is used instead of "
                f"the kernel's isolated set {format_cpulist(isolated)}"
            )
        if wanted_configured is not None and wanted_configured != wanted_override:
            notes.append(
                f"the override {format_cpulist(wanted_override)} differs from the "
                f"configured inference CPUs {format_cpulist(wanted_configured)} "
                f"(the models' cpus)"
            )
    elif isolated:
        inference, source = isolated, "isolated"
        if wanted_configured is not None and wanted_configured != isolated:
            notes.append(
                f"configured inference CPUs {format_cpulist(wanted_configured)} "
                f"differ from the kernel's isolated set {format_cpulist(isolated)}; "
                f"the isolated set is used: pin the models to "
                f"{format_cpulist(isolated)}, or override the choice explicitly"
            )
    elif wanted_configured is not None:
        inference, source = wanted_configured, "configured"
    else:
        if count < 1:
            raise ValueError(f"inference core count must be at least 1, not {count}")
        inference, source = online[-count:], "default"
    housekeeping = [cpu for cpu in online if cpu not in inference]
    if not housekeeping:
        raise ValueError(
            f"inference CPUs {format_cpulist(inference)} ({source}) would leave no "
            f"housekeeping CPU for the kernel, interrupts and the API "
            f"(online: {format_cpulist(online)}); keep at least one CPU out of the set"
        )
    return CpuPlan(tuple(inference), tuple(housekeeping), source, tuple(notes))


def _checked(cpus: Sequence[int] | None, what: str, online: list[int]) -> list[int] | None:
    if cpus is None:
        return None
    wanted = sorted(set(cpus))
    if not wanted:
        raise ValueError(f"the {what} inference CPU list is empty")
    offline = [cpu for cpu in wanted if cpu not in online]
    if offline:
        raise ValueError(
            f"{what} inference CPUs {format_cpulist(offline)} are not online "
            f"(online: {format_cpulist(online)})"
        )
    return wanted


def dt_cpu_count(tree) -> int:
    """CPUs a board's device tree declares (/cpus/cpu@* with device_type "cpu")."""
    node = tree.find("/cpus")
    return sum(
        1 for child in (node.children if node else []) if child.prop_str("device_type") == "cpu"
    )


def read_cpusets_for(root: SysRoot, trees: Sequence = ()) -> CpuSets:
    """`read_cpusets`, and for an image root without /sys the CPUs of the board's device
    tree (the first of `trees` that declares any)."""
    cpusets = read_cpusets(root)
    if cpusets.online:
        return cpusets
    for tree in trees:
        count = dt_cpu_count(tree)
        if count:
            return replace(cpusets, online=list(range(count)))
    return cpusets
