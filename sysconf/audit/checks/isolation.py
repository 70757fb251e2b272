"""ISO, IRQ, KRN: core isolation, IRQ routing and kernel noise (workqueues, governor, sysctls,
THP, RT throttling, the boot command line) for the inference cores.

One check for the three prefixes because every finding comes from the same plan `edgectl
plan/apply` uses (`sysconf.isolation.plan`), so whatever the audit calls `fixable` is exactly
what `edgectl apply` changes; once applied, the same audit passes those findings.

Options read from `AuditContext.options`:
  inference_cpus  list[int] | None  the models' configured cores (`decide`: after the
                                    kernel's isolated set, before the last online core)
  inference_override list[int] | None  --inference-cpus: wins over both, as for apply
  realtime        bool | None       whether a model runs SCHED_FIFO (`rt_priority`): decides
                                    whether RT throttling is worth a warning (None: unknown)
"""

from __future__ import annotations

from collections.abc import Iterator

from sysconf.audit.findings import AuditContext, Catalogue, Evidence, Finding, Rule, register
from sysconf.cpulist import format_cpulist
from sysconf.cpusets import decide, parse_cmdline, read_cpusets_for
from sysconf.isolation import plan
from sysconf.tuning import (
    ISOLATION_KEYS,
    RT_PERIOD,
    RT_THROTTLING,
    boot_config,
    configured_sysctl,
    isolation_params,
    sysctl_path,
)

CATALOGUE = Catalogue(
    prefix="ISO",
    sections={"ISO": 10, "IRQ": 20, "KRN": 40},
    rules={
        "ISO-INFERENCE-CPUS": Rule("warn", "there are cores to isolate"),
        "ISO-ISOLATED-CORES": Rule("info", "the inference cores are isolated by the kernel"),
        "ISO-NOHZ-CPU0": Rule("fail", "CPU 0 is not in nohz_full"),
        "ISO-ISOLATED-OFFLINE": Rule("fail", "the isolated CPUs are online"),
        "IRQ-AFFINITY": Rule("warn", "no movable IRQ is routed to the inference cores"),
        "IRQ-DEFAULT-AFFINITY": Rule(
            "warn", "new IRQs start on housekeeping cores (default_smp_affinity)"
        ),
        "IRQ-IRQBALANCE-BAN": Rule("warn", "irqbalance keeps off the inference cores"),
        "IRQ-UNMOVABLE": Rule("warn", "no unmovable interrupt fires on the inference cores"),
        "KRN-WORKQUEUE-MASK": Rule("warn", "unbound workqueues run on housekeeping cores"),
        "KRN-GOVERNOR": Rule("warn", "inference cores use the performance governor"),
        "KRN-SYSCTL": Rule("warn", "latency sysctls are set"),
        "KRN-THP": Rule("warn", "transparent hugepages do not compact on the inference path"),
        "KRN-CMDLINE": Rule("warn", "the boot command line isolates the inference cores"),
        "KRN-SCHED-RT-RUNTIME": Rule("warn", "RT throttling does not stop a SCHED_FIFO worker"),
    },
)
_finding = CATALOGUE.finding

# Change.kind of the isolation plan -> the id its findings carry (a kind not here is a bug:
# the check fails with ISO-CHECK-ERROR rather than report it under an unpinned id).
CHANGE_IDS = {
    "irq": "IRQ-AFFINITY",
    "irq-default": "IRQ-DEFAULT-AFFINITY",
    "irqbalance": "IRQ-IRQBALANCE-BAN",
    "workqueue": "KRN-WORKQUEUE-MASK",
    "governor": "KRN-GOVERNOR",
    "sysctl": "KRN-SYSCTL",
    "thp": "KRN-THP",
    "cmdline": "KRN-CMDLINE",
}
_AT_BOOT = " (takes effect at the next boot)"


