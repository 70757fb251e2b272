"""Services and timers that wake up and steal cores, read from unit files in a root.

Everything here only READS the root (live `/` or an image folder): unit files in systemd's
search order, their enable symlinks (`*.wants/`, `*.requires/`) and masks (a symlink to
/dev/null in /etc/systemd/system). Trimming is planned as `Change(kind="mask")` records that
`sysconf.changes.Journal` applies into an image root; on a live root the journal refuses them
(masking a running system needs `systemctl mask --now`, which edged does not run).

Options read from `AuditContext.options` (from the config's [audit] table):
  trim  list[str]  extra units to trim (a name without a suffix means `<name>.service`)
  keep  list[str]  units never to trim
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sysconf.changes import Change
from sysconf.findings import AuditContext, Evidence, Finding, register
from sysconf.sysroot import SysRoot

# systemd's unit search order for the system manager (the first match wins).
UNIT_DIRS = (
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)
MASK_DIR = "/etc/systemd/system"
MASK_TARGET = "/dev/null"
UNIT_SUFFIXES = (".service", ".timer", ".socket", ".path", ".target", ".mount", ".automount",
                 ".swap", ".slice", ".scope", ".device")

# Units that wake up periodically or sit beside inference on a headless edge device.
TRIM_CANDIDATES = {
    "apt-daily.timer": "downloads package lists daily (apt, dpkg locks, CPU and I/O bursts)",
    "apt-daily-upgrade.timer": "installs upgrades daily (long CPU and I/O bursts)",
    "man-db.timer": "rebuilds the man page index daily",
    "fstrim.timer": "runs fstrim weekly (I/O stalls on flash)",
    "e2scrub_all.timer": "scrubs ext4 metadata weekly (LVM snapshots, I/O)",
    "unattended-upgrades.service": "upgrades packages in the background",
    "packagekit.service": "package management daemon, wakes on D-Bus",
    "snapd.service": "snap daemon: refreshes, mounts, periodic wake-ups",
    "ModemManager.service": "probes serial ports and modems",
    "bluetooth.service": "Bluetooth daemon",
    "avahi-daemon.service": "mDNS responder, wakes on multicast traffic",
    "cups.service": "print server",
}

# Never proposed for trimming, by stem (any suffix) or template prefix ("getty@").
PROTECTED = frozenset({
    "systemd-journald", "systemd-udevd", "dbus", "dbus-broker", "systemd-logind",
    "systemd-networkd", "NetworkManager", "networking", "systemd-resolved",
    "systemd-timesyncd", "chrony", "chronyd", "ntp", "ntpsec", "ssh", "sshd", "getty@",
    "serial-getty@", "edged", "edged-tune",
})


def unit_name(name: str) -> str:
    """`cups` -> `cups.service`; names with a unit suffix stay as they are."""
    name = name.strip()
    return name if name.endswith(UNIT_SUFFIXES) else f"{name}.service"


def is_protected(unit: str) -> bool:
    unit = unit_name(unit)
    stem = unit.rsplit(".", 1)[0]
    if "@" in stem:
        return stem.split("@", 1)[0] + "@" in PROTECTED
    return stem in PROTECTED


@dataclass(frozen=True)
class UnitState:
    name: str
    path: str | None  # the unit file as on the device (first in search order), None: none
    enabled_by: tuple[str, ...]  # enable symlinks, as on the device
    masked: bool

    @property
    def enabled(self) -> bool:
        return bool(self.enabled_by) and not self.masked


def _is_link_to(root: SysRoot, path: str, target: str) -> bool:
    try:
        return os.readlink(root.path(path)) == target
    except OSError:
        return False


def is_masked(root: SysRoot, unit: str) -> bool:
    return any(_is_link_to(root, f"{d}/{unit}", MASK_TARGET) for d in ("/etc/systemd/system",
                                                                        "/run/systemd/system"))


def enable_links(root: SysRoot) -> dict[str, list[str]]:
    """unit name -> enable symlinks (in any unit dir's `*.wants/` or `*.requires/`)."""
    links: dict[str, list[str]] = {}
    for folder in UNIT_DIRS:
        for sub in root.listdir(folder):
            if not sub.endswith((".wants", ".requires")):
                continue
            where = f"{folder}/{sub}"
            for name in root.listdir(where):
                if root.path(f"{where}/{name}").is_symlink():
                    links.setdefault(name, []).append(f"{where}/{name}")
    return links


def unit_state(root: SysRoot, unit: str, links: dict[str, list[str]] | None = None
               ) -> UnitState:
    unit = unit_name(unit)
    if links is None:
        links = enable_links(root)
    path = next((f"{d}/{unit}" for d in UNIT_DIRS
                 if root.path(f"{d}/{unit}").is_symlink() or root.path(f"{d}/{unit}").exists()),
                None)
    return UnitState(unit, path, tuple(links.get(unit, ())), is_masked(root, unit))


def trim_list(keep: Iterable[str] = (), extra: Iterable[str] = ()) -> list[str]:
    """The candidates plus `extra`, minus `keep` and every protected unit."""
    kept = {unit_name(u) for u in keep}
    units = list(TRIM_CANDIDATES) + [unit_name(u) for u in extra]
    seen: set[str] = set()
    result = []
    for unit in units:
        if unit in seen or unit in kept or is_protected(unit):
            continue
        seen.add(unit)
        result.append(unit)
    return result


def trim_candidates(root: SysRoot, keep: Iterable[str] = (), extra: Iterable[str] = ()
                    ) -> list[UnitState]:
    """Enabled, unmasked units of the trim list (candidates + extra - keep - protected)."""
    links = enable_links(root)
    states = [unit_state(root, unit, links) for unit in trim_list(keep, extra)]
    return [s for s in states if s.enabled]


def plan_trim(root: SysRoot, keep: Iterable[str] = (), extra: Iterable[str] = ()
              ) -> list[Change]:
    """A mask (symlink /etc/systemd/system/<unit> -> /dev/null) per enabled candidate. On a
    live root the same changes are planned; the journal refuses to apply them there."""
    changes = []
    for state in trim_candidates(root, keep, extra):
        path = f"{MASK_DIR}/{state.name}"
        target = root.path(path)
        if target.is_symlink():
            old: str | None = os.readlink(target)
        elif target.exists():
            old = root.read_text(path)
        else:
            old = None
        why = TRIM_CANDIDATES.get(state.name, "listed in the config's [audit] trim")
        reason = f"mask {state.name}: {why}"
        if root.is_live:
            reason += f" (live masking: run systemctl mask --now {state.name})"
        changes.append(Change("mask", path, old, MASK_TARGET, reason))
    return changes


# -- journald ---------------------------------------------------------------------------------

JOURNALD_CONF = "/etc/systemd/journald.conf"
JOURNALD_DROPINS = ("/usr/lib/systemd/journald.conf.d", "/lib/systemd/journald.conf.d",
                    "/run/systemd/journald.conf.d", "/etc/systemd/journald.conf.d")


def journald_settings(root: SysRoot) -> dict[str, tuple[str, str]]:
    """[Journal] key -> (value, file it came from); drop-ins override the main file, sorted by
    file name across folders as systemd does (later wins)."""
    files = [JOURNALD_CONF]
    dropins: dict[str, str] = {}
    for folder in JOURNALD_DROPINS:
        for name in root.listdir(folder):
            if name.endswith(".conf"):
                dropins[name] = f"{folder}/{name}"  # a later folder overrides a same name
    files += [dropins[name] for name in sorted(dropins)]
    settings: dict[str, tuple[str, str]] = {}
    for path in files:
        text = root.read_text(path)
        if text is None:
            continue
        section = None
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line.strip("[]").strip()
                continue
            if section == "Journal" and "=" in line:
                key, value = line.split("=", 1)
                settings[key.strip()] = (value.strip(), path)
    return settings


def _yes(value: str) -> bool:
    return value.lower() in ("yes", "true", "on", "1", "y", "t")


# -- the check --------------------------------------------------------------------------------

def _apply_command(ctx: AuditContext) -> str:
    cmd = "edgectl apply --trim"
    if not ctx.root.is_live:
        cmd += f" --root {ctx.root.root}"
    return cmd


@register("services", "SVC")
def check_services(ctx: AuditContext) -> Iterator[Finding]:
    root = ctx.root
    keep = tuple(ctx.options.get("keep", ()))
    extra = tuple(ctx.options.get("trim", ()))
    if not any(root.listdir(d) for d in UNIT_DIRS):
        yield Finding("SVC-TRIM", "warn", "skip", "no systemd unit folders in this root",
                      evidence=(Evidence(MASK_DIR, "(absent)", "systemd unit files"),))
        return

    asked_protected = [unit_name(u) for u in extra if is_protected(u)]
    for unit in asked_protected:
        yield Finding("SVC-PROTECTED", "warn", "warn",
                      f"{unit} is protected and is never trimmed (listed in [audit] trim)",
                      evidence=(Evidence("[audit] trim", unit, "not a protected unit"),),
                      remedy=f"remove {unit} from [audit] trim", subject=unit)

    candidates = trim_candidates(root, keep, extra)
    for state in candidates:
        why = TRIM_CANDIDATES.get(state.name, "listed in the config's [audit] trim")
        if root.is_live:
            remedy = f"systemctl mask --now {state.name}"
        else:
            remedy = f"{_apply_command(ctx)} (masks {MASK_DIR}/{state.name} -> {MASK_TARGET})"
        yield Finding(
            "SVC-TRIM", "warn", "warn", f"{state.name} is enabled: {why}",
            evidence=(Evidence(state.enabled_by[0], "enabled", "masked or disabled"),),
            remedy=remedy, fixable=not root.is_live, subject=state.name,
        )
    if not candidates:
        yield Finding("SVC-TRIM", "warn", "pass",
                      "no periodic or idle service on the trim list is enabled")

    settings = journald_settings(root)
    forward = settings.get("ForwardToSyslog")
    rsyslog = unit_state(root, "rsyslog.service")
    if rsyslog.enabled and forward and _yes(forward[0]):
        yield Finding(
            "SVC-DOUBLE-LOGGING", "warn", "warn",
            "rsyslog is enabled while journald forwards to syslog: every message is "
            "written twice",
            evidence=(Evidence(forward[1], f"ForwardToSyslog={forward[0]}",
                               "ForwardToSyslog=no"),
                      Evidence(rsyslog.enabled_by[0], "rsyslog.service enabled",
                               "one logger")),
            remedy="set ForwardToSyslog=no in a /etc/systemd/journald.conf.d/ drop-in, or "
                   "disable rsyslog",
            subject="rsyslog.service",
        )
    else:
        yield Finding("SVC-DOUBLE-LOGGING", "warn", "pass", "messages are logged once")

    storage = settings.get("Storage")
    burst = settings.get("RateLimitBurst")
    if storage and storage[0].lower() == "persistent" and burst is None:
        yield Finding(
            "SVC-JOURNALD-STORAGE", "info", "warn",
            "journald stores logs persistently with the default rate limit: a chatty "
            "service keeps the disk and a core busy",
            evidence=(Evidence(storage[1], f"Storage={storage[0]}, no RateLimitBurst",
                               "Storage=volatile, or an explicit RateLimitBurst"),),
            remedy="set RateLimitIntervalSec= and RateLimitBurst= (or Storage=volatile) in a "
                   "/etc/systemd/journald.conf.d/ drop-in",
        )
    else:
        yield Finding("SVC-JOURNALD-STORAGE", "info", "pass",
                      "journald storage and rate limits are bounded")
