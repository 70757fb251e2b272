"""Image roots as `edgectl provision --root` and the audit meet them: a 4-core board root
(tests/support/roots.py) with a Debian-like image's units, boot config and folders."""

from __future__ import annotations

from pathlib import Path

from sysconf.provision import WANTS
from tests.support.roots import board_root
from tests.support.systemctl import add_units

GRUB = (
    "GRUB_DEFAULT=0\nGRUB_TIMEOUT=5\nGRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || "
    'echo Debian`\nGRUB_CMDLINE_LINUX_DEFAULT="quiet"\nGRUB_CMDLINE_LINUX=""\n'
)
PROVISION = ["provision", "--inference-cpus", "3", "--json"]  # the last of image()'s 4 cores


def image_root(tmp_path: Path) -> Path:
    """board_root + the Debian-like units only."""
    return add_units(board_root(tmp_path / "root", cpus=4))


def image(tmp_path: Path, boot: str = "grub") -> Path:
    """board_root + Debian-like units (enabled timers) + boot config + the folders a Debian
    image has (sysctl.d, system.conf.d, multi-user.target.wants)."""
    root = image_root(tmp_path)
    if boot == "grub":
        (root / "etc/default/grub").write_text(GRUB)
    else:
        (root / "boot/firmware").mkdir(parents=True)
        (root / "boot/firmware/cmdline.txt").write_text(
            "console=serial0,115200 root=PARTUUID=4e639091-02 rootfstype=ext4 rootwait\n"
        )
    (root / "etc/sysctl.d").mkdir()
    (root / "etc/systemd/system.conf.d").mkdir()
    (root / WANTS.lstrip("/")).mkdir(exist_ok=True)
    return root