def _apply_command(ctx: AuditContext, boot: bool = False) -> str:
    cmd = "edgectl apply"
    if not ctx.root.is_live:
        cmd += f" --root {ctx.root.root}"
    # The cores the audit judged by, named explicitly so that apply plans exactly those.
    cpus = ctx.options.get("inference_override") or ctx.options.get("inference_cpus")
    if cpus:
        cmd += f" --inference-cpus {format_cpulist(cpus)}"
    if boot:
        cmd += " --boot"
    return cmd


@register("isolation", CATALOGUE, order=30)
def check_isolation(ctx: AuditContext) -> Iterator[Finding]:
    root = ctx.root
    cpusets = read_cpusets_for(root, [tree for _, tree in ctx.dtbs])
    yield from _isolated_offline(cpusets)
    try:
        cpus = decide(
            cpusets,
            ctx.options.get("inference_cpus"),
            override=ctx.options.get("inference_override"),
        )
    except ValueError as exc:
        # One online CPU (or none known): there is nothing to isolate, which is a fact of
        # the machine, not a broken check.
        yield _finding(
            "ISO-INFERENCE-CPUS",
            "skip",
            f"isolation not checked: {exc}",
            evidence=(
                Evidence(
                    "/sys/devices/system/cpu/online",
                    format_cpulist(cpusets.online) or "(unknown)",
                    "at least 2 CPUs",
                ),
            ),
        )
        return
    # Only with cores to isolate: on a single core, RT throttling is what keeps a runaway
    # SCHED_FIFO thread from freezing the whole system.
    yield from _rt_throttling(ctx)
    cores = format_cpulist(cpus.inference)

    # Isolated cores: asked for at boot (isolcpus) or applied by the kernel (isolated).
    isolated = set(cpusets.isolcpus) | set(cpusets.isolated)
    missing = [c for c in cpus.inference if c not in isolated]
    yield _finding(
        "ISO-ISOLATED-CORES",
        "warn" if missing else "pass",
        f"inference cores {cores} ({cpus.source}) "
        + (
            f"not isolated by the kernel: {format_cpulist(missing)}"
            if missing
            else "are isolated by the kernel"
        ),
        evidence=(
            Evidence(
                "/sys/devices/system/cpu/isolated",
                format_cpulist(cpusets.isolated) or "(empty)",
                cores,
            ),
            Evidence(
                "/proc/cmdline",
                _param_text(cpusets.cmdline, "isolcpus") or "(no isolcpus)",
                f"isolcpus=managed_irq,domain,{cores}",
            ),
        ),
        remedy=f"{_apply_command(ctx, boot=True)}{_AT_BOOT}" if missing else "",
    )

    nohz_cpu0 = 0 in cpusets.nohz_full
    yield _finding(
        "ISO-NOHZ-CPU0",
        "fail" if nohz_cpu0 else "pass",
        "CPU 0 is in nohz_full (it keeps the timekeeping tick; the kernel refuses or misbehaves)"
        if nohz_cpu0
        else None,
        evidence=(
            Evidence(
                "/sys/devices/system/cpu/nohz_full",
                format_cpulist(cpusets.nohz_full) or "(empty)",
                "without CPU 0",
            ),
        ),
        remedy="remove CPU 0 from nohz_full= on the boot command line" if nohz_cpu0 else "",
    )

    isolation = plan(root, cpus)
    by_kind: dict[str, list] = {kind: [] for kind in CHANGE_IDS}
    for change in isolation.changes:
        by_kind.setdefault(change.kind, []).append(change)
    remedy = _apply_command(ctx)
    for kind, changes in by_kind.items():
        fid = CHANGE_IDS[kind]
        if kind == "cmdline" and not changes:
            yield from _cmdline_finding(ctx, cpus, cpusets.cmdline)
            continue
        if not changes:
            yield _finding(fid, "pass")
            continue
        for change in changes:
            yield _finding(
                fid,
                "warn",
                change.reason,
                evidence=(Evidence(change.path, _short(change.old), _short(change.new)),),
                remedy=remedy + (_AT_BOOT if kind == "cmdline" else ""),
                fixable=True,
                subject=_subject(change.kind, change.path),
            )

    for item in isolation.unmovable:
        yield _finding(
            "IRQ-UNMOVABLE",
            "warn",
            f"IRQ {item.irq} ({item.name}) cannot be moved off inference cores {cores}: {item.why}",
            evidence=(
                Evidence(
                    f"/proc/irq/{item.irq}/smp_affinity_list"
                    if item.irq.isdigit()
                    else "/proc/interrupts",
                    item.why,
                    f"not on CPUs {cores}",
                ),
            ),
            remedy=item.remedy,
            subject=item.irq,
        )
    if not isolation.unmovable:
        yield _finding("IRQ-UNMOVABLE", "pass")


