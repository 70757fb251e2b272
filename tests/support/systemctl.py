"""A Debian-like image's systemd units on disk (`add_units`) and the fake behind `Systemctl`
(`FakeSystemctl`), for the service-trimming tests: this machine's units are only ever read,
its systemd never asked."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from sysconf.sysroot import SysRoot

HOST_UNITS = Path("/lib/systemd/system")

# Written when this machine has no copy (realistic Debian unit files, shortened).
FALLBACK_UNITS = {
    "apt-daily.timer": "[Unit]\nDescription=Daily apt download activities\n\n[Timer]\n"
    "OnCalendar=*-*-* 6,18:00\nRandomizedDelaySec=12h\nPersistent=true\n\n"
    "[Install]\nWantedBy=timers.target\n",
    "apt-daily-upgrade.timer": "[Unit]\nDescription=Daily apt upgrade and clean activities\n"
    "After=apt-daily.timer\n\n[Timer]\nOnCalendar=*-*-* 6:00\n"
    "RandomizedDelaySec=60m\nPersistent=true\n\n[Install]\n"
    "WantedBy=timers.target\n",
    "man-db.timer": "[Unit]\nDescription=Daily man-db regeneration\n"
    "Documentation=man:mandb(8)\n\n[Timer]\nOnCalendar=daily\n"
    "AccuracySec=12h\nPersistent=true\n\n[Install]\nWantedBy=timers.target\n",
    "fstrim.timer": "[Unit]\nDescription=Discard unused blocks once a week\n"
    "Documentation=man:fstrim\n\n[Timer]\nOnCalendar=weekly\n"
    "AccuracySec=1h\nPersistent=true\nRandomizedDelaySec=100min\n\n"
    "[Install]\nWantedBy=timers.target\n",
    "e2scrub_all.timer": "[Unit]\nDescription=Periodic ext4 Online Metadata Check for All "
    "Filesystems\n\n[Timer]\nOnCalendar=Sun *-*-* 03:10:00\n"
    "RandomizedDelaySec=60\nPersistent=true\n\n[Install]\n"
    "WantedBy=timers.target\n",
    "systemd-journald.service": "[Unit]\nDescription=Journal Service\nDefaultDependencies=no"
    "\n\n[Service]\nExecStart=/lib/systemd/systemd-journald\n"
    "Type=notify\nSockets=systemd-journald.socket\n",
}
WRITTEN_UNITS = {
    "unattended-upgrades.service": "[Unit]\nDescription=Unattended Upgrades Shutdown\n"
    "After=network.target local-fs.target\n\n[Service]\n"
    "ExecStart=/usr/share/unattended-upgrades/"
    "unattended-upgrade-shutdown --wait-for-signal\n"
    "TimeoutStopSec=1800\n\n[Install]\n"
    "WantedBy=multi-user.target\n",
    "cups.service": "[Unit]\nDescription=CUPS Scheduler\nAfter=sssd.service network.target\n"
    "\n[Service]\nExecStart=/usr/sbin/cupsd -l\nType=notify\nRestart=on-failure"
    "\n\n[Install]\nAlso=cups.socket cups.path\nWantedBy=printer.target "
    "multi-user.target\n",
    "avahi-daemon.service": "[Unit]\nDescription=Avahi mDNS/DNS-SD Stack\n"
    "Requires=avahi-daemon.socket\n\n[Service]\nType=dbus\n"
    "BusName=org.freedesktop.Avahi\nExecStart=/usr/sbin/avahi-daemon -s"
    "\n\n[Install]\nWantedBy=multi-user.target\n"
    "Also=avahi-daemon.socket\nAlias=dbus-org.freedesktop.Avahi.service"
    "\n",
    "bluetooth.service": "[Unit]\nDescription=Bluetooth service\n\n[Service]\nType=dbus\n"
    "BusName=org.bluez\nExecStart=/usr/libexec/bluetooth/bluetoothd\n\n"
    "[Install]\nWantedBy=bluetooth.target\n",
    "ssh.service": "[Unit]\nDescription=OpenBSD Secure Shell server\n\n[Service]\n"
    "ExecStart=/usr/sbin/sshd -D $SSHD_OPTS\n\n[Install]\n"
    "WantedBy=multi-user.target\nAlias=sshd.service\n",
    "getty@.service": "[Unit]\nDescription=Getty on %I\n\n[Service]\n"
    "ExecStart=-/sbin/agetty -o '-p -- \\\\u' --noclear - $TERM\n\n"
    "[Install]\nWantedBy=getty.target\n",
    "systemd-networkd.service": "[Unit]\nDescription=Network Configuration\n\n[Service]\n"
    "ExecStart=/lib/systemd/systemd-networkd\n\n[Install]\n"
    "WantedBy=multi-user.target\n",
    "rsyslog.service": "[Unit]\nDescription=System Logging Service\nRequires=syslog.socket\n"
    "\n[Service]\nType=notify\nExecStart=/usr/sbin/rsyslogd -n -iNONE\n\n"
    "[Install]\nWantedBy=multi-user.target\nAlias=syslog.service\n",
}
# (wants folder, unit, the unit file the enable symlink points at)
ENABLED = [
    ("timers.target.wants", "apt-daily.timer", "apt-daily.timer"),
    ("timers.target.wants", "apt-daily-upgrade.timer", "apt-daily-upgrade.timer"),
    ("timers.target.wants", "man-db.timer", "man-db.timer"),
    ("timers.target.wants", "fstrim.timer", "fstrim.timer"),
    ("timers.target.wants", "e2scrub_all.timer", "e2scrub_all.timer"),
    ("multi-user.target.wants", "unattended-upgrades.service", "unattended-upgrades.service"),
    ("multi-user.target.wants", "cups.service", "cups.service"),
    ("multi-user.target.wants", "avahi-daemon.service", "avahi-daemon.service"),
    ("bluetooth.target.wants", "bluetooth.service", "bluetooth.service"),
    ("multi-user.target.wants", "ssh.service", "ssh.service"),
    ("multi-user.target.wants", "systemd-networkd.service", "systemd-networkd.service"),
    ("multi-user.target.wants", "rsyslog.service", "rsyslog.service"),
    ("getty.target.wants", "getty@tty1.service", "getty@.service"),
]
EXPECTED_TRIM = {
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "man-db.timer",
    "fstrim.timer",
    "e2scrub_all.timer",
    "unattended-upgrades.service",
    "cups.service",
    "avahi-daemon.service",
}  # bluetooth is masked already


def add_units(root: Path) -> Path:
    """A Debian-like image's units: vendor files (copied from this machine where present),
    enable symlinks in /etc/systemd/system/*.wants, one mask, one linked unit, one override
    file, and journald forwarding to rsyslog."""
    lib = root / "lib" / "systemd" / "system"
    etc = root / "etc" / "systemd" / "system"
    lib.mkdir(parents=True, exist_ok=True)
    etc.mkdir(parents=True, exist_ok=True)
    for name, text in FALLBACK_UNITS.items():
        host = HOST_UNITS / name
        if host.is_file():
            shutil.copyfile(host, lib / name)
        else:
            (lib / name).write_text(text)
    for name, text in WRITTEN_UNITS.items():
        (lib / name).write_text(text)
    for folder, unit, target in ENABLED:
        (etc / folder).mkdir(exist_ok=True)
        os.symlink(f"/lib/systemd/system/{target}", etc / folder / unit)
    os.symlink("/lib/systemd/system/rsyslog.service", etc / "syslog.service")  # its alias
    os.symlink("/dev/null", etc / "bluetooth.service")  # masked by the admin already
    os.symlink("/lib/systemd/system/fstrim.timer", etc / "fstrim.timer")  # a linked unit
    override = etc / "avahi-daemon.service"  # an admin's full override copy, mode 0640
    override.write_text(WRITTEN_UNITS["avahi-daemon.service"].replace("-s", "-s --no-rlimits"))
    override.chmod(0o640)
    (root / "etc" / "systemd" / "journald.conf").write_text(
        "#  This file is part of systemd.\n[Journal]\nStorage=persistent\n"
        "#RateLimitBurst=10000\nForwardToSyslog=yes\n"
    )
    return root


class LiveLooking(SysRoot):
    """A folder that takes the live system's paths (`systemctl mask --now`, not image links),
    with FakeSystemctl in front of it."""

    @property
    def is_live(self) -> bool:  # a folder the code must treat as `/`
        return True


class FakeSystemctl:
    """The runner behind `Systemctl` in tests: records every command, answers `is-active`
    from `active`, and fails the commands listed in `fail` (argv tail -> exit code). This
    machine's systemd is never asked anything."""

    def __init__(self, active: set[str] = frozenset(), fail: dict | None = None) -> None:
        self.active = set(active)
        self.fail = dict(fail or {})
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv, timeout: float) -> subprocess.CompletedProcess:
        args = tuple(a for a in argv[1:] if a != "--no-ask-password")
        self.calls.append(args)
        if args in self.fail:
            return subprocess.CompletedProcess(
                argv, self.fail[args], "", f"Failed to {args[0]}: Access denied\n"
            )
        if args[0] == "is-active":
            state = "active" if args[1] in self.active else "inactive"
            return subprocess.CompletedProcess(
                argv, 0 if state == "active" else 3, state + "\n", ""
            )
        if args[0] == "stop":
            self.active.discard(args[1])
        if args[0] == "start":
            self.active.add(args[1])
        return subprocess.CompletedProcess(argv, 0, "", "")


# What the live-looking tests start FakeSystemctl with as active: units add_units enables.
RUNNING = {"avahi-daemon.service", "cups.service", "apt-daily.timer"}
