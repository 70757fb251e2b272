"""SVC: services and timers that wake up and steal cores, systemd's CPUAffinity, and how
journald logs, from the unit-file and journald facts of `sysconf.services`.

Options read from `AuditContext.options` (from the config's [audit] table):
  trim  list[str]  extra units to trim (a name without a suffix means `<name>.service`)
  keep  list[str]  units never to trim
"""

from __future__ import annotations

from collections.abc import Iterator

from sysconf.audit.findings import AuditContext, Catalogue, Evidence, Finding, Rule, register
from sysconf.cpulist import format_cpulist
from sysconf.cpusets import decide, read_cpusets_for
from sysconf.services import (
    AFFINITY_DROPIN,
    JOURNALD_BURST,
    JOURNALD_INTERVAL_S,
    JOURNALD_MAX_RATE,
    MASK_DIR,
    MASK_TARGET,
    SYSTEM_CONF,
    TRIM_CANDIDATES,
    UNIT_DIRS,
    is_protected,
    journald_settings,
    manager_cpu_affinity,
    parse_timespan,
    trim_candidates,
    unit_name,
    unit_state,
)
from sysconf.sysroot import SysRoot

CATALOGUE = Catalogue(
    prefix="SVC",
    sections={"SVC": 30},
    rules={
        "SVC-CPUAFFINITY": Rule("warn", "systemd starts services on the housekeeping cores"),
        "SVC-JOURNALD-RATELIMIT": Rule("info", "journald rate limits are bounded"),
        "SVC-PROTECTED": Rule("warn", "no protected unit is listed in [audit] trim"),
        "SVC-TRIM": Rule("warn", "no periodic or idle service on the trim list is enabled"),
        "SVC-DOUBLE-LOGGING": Rule("warn", "messages are logged once"),
        "SVC-JOURNALD-STORAGE": Rule("info", "journald storage and rate limits are bounded"),
    },
)
_finding = CATALOGUE.finding
_JOURNALD_DROPIN = "/etc/systemd/journald.conf.d/"


def _yes(value: str) -> bool:
    return value.lower() in ("yes", "true", "on", "1", "y", "t")


def _apply_command(ctx: AuditContext) -> str:
    cmd = "edgectl apply --trim"
    if not ctx.root.is_live:
        cmd += f" --root {ctx.root.root}"
    return cmd


@register("services", CATALOGUE, order=20)
def check_services(ctx: AuditContext) -> Iterator[Finding]:
    root = ctx.root
    keep = tuple(ctx.options.get("keep", ()))
    extra = tuple(ctx.options.get("trim", ()))
    if not any(root.listdir(d) for d in UNIT_DIRS):
        yield _finding(
            "SVC-TRIM",
            "skip",
            "no systemd unit folders in this root",
            evidence=(Evidence(MASK_DIR, "(absent)", "systemd unit files"),),
        )
        return
    yield from _cpu_affinity(ctx)
    yield from _journald_ratelimit(root)

    asked_protected = [unit_name(u) for u in extra if is_protected(u)]
    for unit in asked_protected:
        yield _finding(
            "SVC-PROTECTED",
            "warn",
            f"{unit} is protected and is never trimmed (listed in [audit] trim)",
            evidence=(Evidence("[audit] trim", unit, "not a protected unit"),),
            remedy=f"remove {unit} from [audit] trim",
            subject=unit,
        )

    candidates = trim_candidates(root, keep, extra)
    for state in candidates:
        why = TRIM_CANDIDATES.get(state.name, "listed in the config's [audit] trim")
        remedy = f"{_apply_command(ctx)} (masks {MASK_DIR}/{state.name} -> {MASK_TARGET}"
        if root.is_live:
            remedy += (
                f" and stops it, as systemctl mask --now {state.name}; edgectl revert "
                "unmasks it and starts it again if it ran"
            )
        remedy += ")"
        yield _finding(
            "SVC-TRIM",
            "warn",
            f"{state.name} is enabled: {why}",
            evidence=(Evidence(state.enabled_by[0], "enabled", "masked or disabled"),),
            remedy=remedy,
            fixable=True,
            subject=state.name,
        )
    if not candidates:
        yield _finding("SVC-TRIM", "pass")

    settings = journald_settings(root)
    forward = settings.get("ForwardToSyslog")
    rsyslog = unit_state(root, "rsyslog.service")
    if rsyslog.enabled and forward and _yes(forward[0]):
        yield _finding(
            "SVC-DOUBLE-LOGGING",
            "warn",
            "rsyslog is enabled while journald forwards to syslog: every message is written twice",
            evidence=(
                Evidence(forward[1], f"ForwardToSyslog={forward[0]}", "ForwardToSyslog=no"),
                Evidence(rsyslog.enabled_by[0], "rsyslog.service enabled", "one logger"),
            ),
            remedy=f"set ForwardToSyslog=no in a {_JOURNALD_DROPIN} drop-in, or disable rsyslog",
            subject="rsyslog.service",
        )
    else:
        yield _finding("SVC-DOUBLE-LOGGING", "pass")

    storage = settings.get("Storage")
    burst = settings.get("RateLimitBurst")
    if storage and storage[0].lower() == "persistent" and burst is None:
        yield _finding(
            "SVC-JOURNALD-STORAGE",
            "warn",
            "journald stores logs persistently with the default rate limit: a chatty "
            "service keeps the disk and a core busy",
            evidence=(
                Evidence(
                    storage[1],
                    f"Storage={storage[0]}, no RateLimitBurst",
                    "Storage=volatile, or an explicit RateLimitBurst",
                ),
            ),
            remedy="set RateLimitIntervalSec= and RateLimitBurst= (or Storage=volatile) in a "
            f"{_JOURNALD_DROPIN} drop-in",
        )
    else:
        yield _finding("SVC-JOURNALD-STORAGE", "pass")