def _isolated_offline(cpusets) -> Iterator[Finding]:
    """An isolated CPU (isolated, or isolcpus= on the command line) that is offline: the
    inference threads pinned to it cannot run there (sched_setaffinity fails or they fall
    back to housekeeping cores)."""
    fid = "ISO-ISOLATED-OFFLINE"
    isolated = sorted(set(cpusets.isolated) | set(cpusets.isolcpus))
    where = Evidence(
        "/sys/devices/system/cpu/online",
        format_cpulist(cpusets.online) or "(unknown)",
        "every isolated CPU",
    )
    if not isolated:
        return  # nothing isolated: ISO-ISOLATED-CORES says so
    if not cpusets.online:
        yield _finding(
            fid,
            "skip",
            "isolated CPUs not checked: which CPUs are online is not known",
            evidence=(where,),
        )
        return
    offline = [cpu for cpu in isolated if cpu not in cpusets.online]
    if not offline:
        yield _finding(
            fid,
            "pass",
            f"the isolated CPUs {format_cpulist(isolated)} are online",
            evidence=(where,),
        )
        return
    cores = format_cpulist(offline)
    yield _finding(
        fid,
        "fail",
        f"isolated CPUs {cores} are not online: inference pinned there cannot run",
        evidence=(
            Evidence(
                "/sys/devices/system/cpu/online",
                format_cpulist(cpusets.online),
                f"includes {cores}",
            ),
            Evidence(
                "/sys/devices/system/cpu/isolated",
                format_cpulist(cpusets.isolated) or "(empty)",
                "online CPUs",
            ),
            Evidence(
                "/proc/cmdline",
                _param_text(cpusets.cmdline, "isolcpus") or "(no isolcpus)",
                "online CPUs",
            ),
        ),
        remedy=" && ".join(f"echo 1 > /sys/devices/system/cpu/cpu{cpu}/online" for cpu in offline)
        + ", or fix isolcpus= (maxcpus=/nr_cpus= on the command line, a core disabled in "
        "the device tree)",
        subject=cores,
    )


# The kernel's default RT budget (µs of each sched_rt_period_us), in force when nothing sets it.
RT_RUNTIME_DEFAULT = "950000"
RT_DROPIN = "/etc/sysctl.d/90-edged-rt.conf"


