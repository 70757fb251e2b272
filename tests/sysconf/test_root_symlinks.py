"""Symlinks in an image root (issue 16): `edgectl apply/revert/provision --root` never write
through them out of the root.

Every root here is a temporary folder; the host files a crafted image aims at ("victims") are
temporary files beside it, and each test asserts they are unchanged. Links under /proc and
/sys of an image that are absolute or leave that folder are refused (exit 2, nothing written);
links elsewhere are data, resolved inside the root: apply edits the file they lead to and
revert leaves them links, byte for byte (`tree_state` compares link targets too).
"""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import pytest

from edged.cli.main import main
from sysconf.changes import JOURNAL_NAME, Change, Journal
from sysconf.confined import ConfinedRoot, PathRefused
from sysconf.journals import Journals
from sysconf.sysroot import SysRoot
from tests.support.images import GRUB, PROVISION, image
from tests.support.roots import board_root, tree_state

STATE = "var/lib/edged"
SYSCTL = "proc/sys/kernel/timer_migration"
APPLY = ["apply", "--inference-cpus", "3", "--json"]


def board(tmp_path: Path) -> Path:
    """A 4-core board root with a sysctl, a workqueue mask and a GRUB config to change."""
    root = board_root(tmp_path / "root", cpus=4)
    for rel, text in (
        (SYSCTL, "1\n"),
        ("proc/sys/vm/stat_interval", "1\n"),
        ("sys/devices/virtual/workqueue/cpumask", "f\n"),
        ("etc/default/grub", GRUB),
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def victim(tmp_path: Path, name: str = "victim", text: str = "1\n") -> Path:
    """A host file outside the root that a crafted image points at."""
    path = tmp_path / "host" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def host_state(tmp_path: Path) -> dict:
    return tree_state(tmp_path / "host", exclude=())


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def link(path: Path, target: str | Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)


# -- /proc and /sys: refused ----------------------------------------------------------------


@pytest.mark.parametrize("shape", ["absolute", "relative-out", "folder", "sys"])
def test_apply_refuses_a_kernel_file_linked_to_a_host_file(
    tmp_path: Path, capsys, shape: str
) -> None:
    root = board(tmp_path)
    if shape == "absolute":
        where = root / SYSCTL
        link(where, victim(tmp_path))
    elif shape == "relative-out":  # ../../.. past the root's top, as the host would follow it
        where = root / SYSCTL
        link(where, os.path.relpath(victim(tmp_path), where.parent))
    elif shape == "folder":  # a link on the way: proc/sys/kernel -> a host folder
        victim(tmp_path, "timer_migration")
        where = root / "proc/sys/kernel"
        for child in where.iterdir():
            child.unlink()
        where.rmdir()
        link(where, tmp_path / "host")
    else:
        where = root / "sys/devices/virtual/workqueue/cpumask"
        link(where, victim(tmp_path, text="f\n"))
    before, host = tree_state(root, exclude=()), host_state(tmp_path)

    code, _, err = run(capsys, *APPLY, "--root", str(root))
    assert code == 2, err
    assert str(where) in err and "symlink" in err  # names the link
    assert host_state(tmp_path) == host  # the host file is untouched
    assert tree_state(root, exclude=()) == before  # nothing written, not even a journal


def test_provision_refuses_a_kernel_file_linked_to_a_host_file(tmp_path: Path, capsys) -> None:
    root = image(tmp_path)
    where = root / SYSCTL
    link(where, victim(tmp_path))
    before, host = tree_state(root, exclude=()), host_state(tmp_path)
    code, _, err = run(capsys, *PROVISION, "--root", str(root))
    assert code == 2, err
    assert str(where) in err
    assert host_state(tmp_path) == host and tree_state(root, exclude=()) == before


def test_the_journal_refuses_such_a_root_before_anything_is_written(tmp_path: Path) -> None:
    root = board(tmp_path)
    link(root / SYSCTL, victim(tmp_path))
    before, host = tree_state(root, exclude=()), host_state(tmp_path)
    grub = Change("cmdline", "/etc/default/grub", GRUB, GRUB + "# isolated\n", "boot")
    sysctl = Change("sysctl", "/" + SYSCTL, "1\n", "0", "test")
    with pytest.raises(PathRefused, match="timer_migration"):
        Journals(SysRoot(root)).apply([grub, sysctl])
    with pytest.raises(PathRefused):
        Journal(SysRoot(root)).apply([sysctl])
    assert tree_state(root, exclude=()) == before and host_state(tmp_path) == host


def test_each_path_is_checked_too_not_only_the_root(tmp_path: Path, monkeypatch) -> None:
    """The per-path check at the one place writes happen (a link made after the root was
    checked): the persistent change that would come first is not written either."""
    root = board(tmp_path)
    link(root / SYSCTL, victim(tmp_path))
    monkeypatch.setattr(ConfinedRoot, "check_kernel_links", lambda self: None)
    before, host = tree_state(root, exclude=()), host_state(tmp_path)
    grub = Change("cmdline", "/etc/default/grub", GRUB, GRUB + "# isolated\n", "boot")
    with pytest.raises(PathRefused, match="timer_migration"):
        Journals(SysRoot(root)).apply([grub, Change("sysctl", "/" + SYSCTL, "1\n", "0", "t")])
    assert tree_state(root, exclude=()) == before and host_state(tmp_path) == host


def test_sysfs_shaped_links_are_followed_inside_sys(tmp_path: Path) -> None:
    """sysfs's own links (relative, inside /sys) are what fixture roots copy: followed."""
    root = tmp_path / "root"
    policy = root / "sys/devices/system/cpu/cpufreq/policy2"
    policy.mkdir(parents=True)
    (policy / "scaling_governor").write_text("schedutil\n")
    link(root / "sys/devices/system/cpu/cpu2/cpufreq", "../cpufreq/policy2")
    before = tree_state(root)
    journal = Journal(SysRoot(root))
    path = "/sys/devices/system/cpu/cpu2/cpufreq/scaling_governor"
    assert journal.apply([Change("governor", path, "schedutil\n", "performance", "t")]).applied
    assert (policy / "scaling_governor").read_text() == "performance"
    assert [r.get("target") for r in journal.records() if r["op"] == "set"] == [
        "/sys/devices/system/cpu/cpufreq/policy2/scaling_governor"
    ]
    journal.revert()
    assert tree_state(root) == before


# -- crafted journals -------------------------------------------------------------------------


def crafted_journal(root: Path, records: list[dict]) -> Path:
    """A journal as check_trusted wants it (owned by us, 0600 in a 0755 folder) whose records
    are plain absolute paths: only the links in the root make them dangerous."""
    folder = root / STATE
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    path = folder / JOURNAL_NAME
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    path.chmod(0o600)
    return path


CRON = "* * * * * root sh -c 'echo owned > /tmp/owned'\n"


def test_revert_of_a_crafted_journal_through_a_kernel_link_is_refused(
    tmp_path: Path, capsys
) -> None:
    root = board(tmp_path)
    link(root / SYSCTL, victim(tmp_path))
    journal = crafted_journal(
        root,
        [
            {"op": "set", "path": "/" + SYSCTL, "old": CRON, "new": "0", "kind": "sysctl"},
            {"op": "done"},
        ],
    )
    before, host = tree_state(root, exclude=()), host_state(tmp_path)

    code, _, err = run(capsys, "revert", "--root", str(root))
    assert code == 2, err
    assert str(root / SYSCTL) in err
    assert host_state(tmp_path) == host
    assert tree_state(root, exclude=()) == before  # the journal is not even moved aside
    assert journal.exists()


@pytest.mark.parametrize("shape", ["absolute", "relative-out", "target"])
def test_revert_of_a_crafted_journal_never_writes_outside_the_root(
    tmp_path: Path, capsys, shape: str
) -> None:
    """etc/cron.d links to a host folder: the records' paths are resolved inside the root,
    where that folder does not exist, so revert fails (exit 1) and writes nothing."""
    root = board(tmp_path)
    crontab = victim(tmp_path, "crontab", "# the host's own\n")
    cron = root / "etc/cron.d"
    link(
        cron,
        crontab.parent if shape != "relative-out" else os.path.relpath(crontab.parent, cron.parent),
    )
    records = [
        {"op": "set", "path": "/etc/cron.d/crontab", "old": CRON, "new": "x", "kind": "cmdline"},
        {"op": "set", "path": "/etc/cron.d/edged", "old": CRON, "new": "x", "kind": "cmdline"},
    ]
    if shape == "target":  # a "target" field pointing through the link
        records = [
            {
                "op": "set",
                "path": "/etc/default/grub",
                "target": "/etc/cron.d/crontab",
                "old": CRON,
                "new": "x",
                "kind": "cmdline",
            }
        ]
    crafted_journal(root, [*records, {"op": "done"}])
    host = host_state(tmp_path)

    code, out, err = run(capsys, "revert", "--root", str(root), "--json")
    assert host_state(tmp_path) == host
    assert code == 1, (out, err)  # "failed": the folder is not in the root
    assert all(r["action"].startswith("failed") for r in json.loads(out)["reverted"])


def test_a_journal_folder_linked_out_of_the_root_stays_in_the_root(tmp_path: Path, capsys) -> None:
    """var/lib/edged -> a host folder holding a (trusted-looking) journal: revert --root
    must neither act on that journal nor move it aside; apply keeps its journal inside."""
    root = board(tmp_path)
    outside = tmp_path / "host" / "state"
    outside.mkdir(parents=True, mode=0o755)
    (outside / JOURNAL_NAME).write_text(
        json.dumps({"op": "set", "path": "/etc/default/grub", "old": CRON, "new": "x"}) + "\n"
    )
    (outside / JOURNAL_NAME).chmod(0o600)
    link(root / STATE, outside)
    host = host_state(tmp_path)

    code, out, err = run(capsys, "revert", "--root", str(root))
    assert code == 0, err
    assert "nothing to revert" in out
    assert (root / "etc/default/grub").read_text() == GRUB
    code, out, err = run(capsys, *APPLY, "--root", str(root))
    assert code == 0, err
    assert host_state(tmp_path) == host
    inside = root / outside.relative_to("/") / JOURNAL_NAME  # the link, resolved in the root
    assert json.loads(out)["applied"] and inside.is_file()


def test_a_random_bytes_journal_names_the_file(tmp_path: Path, capsys) -> None:
    root = board(tmp_path)
    journal = root / STATE / JOURNAL_NAME
    journal.parent.mkdir(parents=True)
    journal.write_bytes(b'{"op": "done"}\n' + random.Random(16).randbytes(4096))
    journal.chmod(0o600)
    before = tree_state(root, exclude=())

    with pytest.raises(ValueError, match=f"^{journal}: line 2 ") as caught:
        Journal(SysRoot(root)).records()
    assert not isinstance(caught.value, UnicodeDecodeError)
    for command in (["revert"], APPLY):
        code, _, err = run(capsys, *command, "--root", str(root))
        assert code == 2, err
        assert str(journal) in err and "not a journal record" in err
    assert tree_state(root, exclude=()) == before


# -- links elsewhere are data ----------------------------------------------------------------


@pytest.mark.parametrize("target", ["../../real/grub", "/real/grub"])
def test_apply_edits_what_a_link_leads_to_and_revert_leaves_the_link(
    tmp_path: Path, capsys, target: str
) -> None:
    assert not os.path.lexists("/real"), "the absolute link must not find a host file"
    root = board(tmp_path)
    (root / "real").mkdir()
    (root / "real/grub").write_text(GRUB)
    link(root / "etc/default/grub", target)
    before = tree_state(root)

    code, out, err = run(capsys, *APPLY, "--root", str(root))
    assert code == 0, err
    assert "/etc/default/grub" in {c["path"] for c in json.loads(out)["applied"]}
    assert os.readlink(root / "etc/default/grub") == target  # still the same link
    assert "isolcpus=managed_irq,domain,3" in (root / "real/grub").read_text()
    records = Journal(SysRoot(root), persistent=True).records()
    assert [(r["path"], r.get("target")) for r in records if r["op"] == "set"] == [
        ("/etc/default/grub", "/real/grub")
    ]

    code, _, err = run(capsys, "revert", "--root", str(root))
    assert code == 0, err
    assert tree_state(root) == before


def test_an_absolute_link_never_brings_a_host_file_into_the_image(tmp_path: Path, capsys) -> None:
    """etc/default/grub -> <host path>: inside the root that path does not exist, so there
    is no boot configuration to edit; the host's content is never read into the image."""
    root = board(tmp_path)
    host_grub = victim(tmp_path, "grub", GRUB.replace("quiet", "quiet host-only-marker"))
    link(root / "etc/default/grub", host_grub)
    before, host = tree_state(root), host_state(tmp_path)

    code, out, err = run(capsys, *APPLY, "--root", str(root))
    assert code == 0, err
    assert "/etc/default/grub" not in {c["path"] for c in json.loads(out)["applied"]}
    assert host_state(tmp_path) == host
    assert os.readlink(root / "etc/default/grub") == str(host_grub)
    assert not [
        rel
        for rel, entry in tree_state(root, exclude=()).items()
        if isinstance(entry[0], bytes) and b"host-only-marker" in entry[0]
    ]
    code, _, err = run(capsys, "revert", "--root", str(root))
    assert code == 0, err
    assert tree_state(root) == before


def test_provision_writes_through_links_inside_the_image(tmp_path: Path, capsys) -> None:
    """A relative file link (etc/default/grub) and an absolute folder link to a host folder
    (etc/systemd/system.conf.d): the first is edited in place, the second resolves inside
    the image, where the journal creates the folders it needs; revert is exact."""
    root = image(tmp_path)
    (root / "real").mkdir()
    (root / "etc/default/grub").rename(root / "real/grub")
    link(root / "etc/default/grub", "../../real/grub")
    hostdir = tmp_path / "host" / "system.conf.d"
    hostdir.mkdir(parents=True)
    (root / "etc/systemd/system.conf.d").rmdir()
    link(root / "etc/systemd/system.conf.d", hostdir)
    before, host = tree_state(root), host_state(tmp_path)

    code, out, err = run(capsys, *PROVISION, "--root", str(root))
    assert code == 0, err
    report = json.loads(out)
    assert not report["skipped"], report["skipped"]
    assert host_state(tmp_path) == host  # nothing in the host folder
    assert os.readlink(root / "etc/default/grub") == "../../real/grub"
    assert "isolcpus=managed_irq,domain,3" in (root / "real/grub").read_text()
    inside = root / hostdir.relative_to("/") / "90-edged-cpuaffinity.conf"
    assert "CPUAffinity=0-2" in inside.read_text()

    code, _, err = run(capsys, "revert", "--root", str(root))
    assert code == 0, err
    assert tree_state(root) == before and host_state(tmp_path) == host


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    """write_file stages `.NAME.edged-tmp` beside the file: a link already there is removed,
    never opened, so the host file it points at keeps its content."""
    root = board(tmp_path)
    target = victim(tmp_path, text="the host's\n")
    link(root / "etc/default/.irqbalance.edged-tmp", target)
    host = host_state(tmp_path)
    journal = Journal(SysRoot(root))
    old = (root / "etc/default/irqbalance").read_text()
    change = Change("irqbalance", "/etc/default/irqbalance", old, old + "X=1\n", "t")
    assert journal.apply([change]).applied
    assert host_state(tmp_path) == host
    assert not (root / "etc/default/irqbalance").is_symlink()
    assert (root / "etc/default/irqbalance").read_text() == old + "X=1\n"


# -- the resolver itself ----------------------------------------------------------------------


def test_resolution_is_that_of_resolve_in_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc/default").mkdir(parents=True)
    (root / "real").mkdir()
    files = ConfinedRoot(root)
    link(root / "etc/default/abs", "/real/grub")
    link(root / "etc/default/rel", "../../real/grub")
    link(root / "up", "../../../../../../..")  # `..` stops at the root's top
    link(root / "etc/self", "/etc")
    link(root / "loop1", "loop2")
    link(root / "loop2", "loop1")
    assert files.resolve("/etc/default/abs") == "/real/grub"
    assert files.resolve("/etc/default/rel") == "/real/grub"
    assert files.resolve("/etc/default/abs", follow=False) == "/etc/default/abs"
    assert files.resolve("/up/up/etc/self/self/default/abs") == "/real/grub"
    assert files.resolve("/etc/missing/../x") == "/etc/x"
    with pytest.raises(OSError) as loop:
        files.resolve("/loop1")
    assert loop.value.errno == errno.ELOOP
    files.write("/up/etc/default/abs", "new\n", kernel=False)
    assert (root / "real/grub").read_text() == "new\n"
    assert os.readlink(root / "etc/default/abs") == "/real/grub"
    assert files.read("/etc/default/rel") == "new\n"
    files.unlink("/etc/default/abs")  # the link itself, not its target
    assert (root / "real/grub").exists() and not os.path.lexists(root / "etc/default/abs")


def test_the_live_root_uses_plain_paths(tmp_path: Path) -> None:
    """Behaviour on "/" stays as it was: no resolution, paths as given."""
    live = ConfinedRoot(tmp_path, live=True)
    link(tmp_path / "etc/x", "/nonexistent-edged-target")
    assert live.resolve("/etc/x") == "/etc/x"
    live.check_kernel_links()  # nothing to refuse on the running system