def _has_systemd(root: SysRoot) -> bool:
    return root.path("/etc/systemd").is_dir() or any(root.listdir(d) for d in UNIT_DIRS)


def _cpu_affinity(ctx: AuditContext) -> Iterator[Finding]:
    """SVC-CPUAFFINITY: systemd starts every service on the housekeeping cores."""
    fid = "SVC-CPUAFFINITY"
    root = ctx.root
    if not _has_systemd(root):
        yield _finding(
            fid,
            "skip",
            "no systemd configuration in this root",
            evidence=(Evidence(SYSTEM_CONF, "(absent)", "systemd"),),
        )
        return
    cpusets = read_cpusets_for(root, [tree for _, tree in ctx.dtbs])
    configured = ctx.options.get("inference_cpus")
    override = ctx.options.get("inference_override")
    isolated = set(cpusets.isolated) | set(cpusets.isolcpus)
    if not configured and not override and not isolated & set(cpusets.online):
        yield _finding(
            fid, "pass", "no inference cores are isolated or configured: systemd may use every core"
        )
        return
    try:
        # isolcpus= on an image's boot command line counts as isolated here too (the kernel's
        # isolated file only exists on a running system).
        cpus = decide(
            cpusets, configured or sorted(isolated & set(cpusets.online)) or None, override=override
        )
    except ValueError as exc:
        yield _finding(fid, "skip", f"systemd CPUAffinity not checked: {exc}")
        return
    housekeeping = sorted(cpus.housekeeping)
    wanted = format_cpulist(housekeeping)
    try:
        current, text, where = manager_cpu_affinity(root)
    except ValueError as exc:
        current, text, where = None, f"unreadable ({exc})", SYSTEM_CONF
    else:
        text = text or "(not set: every core)"
    if current == housekeeping:
        yield _finding(
            fid,
            "pass",
            f"systemd starts services on the housekeeping cores {wanted}",
            evidence=(Evidence(where, text, f"CPUAffinity={wanted}"),),
        )
        return
    inference = format_cpulist(cpus.inference)
    if root.is_live:
        remedy = (
            f"write [Manager] CPUAffinity={wanted} (after an empty CPUAffinity= line) to "
            f"{AFFINITY_DROPIN}, then systemctl daemon-reexec or reboot"
        )
    else:
        remedy = f"edgectl provision --root {root.root} --inference-cpus {inference}"
    yield _finding(
        fid,
        "warn",
        f"systemd's CPUAffinity is not the housekeeping set {wanted}: services and their "
        f"children may run on the inference cores {inference}",
        evidence=(Evidence(where, text, f"CPUAffinity={wanted}"),),
        remedy=remedy,
        fixable=not root.is_live,
    )


def _journald_ratelimit(root: SysRoot) -> Iterator[Finding]:
    """SVC-JOURNALD-RATELIMIT: with persistent storage, an unlimited (0) or very high
    journald rate limit lets one chatty service keep a core and the disk busy."""
    fid = "SVC-JOURNALD-RATELIMIT"
    settings = journald_settings(root)
    storage = settings.get("Storage")
    if not storage or storage[0].lower() != "persistent":
        yield _finding(
            fid, "pass", "journald does not store logs persistently: rate limits matter less"
        )
        return
    interval = settings.get("RateLimitIntervalSec") or settings.get("RateLimitInterval")
    burst = settings.get("RateLimitBurst")
    problems, evidence = [], []
    try:
        seconds = parse_timespan(interval[0]) if interval else JOURNALD_INTERVAL_S
        count = int(burst[0]) if burst else JOURNALD_BURST
    except ValueError:
        yield _finding(fid, "pass", "journald rate limits are not numbers edged reads")
        return
    if interval and seconds == 0:
        problems.append("RateLimitIntervalSec=0 disables rate limiting")
        evidence.append(
            Evidence(
                interval[1],
                f"RateLimitIntervalSec={interval[0]}",
                f"RateLimitIntervalSec={JOURNALD_INTERVAL_S:g}s",
            )
        )
    if burst and count == 0:
        problems.append("RateLimitBurst=0 disables rate limiting")
        evidence.append(
            Evidence(burst[1], f"RateLimitBurst={burst[0]}", f"RateLimitBurst={JOURNALD_BURST}")
        )
    if not problems and count / seconds > JOURNALD_MAX_RATE:
        problems.append(
            f"{count} messages per {seconds:g} s is more than ten times the default rate"
        )
        # a rate above the default's needs one of them set; `storage` only narrows the type
        evidence.append(
            Evidence(
                (burst or interval or storage)[1],
                f"RateLimitBurst={count}, RateLimitIntervalSec={seconds:g}s",
                f"at most {JOURNALD_MAX_RATE:g} messages/s",
            )
        )
    if not problems:
        yield _finding(fid, "pass")
        return
    yield _finding(
        fid,
        "warn",
        "journald stores logs persistently with "
        + "; ".join(problems)
        + ": a burst of log writes competes with inference for I/O and CPU",
        evidence=(
            Evidence(
                storage[1], f"Storage={storage[0]}", "Storage=volatile or bounded rate limits"
            ),
            *evidence,
        ),
        remedy=f"set RateLimitIntervalSec={JOURNALD_INTERVAL_S:g}s and "
        f"RateLimitBurst={JOURNALD_BURST} (or Storage=volatile) in a "
        f"{_JOURNALD_DROPIN} drop-in",
    )