def _rt_throttling(ctx: AuditContext) -> Iterator[Finding]:
    """KRN-SCHED-RT-RUNTIME: RT throttling stops a busy SCHED_FIFO worker for 50 ms a second.

    Its own finding, not part of KRN-SYSCTL, because turning it off is right only when a
    real-time thread runs (see `sysconf.tuning.RT_THROTTLING`): `edgectl apply` changes it only
    for a config with `rt_priority`, so the finding is `fixable` only when the audit knows
    that (option `realtime`). Live, the running value counts; in an image root, what the
    root's sysctl.d sets at boot, else the kernel default."""
    fid = "KRN-SCHED-RT-RUNTIME"
    root = ctx.root
    name, wanted, _why = RT_THROTTLING
    path = sysctl_path(name)
    realtime = ctx.options.get("realtime")
    current = root.read_line(path)
    where = path
    if current is None:
        if root.is_live:
            yield _finding(
                fid,
                "skip",
                f"{name} is not readable here",
                evidence=(Evidence(path, "(absent)", wanted),),
            )
            return
        configured = configured_sysctl(root, name)
        current, where = configured or (
            RT_RUNTIME_DEFAULT,
            f"{path} (kernel default; no sysctl.d file sets it)",
        )
    period = root.read_line(sysctl_path(RT_PERIOD)) or "1000000"
    try:
        throttled = int(current) >= 0 and int(current) < int(period)
    except ValueError:
        yield _finding(
            fid,
            "skip",
            f"{name} = {current!r} is not a number",
            evidence=(Evidence(where, current, wanted),),
        )
        return
    evidence = (Evidence(where, f"{current} (of each {period} us)", wanted),)
    if not throttled:
        yield _finding(
            fid,
            "pass",
            "RT throttling is off: a SCHED_FIFO inference worker is never stopped by the kernel",
            evidence=evidence,
        )
        return
    if realtime is False:
        yield _finding(
            fid,
            "pass",
            "RT throttling is on, and no model runs SCHED_FIFO "
            "(rt_priority): it stays as the kernel's safety net",
            evidence=evidence,
        )
        return
    pause_ms = (int(period) - int(current)) / 1000  # µs -> ms: the stall a busy thread sees
    who = (
        "a model runs SCHED_FIFO (rt_priority)"
        if realtime
        else "if a model runs SCHED_FIFO (rt_priority)"
    )
    set_now = f"sysctl -w {name}={wanted} (now) and " if path == where else ""
    yield _finding(
        fid,
        "warn",
        f"RT throttling is on ({current} of each {period} us): {who}, its busy worker is "
        f"stopped for {pause_ms:g} ms every {int(period) / 1e6:g} s",
        evidence=evidence,
        remedy=f"{set_now}`{name} = {wanted}` in {RT_DROPIN} (at boot); "
        "`edgectl apply --config FILE` sets it at runtime when a model has rt_priority. "
        "Keep it on if no model uses rt_priority: it stops a runaway real-time thread",
        fixable=bool(realtime) and path == where,
        subject=name,
    )


def _cmdline_finding(ctx: AuditContext, cpus, cmdline: str) -> Iterator[Finding]:
    """The plan proposes no boot change (live without --boot, or no boot config in the root):
    compare what the running kernel was booted with."""
    wanted = isolation_params(cpus)
    params = parse_cmdline(cmdline)
    wrong = [key for key in ISOLATION_KEYS if (params.get(key) or "") != wanted[key]]
    if not wrong:
        yield _finding(
            "KRN-CMDLINE",
            "pass",
            evidence=(Evidence("/proc/cmdline", _short(cmdline), "isolation set"),),
        )
        return
    where = "" if ctx.root.is_live or boot_config(ctx.root) is None else boot_config(ctx.root)
    yield _finding(
        "KRN-CMDLINE",
        "warn",
        f"the kernel was not booted with the isolation parameters for CPUs "
        f"{format_cpulist(cpus.inference)}: {', '.join(wrong)}",
        evidence=tuple(
            Evidence(
                "/proc/cmdline",
                f"{k}={params[k]}" if params.get(k) else f"(no {k})",
                f"{k}={wanted[k]}",
            )
            for k in wrong
        ),
        remedy=(
            f"{_apply_command(ctx, boot=True)} then reboot"
            if not where
            else f"edit {where}, then reboot"
        ),
        fixable=False,
    )


def _param_text(cmdline: str, key: str) -> str:
    value = parse_cmdline(cmdline).get(key)
    return f"{key}={value}" if value is not None else ""


def _subject(kind: str, path: str) -> str:
    if kind == "irq":
        return path.split("/")[3]  # /proc/irq/N/smp_affinity_list
    if kind == "sysctl":
        return path.removeprefix("/proc/sys/").replace("/", ".")
    return path


def _short(text: str | None, limit: int = 200) -> str:
    if text is None:
        return "(absent)"
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
