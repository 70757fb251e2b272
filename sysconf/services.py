"""Services and timers that wake up and steal cores, read from unit files in a root.

Everything here only READS the root (live `/` or an image folder): unit files in systemd's
search order, their enable symlinks (`*.wants/`, `*.requires/`) and masks (a symlink to
/dev/null in /etc/systemd/system). Trimming is planned as `Change(kind="mask")` records that
`sysconf.changes.Journal` applies: into an image root as the symlink alone; on the live root as
`systemctl mask --now` (the same symlink, then daemon-reload and stop through
`sysconf.systemctl`), and revert unmasks and starts again what was running.

The SVC audit check built on these facts is `sysconf.audit.checks.services`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sysconf.changes import Change
from sysconf.cpulist import parse_cpulist
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
UNIT_SUFFIXES = (
    ".service",
    ".timer",
    ".socket",
    ".path",
    ".target",
    ".mount",
    ".automount",
    ".swap",
    ".slice",
    ".scope",
    ".device",
)

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
PROTECTED = frozenset(
    {
        "systemd-journald",
        "systemd-udevd",
        "dbus",
        "dbus-broker",
        "systemd-logind",
        "systemd-networkd",
        "NetworkManager",
        "networking",
        "systemd-resolved",
        "systemd-timesyncd",
        "chrony",
        "chronyd",
        "ntp",
        "ntpsec",
        "ssh",
        "sshd",
        "getty@",
        "serial-getty@",
        "edged",
        "edged-tune",
    }
)


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
    return any(
        _is_link_to(root, f"{d}/{unit}", MASK_TARGET)
        for d in ("/etc/systemd/system", "/run/systemd/system")
    )


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


def unit_state(root: SysRoot, unit: str, links: dict[str, list[str]] | None = None) -> UnitState:
    unit = unit_name(unit)
    if links is None:
        links = enable_links(root)
    path = next(
        (
            f"{d}/{unit}"
            for d in UNIT_DIRS
            if root.path(f"{d}/{unit}").is_symlink() or root.path(f"{d}/{unit}").exists()
        ),
        None,
    )
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


def trim_candidates(
    root: SysRoot, keep: Iterable[str] = (), extra: Iterable[str] = ()
) -> list[UnitState]:
    """Enabled, unmasked units of the trim list (candidates + extra - keep - protected)."""
    links = enable_links(root)
    states = [unit_state(root, unit, links) for unit in trim_list(keep, extra)]
    return [s for s in states if s.enabled]


def plan_trim(root: SysRoot, keep: Iterable[str] = (), extra: Iterable[str] = ()) -> list[Change]:
    """A mask (symlink /etc/systemd/system/<unit> -> /dev/null) per enabled candidate. On a
    live root the same changes are planned; the journal also stops the unit there."""
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
            reason += (
                " (live: as systemctl mask --now: masked, daemon-reload, stopped; "
                "revert unmasks it and starts it if it ran)"
            )
        changes.append(Change("mask", path, old, MASK_TARGET, reason))
    return changes


# -- journald ---------------------------------------------------------------------------------

JOURNALD_CONF = "/etc/systemd/journald.conf"
JOURNALD_DROPINS = (
    "/usr/lib/systemd/journald.conf.d",
    "/lib/systemd/journald.conf.d",
    "/run/systemd/journald.conf.d",
    "/etc/systemd/journald.conf.d",
)


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


def _unit_conf(
    root: SysRoot, main: str, dropin_dirs: Sequence[str], section: str
) -> list[tuple[str, str, str]]:
    """Every `key=value` of `[section]` in `main` then its drop-ins (sorted by file name across
    folders, a same name in a later folder replacing the earlier one), in the order systemd
    reads them: (key, value, file)."""
    dropins: dict[str, str] = {}
    for folder in dropin_dirs:
        for name in root.listdir(folder):
            if name.endswith(".conf"):
                dropins[name] = f"{folder}/{name}"
    entries = []
    for path in [main, *(dropins[name] for name in sorted(dropins))]:
        text = root.read_text(path)
        if text is None:
            continue
        current = None
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                current = line.strip("[]").strip()
                continue
            if current == section and "=" in line:
                key, value = line.split("=", 1)
                entries.append((key.strip(), value.strip(), path))
    return entries


SYSTEM_CONF = "/etc/systemd/system.conf"
# Low to high priority: a drop-in of the same name in a later folder replaces the earlier one.
SYSTEM_CONF_DROPINS = (
    "/usr/lib/systemd/system.conf.d",
    "/lib/systemd/system.conf.d",
    "/usr/local/lib/systemd/system.conf.d",
    "/run/systemd/system.conf.d",
    "/etc/systemd/system.conf.d",
)
AFFINITY_DROPIN = "/etc/systemd/system.conf.d/90-edged-cpuaffinity.conf"


def manager_cpu_affinity(root: SysRoot) -> tuple[list[int] | None, str, str]:
    """systemd's `[Manager] CPUAffinity=` as systemd-system.conf(5) reads it: assignments
    merge, an empty one resets the mask (so a later drop-in wins when it starts with an empty
    `CPUAffinity=`). Returns (CPUs or None when unset, the text as written, the file of the
    last assignment). Raises ValueError for a value systemd would not take as a CPU list."""
    cpus: set[int] | None = None
    texts: list[str] = []
    where = SYSTEM_CONF
    for key, value, path in _unit_conf(root, SYSTEM_CONF, SYSTEM_CONF_DROPINS, "Manager"):
        if key != "CPUAffinity":
            continue
        where = path
        if not value:
            cpus, texts = None, []
            continue
        texts.append(value)
        cpus = (cpus or set()) | set(parse_cpulist(",".join(value.replace(",", " ").split())))
    return (None if cpus is None else sorted(cpus)), " ".join(texts), where


_TIME_UNITS = {
    "us": 1e-6,
    "usec": 1e-6,
    "ms": 1e-3,
    "msec": 1e-3,
    "s": 1,
    "sec": 1,
    "second": 1,
    "seconds": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "minutes": 60,
    "h": 3600,
    "hr": 3600,
    "hour": 3600,
    "hours": 3600,
    "d": 86400,
    "day": 86400,
    "days": 86400,
}


def parse_timespan(text: str) -> float:
    """systemd.time(7) spans in seconds: "30s", "1min 30s", "500ms", a bare number = s."""
    text = text.strip()
    if not text:
        raise ValueError("empty time span")
    total, number, unit = 0.0, "", ""
    for char in text + " ":
        if char.isdigit() or char == ".":
            if unit:
                total += float(number) * _unit_seconds(unit)
                number, unit = "", ""
            number += char
        elif char.isspace():
            continue
        else:
            if not number:
                raise ValueError(f"bad time span {text!r}")
            unit += char
    if number:
        total += float(number) * (_unit_seconds(unit) if unit else 1)
    return total


def _unit_seconds(unit: str) -> float:
    if unit not in _TIME_UNITS:
        raise ValueError(f"unknown time unit {unit!r}")
    return _TIME_UNITS[unit]


# journald's defaults (systemd >= 240): 10000 messages per 30 s per service.
JOURNALD_INTERVAL_S, JOURNALD_BURST = 30.0, 10000
# "Very high": more than ten times the default rate (messages per second).
JOURNALD_MAX_RATE = 10 * JOURNALD_BURST / JOURNALD_INTERVAL_S
