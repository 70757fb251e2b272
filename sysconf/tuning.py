"""Kernel noise off the inference cores, and the boot command line that isolates them.

Each planner reads through a `SysRoot` and returns `Change` records ("this file gets this exact
content") only for files that exist in that root and differ from the wanted value, so planning
an already-tuned system gives nothing. Nothing here writes; the `Journal` does.

The runtime part (`plan_kernel_noise`) takes effect at once and is lost at reboot, which is why
edged-tune.service re-applies it at every boot. The boot part (`plan_boot_cmdline`) only takes
effect at the next boot, and a wrong one can leave a board unbootable, so on a live system it is
planned only when asked for explicitly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sysconf.changes import Change, same_value, selected_choice
from sysconf.confined import PathRefused
from sysconf.cpulist import format_cpulist, format_cpumask, parse_cpulist, parse_cpumask
from sysconf.sysroot import SysRoot

if TYPE_CHECKING:
    from sysconf.cpusets import CpuPlan

CPU_DIR = "/sys/devices/system/cpu"

WORKQUEUE_MASKS = (
    (
        "/sys/devices/virtual/workqueue/cpumask",
        "unbound kernel workqueues (kworker/u*: filesystem, crypto, block completion work) run on "
        "any CPU in this mask and preempt whatever runs there",
    ),
    (
        "/sys/bus/workqueue/devices/writeback/cpumask",
        "dirty-page writeback flusher work runs on any CPU in this mask, in bursts whenever "
        "applications write files",
    ),
)

SYSCTLS = (
    (
        "kernel.timer_migration",
        "0",
        "timers armed on idle CPUs are migrated to busy ones, i.e. onto the inference cores; 0 "
        "keeps each timer on the CPU that armed it",
    ),
    # Seconds (the kernel's unit here); the default is 1.
    (
        "vm.stat_interval",
        "10",
        "the vmstat worker folds per-CPU VM counters on every CPU every stat_interval seconds; "
        "10 s instead of 1 s interrupts the inference cores ten times less often",
    ),
    (
        "kernel.nmi_watchdog",
        "0",
        "the hard-lockup detector raises a perf NMI on every CPU, inference cores included, and "
        "keeps a perf event busy there",
    ),
    (
        "kernel.numa_balancing",
        "0",
        "automatic NUMA balancing unmaps pages periodically to sample accesses; the resulting "
        "hinting page faults land on the inference threads",
    ),
)

# Not in SYSCTLS on purpose (so neither `plan_kernel_noise` by default nor provision's sysctl.d
# file sets it): RT throttling is the kernel's safety net against a runaway SCHED_FIFO/RR
# thread, and it only costs latency when such a thread exists. Unlike the four above it is a
# trade-off, so it is planned only when the caller says a real-time thread will run
# (`realtime=True`: edgectl passes it when a model has `rt_priority`), as tuned sets it only
# in its realtime profiles. The audit reports it on its own (KRN-SCHED-RT-RUNTIME).
# Microseconds (the kernel's unit); the default is 950000 of each 1000000 (sched_rt_period_us).
RT_THROTTLING = (
    "kernel.sched_rt_runtime_us",
    "-1",
    "RT throttling lets SCHED_FIFO/RR threads run only sched_rt_runtime_us of each "
    "sched_rt_period_us (default 950000 of 1000000 us), so a busy SCHED_FIFO inference worker "
    "(rt_priority) is stopped for 50 ms every second; -1 turns the throttling off",
)
RT_PERIOD = "kernel.sched_rt_period_us"
# systemd-sysctl's folders, highest priority first: a file name in an earlier folder hides the
# same name in later ones; all files then apply in file-name order, the last assignment wins.
SYSCTL_DIRS = (
    "/etc/sysctl.d",
    "/run/sysctl.d",
    "/usr/local/lib/sysctl.d",
    "/usr/lib/sysctl.d",
    "/lib/sysctl.d",
)

# Selector files: the content lists the choices with the current one in brackets
# ("always [madvise] never") and takes a single bare word on write. Writing the listing back
# fails with EINVAL, so these Changes carry `selector=True` and `old` is the bracketed word
# ("madvise"): that word is what the journal records and what revert writes back.
THP = (
    (
        "/sys/kernel/mm/transparent_hugepage/enabled",
        "transparent hugepages: khugepaged collapses pages in the background and huge-page faults "
        "zero 2 MiB at once, so fault time depends on memory fragmentation, not on the model",
    ),
    (
        "/sys/kernel/mm/transparent_hugepage/defrag",
        "transparent hugepage defrag: page faults stall in direct compaction to find a huge page",
    ),
)

# The boot configuration a root uses, first found wins. Raspberry Pi OS Bookworm moved
# cmdline.txt to /boot/firmware and leaves a stub at /boot/cmdline.txt, hence that order.
BOOT_CONFIGS = (
    "/boot/firmware/cmdline.txt",
    "/boot/cmdline.txt",
    "/boot/extlinux/extlinux.conf",
    "/etc/default/grub",
)
ISOLATION_KEYS = ("isolcpus", "nohz_full", "rcu_nocbs", "irqaffinity")


def _cpus(plan: CpuPlan) -> tuple[list[int], list[int]]:
    """Sorted inference and housekeeping CPUs of any object with those two attributes."""
    inference, housekeeping = sorted(set(plan.inference)), sorted(set(plan.housekeeping))
    source = getattr(plan, "source", "given")
    if inference and not housekeeping:
        raise ValueError(f"CPU plan ({source}) leaves no housekeeping CPU")
    if set(inference) & set(housekeeping):
        raise ValueError(
            f"CPU plan ({source}) has CPUs "
            f"{format_cpulist(set(inference) & set(housekeeping))} in both sets"
        )
    return inference, housekeeping


# -- runtime kernel noise ---------------------------------------------------------------------


def plan_kernel_noise(root: SysRoot, plan: CpuPlan, realtime: bool = False) -> list[Change]:
    """Workqueue masks, cpufreq governors, sysctls and transparent hugepages, each only where
    its file exists in `root` and its value differs; with `realtime` (a SCHED_FIFO inference
    thread will run) also RT throttling off. Only reads."""
    inference, housekeeping = _cpus(plan)
    if not inference:
        return []  # nothing to protect
    return [
        *workqueue_changes(root, housekeeping),
        *governor_changes(root, inference),
        *_sysctls(root),
        *(plan_rt_throttling(root) if realtime else []),
        *_thp(root),
    ]


def sysctl_path(name: str) -> str:
    """`kernel.sched_rt_runtime_us` -> `/proc/sys/kernel/sched_rt_runtime_us`."""
    return "/proc/sys/" + name.replace(".", "/")


def plan_rt_throttling(root: SysRoot) -> list[Change]:
    """kernel.sched_rt_runtime_us=-1 where the file exists and is not -1 already."""
    name, value, why = RT_THROTTLING
    path = sysctl_path(name)
    current = _read(root, path)
    if current is None or same_value(current, value):
        return []
    return [Change("sysctl", path, current, value, f"{name}={value}: {why}")]


def configured_sysctl(root: SysRoot, name: str) -> tuple[str, str] | None:
    """(value, file) that systemd-sysctl would set for `name` at boot from the root's sysctl.d
    folders, or None when no file sets it. Keys may be written with dots or slashes, and a
    leading "-" (ignore errors) is allowed."""
    files: dict[str, str] = {}
    for folder in SYSCTL_DIRS:
        for file_name in root.listdir(folder):
            if file_name.endswith(".conf"):
                files.setdefault(file_name, f"{folder}/{file_name}")
    found = None
    for file_name in sorted(files):
        for line in (_read(root, files[file_name]) or "").splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")) or "=" not in line:
                continue
            key, value = (part.strip() for part in line.split("=", 1))
            if key.lstrip("-").replace("/", ".") == name:
                found = (value, files[file_name])
    return found


def _read(root: SysRoot, path: str) -> str | None:
    """Read inside the root (an image's links resolved in it, never on the host)."""
    try:
        return root.files.read(path)
    except (OSError, PathRefused):
        # Unreadable: the journal could not record it, so do not plan it. A refused link
        # under /proc or /sys: the journal refuses the whole root (apply exits 2).
        return None


def workqueue_changes(root: SysRoot, housekeeping: list[int]) -> list[Change]:
    changes = []
    where = format_cpulist(housekeeping)
    for path, why in WORKQUEUE_MASKS:
        current = _read(root, path)
        if current is None:
            continue
        try:
            if parse_cpumask(current) == housekeeping:
                continue  # compared as CPU sets: the kernel may echo another width
        except ValueError:
            continue  # not a mask we understand; leave it alone
        new = format_cpumask(housekeeping, like=current)
        changes.append(
            Change(
                "workqueue", path, current, new, f"{why}; confine it to housekeeping CPUs {where}"
            )
        )
    return changes


def governor_changes(root: SysRoot, inference: list[int]) -> list[Change]:
    changes = []
    seen: set[str] = set()
    for cpu in inference:
        folder = f"{CPU_DIR}/cpu{cpu}/cpufreq"
        # cpuN/cpufreq links to a policy that often drives a whole cluster (all four cores of
        # a Raspberry Pi 4): one Change per policy, not per CPU.
        try:
            # Inside an image root, never through the host's /sys (live: the real policy).
            policy = (
                str(root.path(folder).resolve()) if root.is_live else root.files.resolve(folder)
            )
        except (OSError, PathRefused):
            continue
        if policy in seen:
            continue
        seen.add(policy)
        path = f"{folder}/scaling_governor"
        current = _read(root, path)
        available = (_read(root, f"{folder}/scaling_available_governors") or "").split()
        if current is None or "performance" not in available:
            continue  # no cpufreq here, or the driver offers no performance governor
        if same_value(current, "performance"):
            continue
        why = (
            f"cpufreq governor {current.strip()!r} changes CPU {cpu}'s clock with load, so "
            "the same inference takes a different time depending on what ran before; "
            "'performance' holds the highest frequency"
        )
        related = _related_cpus(root, folder)
        others = sorted(set(related) - set(inference))
        if others:
            why += (
                f" (the policy also drives CPUs {format_cpulist(others)}, which then run at "
                "full clock too)"
            )
        changes.append(Change("governor", path, current, "performance", why))
    return changes


def _related_cpus(root: SysRoot, folder: str) -> list[int]:
    text = _read(root, f"{folder}/related_cpus") or ""
    try:
        return parse_cpulist(",".join(text.split()))  # sysfs lists them space-separated
    except ValueError:
        return []


def _sysctls(root: SysRoot) -> list[Change]:
    changes = []
    for name, value, why in SYSCTLS:
        path = "/proc/sys/" + name.replace(".", "/")
        current = _read(root, path)
        if current is None or same_value(current, value):
            continue
        changes.append(Change("sysctl", path, current, value, f"{name}={value}: {why}"))
    return changes


def _thp(root: SysRoot) -> list[Change]:
    changes = []
    for path, why in THP:
        current = _read(root, path)
        selected = selected_choice(current)
        if (
            current is None
            or selected is None
            or selected == "never"
            or "never" not in current.split()
        ):
            continue
        changes.append(
            Change("thp", path, selected, "never", f"{why}; 'never' avoids it", selector=True)
        )
    return changes


# -- boot command line ------------------------------------------------------------------------


def isolation_params(plan: CpuPlan) -> dict[str, str]:
    """The kernel parameters that isolate the plan's inference CPUs, in command-line order."""
    inference, housekeeping = _cpus(plan)
    cores = format_cpulist(inference)
    return {
        "isolcpus": f"managed_irq,domain,{cores}",
        "nohz_full": cores,
        "rcu_nocbs": cores,
        "irqaffinity": format_cpulist(housekeeping),
    }


def boot_config(root: SysRoot) -> str | None:
    """The boot configuration file `root` uses (device path), or None."""
    return next((path for path in BOOT_CONFIGS if root.files.is_file(path)), None)


def plan_boot_cmdline(root: SysRoot, plan: CpuPlan, live_ok: bool = False) -> list[Change]:
    """The isolation parameters added to (or replacing their values in) the root's boot
    configuration, keeping every other byte of the file. On the live system only with
    `live_ok`: this changes how the machine boots."""
    if root.is_live and not live_ok:
        return []
    if not plan.inference:
        return []
    path = boot_config(root)
    if path is None:
        return []
    old = _read(root, path)
    if old is None:
        return []
    params = isolation_params(plan)
    what = (
        f"isolate CPUs {params['nohz_full']}: isolcpus=managed_irq,domain keeps the "
        "scheduler's load balancing and kernel-managed queue IRQs off them, nohz_full stops "
        "their scheduler tick, rcu_nocbs moves their RCU callbacks away, and irqaffinity "
        f"starts every IRQ on housekeeping CPUs {params['irqaffinity']}"
    )
    if path.endswith("cmdline.txt"):
        new = edit_rpi_cmdline(old, params)
        why = (
            f"{what}; the firmware reads the first line of cmdline.txt; takes effect at the "
            "next boot"
        )
    elif path.endswith("extlinux.conf"):
        new = edit_extlinux(old, params)
        why = (
            f"{what}; on every label's append line, so whichever kernel U-Boot boots is "
            "isolated alike; takes effect at the next boot"
        )
        if "u-boot-update" in old:
            why += (
                "; u-boot-update regenerates this file on kernel updates: put the same "
                "parameters in U_BOOT_PARAMETERS in /etc/default/u-boot too"
            )
    else:
        new = edit_grub_default(old, params)
        why = (
            f"{what}; run update-grub (grub-mkconfig -o /boot/grub/grub.cfg) afterwards, "
            "since GRUB boots from grub.cfg, not this file; takes effect at the next boot"
        )
        overriding = _grub_dropins_setting(root, "GRUB_CMDLINE_LINUX_DEFAULT")
        if overriding:
            why += (
                f"; note: {', '.join(overriding)} also set GRUB_CMDLINE_LINUX_DEFAULT and "
                "are read after this file, overriding it"
            )
    if new == old:
        return []
    return [Change("cmdline", path, old, new, why)]


# A kernel parameter: whitespace separates them, except inside double quotes (dyndbg="...").
_PARAM = re.compile(r'(?:[^\s"]+|"[^"]*")+')


def set_params(cmdline: str, params: Mapping[str, str | None]) -> str:
    """`cmdline` with each `key=value` of `params` replacing the first parameter of that key
    (later duplicates dropped), or added after the last kernel parameter — before `--`, which
    starts init's arguments. A value of None removes the key. Every other parameter and all
    spacing and line-end bytes stay as they were, so an already-edited line comes back equal."""
    tokens: list[str] = []
    gaps: list[str] = []  # gaps[i] precedes tokens[i]; gaps[-1] trails
    pos = 0
    for match in _PARAM.finditer(cmdline):
        gaps.append(cmdline[pos : match.start()])
        tokens.append(match.group())
        pos = match.end()
    gaps.append(cmdline[pos:])
    kernel_end = tokens.index("--") if "--" in tokens else len(tokens)

    pieces: list[tuple[str | None, str]] = []  # (gap or None (the line's first token), token)
    seen: set[str] = set()
    kept_kernel = 0
    for index, token in enumerate(tokens):
        key = token.split("=", 1)[0]
        if index < kernel_end and key in params:
            if key in seen or params[key] is None:
                continue  # a dropped parameter takes the gap before it along
            seen.add(key)
            token = f"{key}={params[key]}"
        pieces.append((gaps[index] if index else None, token))
        kept_kernel += index < kernel_end
    added: list[tuple[str | None, str]] = [
        (" ", f"{key}={value}")
        for key, value in params.items()
        if value is not None and key not in seen
    ]
    pieces[kept_kernel:kept_kernel] = added
    if not pieces:
        return cmdline if not tokens else gaps[0] + gaps[-1]
    leading = gaps[0] if tokens else ""
    pieces[0] = (leading, pieces[0][1])
    return "".join((gap if gap is not None else " ") + token for gap, token in pieces) + gaps[-1]


def edit_rpi_cmdline(text: str, params: Mapping[str, str | None]) -> str:
    """Raspberry Pi cmdline.txt: the firmware uses the first line only; the rest is kept."""
    line, newline, rest = text.partition("\n")
    return set_params(line, params) + newline + rest


_APPEND = re.compile(r"(?i)([ \t]*append)(?=\s|$)(.*)")


def edit_extlinux(text: str, params: Mapping[str, str | None]) -> str:
    """Every `append` line, not only the default label's: the labels are usually the current
    and a previous or rescue kernel, and booting any of them should not silently drop the
    isolation. A file without `append` lines is left as it is."""
    lines = []
    for line in _lines(text):
        body = line.rstrip("\r\n")
        match = _APPEND.fullmatch(body)
        if match:
            head, args = match.groups()
            new_args = set_params(args, params)
            if not args.strip():
                new_args = " " + new_args.lstrip(" \t")
            line = head + new_args + line[len(body) :]
        lines.append(line)
    return "".join(lines)


_GRUB_VAR = (
    r"(?P<head>[ \t]*(?:export[ \t]+)?{name}=)"
    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^\s\"'#;]*)(?P<tail>.*)"
)


def edit_grub_default(text: str, params: dict[str, str]) -> str:
    """/etc/default/grub is shell: the last GRUB_CMDLINE_LINUX_DEFAULT assignment wins, so that
    one gets the parameters (a new assignment is added when there is none). The keys are also
    removed from GRUB_CMDLINE_LINUX, which GRUB puts before them, so no second value of theirs
    stays on the command line. Recovery entries get GRUB_CMDLINE_LINUX only, so they boot
    without isolation."""
    default = re.compile(_GRUB_VAR.format(name="GRUB_CMDLINE_LINUX_DEFAULT"))
    linux = re.compile(_GRUB_VAR.format(name="GRUB_CMDLINE_LINUX"))
    drop: dict[str, str | None] = dict.fromkeys(params)
    lines = _lines(text)
    last_default = None
    for number, line in enumerate(lines):
        if default.fullmatch(line.rstrip("\r\n")):
            last_default = number
        elif linux.fullmatch(line.rstrip("\r\n")):
            lines[number] = _edit_shell_value(linux, line, drop)
    if last_default is None:
        ending = "\n" if text and not text.endswith("\n") else ""
        return (
            "".join(lines)
            + ending
            + f'GRUB_CMDLINE_LINUX_DEFAULT="{set_params("", dict(params))}"\n'
        )
    lines[last_default] = _edit_shell_value(default, lines[last_default], dict(params))
    return "".join(lines)


def _edit_shell_value(pattern: re.Pattern[str], line: str, params: dict[str, str | None]) -> str:
    body = line.rstrip("\r\n")
    match = pattern.fullmatch(body)
    assert match is not None
    value = match["value"]
    quote = value[0] if value[:1] in ("'", '"') else ""
    inner = value[1:-1] if quote else value
    edited = set_params(inner, params)
    if edited == inner:
        return line
    quote = quote or '"'  # the parameters hold spaces: an unquoted value gets quotes
    return match["head"] + quote + edited + quote + match["tail"] + line[len(body) :]


def _grub_dropins_setting(root: SysRoot, name: str) -> list[str]:
    pattern = re.compile(_GRUB_VAR.format(name=name))
    found = []
    for path in root.glob("/etc/default/grub.d/*.cfg"):
        text = _read(root, path) or ""
        if any(pattern.fullmatch(line.rstrip("\r\n")) for line in _lines(text)):
            found.append(path)
    return found


def _lines(text: str) -> list[str]:
    """Lines with their own ends. Only \\n ends a line (str.splitlines would also split at
    \\r, form feeds and other separators, and a CRLF file must keep its \\r\\n)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def plan_isolation(
    root: SysRoot, plan: CpuPlan, live_ok: bool = False, realtime: bool = False
) -> list[Change]:
    """Both parts, runtime first."""
    return [*plan_kernel_noise(root, plan, realtime), *plan_boot_cmdline(root, plan, live_ok)]
