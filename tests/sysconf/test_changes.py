"""sysconf.changes: the apply/revert journal on temporary roots shaped like a 4-core board.

Every write goes to tmp_path; kernel refusals and crashes are simulated at the writer boundary
(`Journal(root, writer=...)`) or with a real SIGKILL of a subprocess half-way through apply.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sysconf.changes import (
    JOURNAL_NAME,
    PERSISTENT_JOURNAL_NAME,
    Change,
    Journal,
    UntrustedJournal,
    outlives_tuning,
    read_current,
    selected_choice,
    temp_path,
    write_file,
)
from sysconf.confined import ConfinedRoot
from sysconf.journals import Journals
from sysconf.sysroot import SysRoot
from tests.support.roots import tree_state

REPO = Path(__file__).resolve().parents[2]
STATE = "var/lib/edged"

GRUB = b"""\
# If you change this file, run 'update-grub' afterwards to update
# /boot/grub/grub.cfg.
# For full documentation of the options in this file, see:
#   info -f grub -n 'Simple configuration'
# Caf\xe9 line: a Latin-1 byte that must survive a round trip

GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR=`( . /etc/os-release; echo ${NAME:-Debian} ) 2>/dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT="quiet"
GRUB_CMDLINE_LINUX=""
"""
# Edited on Windows: CRLF, as Raspberry Pi boot partitions often are.
CMDLINE = (
    b"console=serial0,115200 console=tty1 root=PARTUUID=4e639091-02 rootfstype=ext4 "
    b"fsck.repair=yes rootwait\r\n"
)

IRQ = "/proc/irq/{}/smp_affinity_list"


def build_root(base: Path) -> Path:
    """Files of a Raspberry Pi 4-like system (IRQ numbers from its /proc/interrupts)."""
    files = {
        "proc/irq/default_smp_affinity": "f\n",
        "proc/sys/kernel/timer_migration": "1\n",
        "proc/sys/vm/stat_interval": "1\n",
        "sys/devices/virtual/workqueue/cpumask": "f\n",
        "sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never\n",
        "etc/default/keyboard": 'XKBMODEL="pc105"\nXKBLAYOUT="gb"\n',
    }
    for irq in (24, 25, 31, 39):  # mmc, eth0, xhci (managed queue), v3d
        files[f"proc/irq/{irq}/smp_affinity_list"] = "0-3\n"
        files[f"proc/irq/{irq}/smp_affinity"] = "f\n"
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (base / "etc/default/grub").write_bytes(GRUB)
    (base / "boot/firmware").mkdir(parents=True)
    (base / "boot/firmware/cmdline.txt").write_bytes(CMDLINE)
    (base / "boot/firmware/cmdline.txt").chmod(0o755)  # FAT: everything looks executable
    (base / "var/lib").mkdir(parents=True)
    return base


def cmdline_new() -> str:
    return CMDLINE.decode().replace("rootwait", "rootwait isolcpus=managed_irq,domain,2-3")


def changes_for() -> list[Change]:
    grub_text = GRUB.decode("utf-8", "surrogateescape")
    return [
        Change("irq", IRQ.format(24), "0-3\n", "0-1", "mmc off the inference cores"),
        Change("irq", IRQ.format(25), "0-3\n", "0-1", "eth0 off the inference cores"),
        Change("irq", IRQ.format(31), "0-3\n", "0-1", "xhci off the inference cores"),
        Change("irq-default", "/proc/irq/default_smp_affinity", "f\n", "3", "new IRQs"),
        Change("sysctl", "/proc/sys/kernel/timer_migration", "1\n", "0", "timers"),
        Change("workqueue", "/sys/devices/virtual/workqueue/cpumask", "f\n", "3", "kworkers"),
        Change(
            "irqbalance",
            "/etc/default/irqbalance",
            None,
            "IRQBALANCE_BANNED_CPULIST=2-3\n",
            "irqbalance keeps off 2-3",
        ),
        Change(
            "cmdline", "/boot/firmware/cmdline.txt", CMDLINE.decode(), cmdline_new(), "isolate 2-3"
        ),
        Change(
            "cmdline",
            "/etc/default/grub",
            grub_text,
            grub_text.replace('"quiet"', '"quiet nohz_full=2-3"'),
            "isolate 2-3",
        ),
    ]


def snapshot(root: Path) -> dict:
    return tree_state(root, exclude=(STATE,))


def ops(journal: Journal) -> list[str]:
    return [record["op"] for record in journal.records()]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return build_root(tmp_path / "root")


def test_apply_writes_new_values_and_journals_old_ones(root: Path) -> None:
    before = snapshot(root)
    journal = Journal(SysRoot(root))
    result = journal.apply(changes_for())

    assert len(result.applied) == len(changes_for()) and not result.skipped
    assert (root / "proc/irq/24/smp_affinity_list").read_text() == "0-1"
    assert (root / "sys/devices/virtual/workqueue/cpumask").read_text() == "3"
    assert (root / "etc/default/irqbalance").read_text() == "IRQBALANCE_BANNED_CPULIST=2-3\n"
    assert (root / "boot/firmware/cmdline.txt").read_bytes() == cmdline_new().encode()
    assert b"\xe9" in (root / "etc/default/grub").read_bytes()  # not mangled to U+FFFD
    assert journal.path == root / STATE / JOURNAL_NAME
    sets = [r for r in journal.records() if r["op"] == "set"]
    for record in sets:
        rel = record["path"].lstrip("/")
        expected = before[rel][0].decode("utf-8", "surrogateescape") if rel in before else None
        assert record["old"] == expected, record["path"]
    assert ops(journal)[-1] == "done"
    assert journal.pending()


def test_old_value_is_fsynced_before_each_write(root: Path, monkeypatch) -> None:
    """The journal's fsync of a "set" record comes before the write it describes, and when the
    writer runs, the record is already in the file on disk."""
    events: list[tuple[str, str]] = []
    journal_file = root / STATE / JOURNAL_NAME
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def writer(path: Path, content: str, kernel: bool) -> None:
        last = json.loads(journal_file.read_text().splitlines()[-1])
        device_path = "/" + path.relative_to(root).as_posix()
        assert last["op"] == "set" and last["path"] == device_path
        assert last["new"] == content
        events.append(("write", device_path))
        write_file(path, content, kernel)

    monkeypatch.setattr(os, "fsync", fsync)
    Journal(SysRoot(root), writer=writer).apply(changes_for())
    writes = [i for i, event in enumerate(events) if event[0] == "write"]
    assert len(writes) == len(changes_for())
    for previous, index in zip([-1, *writes], writes, strict=False):
        assert ("fsync", str(journal_file)) in events[previous + 1 : index]
    # The journal's folder entry is fsynced once, when the journal is created.
    assert events.count(("fsync", str(journal_file.parent))) == 1


def test_a_write_that_fails_after_its_set_record_is_journalled(root: Path) -> None:
    before = snapshot(root)
    failing = "/proc/sys/kernel/timer_migration"

    def writer(path: Path, content: str, kernel: bool) -> None:
        if path == root / failing.lstrip("/"):
            raise RuntimeError("edged bug half-way through apply")
        write_file(path, content, kernel)

    journal = Journal(SysRoot(root), writer=writer)
    with pytest.raises(RuntimeError):
        journal.apply(changes_for())
    last = journal.records()[-1]
    assert last["op"] == "set" and last["path"] == failing and last["old"] == "1\n"
    assert "done" not in ops(journal)

    Journal(SysRoot(root)).revert()
    assert snapshot(root) == before


def test_apply_twice_changes_nothing_the_second_time(root: Path) -> None:
    journal = Journal(SysRoot(root))
    journal.apply(changes_for())
    after_first = snapshot(root)
    sets_before = ops(journal).count("set")

    result = journal.apply(changes_for())
    assert not result.applied and not result.skipped
    assert len(result.unchanged) == len(changes_for())
    assert ops(journal).count("set") == sets_before
    assert snapshot(root) == after_first


def test_revert_restores_the_tree_byte_for_byte(root: Path) -> None:
    before = snapshot(root)
    journal = Journal(SysRoot(root))
    journal.apply(changes_for())
    assert snapshot(root) != before

    done = Journal(SysRoot(root)).revert()
    assert snapshot(root) == before
    assert ("/etc/default/irqbalance", "removed") in done
    assert not (root / "etc/default/irqbalance").exists()  # it did not exist before apply
    assert ("/boot/firmware/cmdline.txt", "restored") in done
    # The CRLF and the FAT-style mode of cmdline.txt are back too (part of the snapshot).
    assert (root / "boot/firmware/cmdline.txt").read_bytes() == CMDLINE
    assert not journal.pending()


def test_revert_twice_does_nothing_the_second_time(root: Path) -> None:
    before = snapshot(root)
    journal = Journal(SysRoot(root))
    journal.apply(changes_for())
    assert journal.revert()
    assert journal.revert() == []
    assert snapshot(root) == before
    assert not journal.path.exists()
    assert len(list(journal.path.parent.glob(f"{JOURNAL_NAME}.reverted-*"))) == 1


def test_reverts_in_the_same_second_keep_both_journals(root: Path) -> None:
    journal = Journal(SysRoot(root))
    for _ in range(2):
        journal.apply(changes_for())
        journal.revert()
    assert len(list(journal.path.parent.glob(f"{JOURNAL_NAME}.reverted-*"))) == 2


def refusing_writer(refuse: dict[str, int], calls: list[str], root: Path):
    def writer(path: Path, content: str, kernel: bool) -> None:
        device_path = "/" + path.relative_to(root).as_posix()
        calls.append(device_path)
        if device_path in refuse:
            code = refuse[device_path]
            raise OSError(code, os.strerror(code), str(path))
        write_file(path, content, kernel)

    return writer


def test_refused_writes_are_skipped_with_the_reason_and_not_reverted(root: Path) -> None:
    before = snapshot(root)
    refuse = {IRQ.format(31): errno.EIO, "/proc/sys/kernel/timer_migration": errno.EINVAL}
    calls: list[str] = []
    journal = Journal(SysRoot(root), writer=refusing_writer(refuse, calls, root))

    result = journal.apply(changes_for())  # not fatal
    skipped = {change.path: why for change, why in result.skipped}
    assert skipped.keys() == refuse.keys()
    assert skipped[IRQ.format(31)].startswith("EIO: ")
    assert skipped["/proc/sys/kernel/timer_migration"].startswith("EINVAL: ")
    assert len(result.applied) == len(changes_for()) - 2
    recorded = {r["path"]: r["reason"] for r in journal.records() if r["op"] == "skipped"}
    assert recorded == skipped
    assert ops(journal)[-1] == "done"
    assert (root / "proc/irq/31/smp_affinity_list").read_text() == "0-3\n"

    calls.clear()
    journal.revert()
    assert not set(calls) & refuse.keys()  # nothing to undo there, so not touched
    assert snapshot(root) == before


def test_a_refused_write_is_tried_again_by_the_next_apply(root: Path) -> None:
    """The kernel may take it later (after a reboot with isolcpus=managed_irq), so the journal
    does not remember refusals; the retry is journalled as set + skipped again."""
    before = snapshot(root)
    refuse = {IRQ.format(31): errno.EIO}
    journal = Journal(SysRoot(root), writer=refusing_writer(refuse, [], root))
    journal.apply(changes_for())
    count = len(journal.records())
    result = journal.apply(changes_for())
    assert [c.path for c, _ in result.skipped] == [IRQ.format(31)]
    assert not result.applied
    assert [r["op"] for r in journal.records()[count:]] == ["set", "skipped", "done"]
    journal.revert()
    assert snapshot(root) == before


def test_an_unreadable_file_is_skipped_not_recorded_as_absent(root: Path, monkeypatch) -> None:
    """Recording None for a file that exists would make revert delete it. (Run as root, no
    mode makes a file unreadable, so the journal's one read, ConfinedRoot.read_bytes, says so.)"""
    real = ConfinedRoot.read_bytes

    def read_bytes(self: ConfinedRoot, device_path: str) -> bytes | None:
        if device_path == "/etc/default/keyboard":
            raise PermissionError(errno.EACCES, "Permission denied", str(self.host(device_path)))
        return real(self, device_path)

    before = snapshot(root)
    monkeypatch.setattr(ConfinedRoot, "read_bytes", read_bytes)
    journal = Journal(SysRoot(root))
    change = Change("irqbalance", "/etc/default/keyboard", "x", "y", "test")
    result = journal.apply([change])
    assert [(c.path, why.split(" (")[0]) for c, why in result.skipped] == [
        ("/etc/default/keyboard", "cannot read the current value, so revert could not restore it")
    ]
    assert "EACCES" in result.skipped[0][1]
    assert "set" not in ops(journal)
    journal.revert()
    monkeypatch.undo()
    assert snapshot(root) == before


def test_a_missing_kernel_folder_is_skipped_not_created(root: Path) -> None:
    journal = Journal(SysRoot(root))
    result = journal.apply([Change("irq", IRQ.format(99), None, "0-1", "gone IRQ")])
    assert result.skipped and "does not exist" in result.skipped[0][1]
    assert "set" not in ops(journal)


# -- crashes -------------------------------------------------------------------------------


def test_an_interrupt_between_writes_is_reverted_by_a_fresh_journal(root: Path) -> None:
    before = snapshot(root)
    written: list[Path] = []

    def writer(path: Path, content: str, kernel: bool) -> None:
        write_file(path, content, kernel)
        written.append(path)
        if len(written) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Journal(SysRoot(root), writer=writer).apply(changes_for())
    assert (root / "proc/irq/25/smp_affinity_list").read_text() == "0-1"

    assert Journal(SysRoot(root)).pending()
    Journal(SysRoot(root)).revert()
    assert snapshot(root) == before


CHILD = """
import dataclasses, json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from sysconf.changes import Change, Journal, temp_path, write_file
from sysconf.sysroot import SysRoot

root, mode, plan = sys.argv[2], sys.argv[3], sys.argv[4]
changes = [Change(**c) for c in json.loads(Path(plan).read_text())]
count = 0

def stop_here():
    print("ready", flush=True)
    time.sleep(60)

def writer(path, content, kernel):
    global count
    if mode == "pending" and count == 2:
        stop_here()  # its "set" record is on disk, the write has not happened
    if mode == "staged" and not kernel:
        temp_path(path).write_text(content)
        stop_here()  # write_file staged the new content but did not rename it yet
    write_file(path, content, kernel)
    count += 1
    if mode == "written" and count == 2:
        stop_here()

Journal(SysRoot.at(root), writer=writer).apply(changes)
print("finished", flush=True)
"""


@pytest.mark.parametrize("mode", ["written", "pending", "staged"])
@pytest.mark.integration
def test_sigkill_half_way_through_apply_then_revert(root: Path, tmp_path: Path, mode: str) -> None:
    before = snapshot(root)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([dataclasses.asdict(c) for c in changes_for()]))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(REPO), str(root), mode, str(plan)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=10)
        assert child.stdout is not None
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    journal = Journal(SysRoot(root))
    assert "done" not in ops(journal)
    changed = {rel for rel, entry in snapshot(root).items() if before.get(rel) != entry}
    if mode == "written":
        assert changed == {"proc/irq/24/smp_affinity_list", "proc/irq/25/smp_affinity_list"}
    if mode == "pending":
        assert ops(journal).count("set") == 3
    if mode == "staged":
        assert temp_path(root / "etc/default/irqbalance").exists()

    journal.revert()
    assert snapshot(root) == before  # also: no staged temporary file left behind


def test_a_partial_last_line_is_tolerated_and_cut_before_the_next_record(root: Path) -> None:
    before = snapshot(root)
    journal = Journal(SysRoot(root))
    journal.apply(changes_for()[:3])
    complete = journal.records()
    with open(journal.path, "a") as f:
        f.write('{"op": "set", "path": "/proc/irq/39/smp_aff')  # crash mid-append
    assert journal.records() == complete

    journal.apply(changes_for())  # appends after the partial line without gluing to it
    assert journal.path.read_text().count('"/proc/irq/39/smp_aff') == 0
    assert ops(journal)[-1] == "done"
    Journal(SysRoot(root)).revert()
    assert snapshot(root) == before


def test_a_complete_last_record_without_its_newline_is_kept(root: Path) -> None:
    journal = Journal(SysRoot(root))
    journal.apply(changes_for()[:1])
    journal.path.write_text(journal.path.read_text().rstrip("\n"))
    journal.apply(changes_for()[1:2])
    assert ops(journal) == ["set", "done", "set", "done"]


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", '{"path": "/x"}', ""])
def test_a_corrupt_middle_line_names_the_file_and_line(root: Path, bad: str) -> None:
    journal = Journal(SysRoot(root))
    journal.apply(changes_for()[:2])
    lines = journal.path.read_text().splitlines()
    lines.insert(1, bad)
    journal.path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{journal.path}: line 2 is not a journal record"):
        journal.records()
    with pytest.raises(ValueError, match="line 2"):
        journal.revert()


# -- selector files and exact text ---------------------------------------------------------


def kernel_selector_writer(path: Path, content: str, kernel: bool) -> None:
    """Like the kernel's THP files: one bare word from the listed choices, else EINVAL."""
    choices = [w.strip("[]") for w in path.read_text().split()]
    if content.strip() not in choices:
        raise OSError(errno.EINVAL, "Invalid argument", str(path))
    path.write_text(" ".join(f"[{w}]" if w == content.strip() else w for w in choices) + "\n")


def test_a_selector_file_records_and_restores_the_selected_word(root: Path) -> None:
    before = snapshot(root)
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    change = Change("thp", thp, "madvise", "never", "THP", selector=True)
    journal = Journal(SysRoot(root), writer=kernel_selector_writer)

    result = journal.apply([change])
    assert result.applied == [change]
    assert (root / thp.lstrip("/")).read_text() == "always madvise [never]\n"
    assert [r["old"] for r in journal.records() if r["op"] == "set"] == ["madvise"]
    assert journal.apply([change]).unchanged == [change]  # "[never]" is selected already
    assert ops(journal).count("set") == 1

    assert journal.revert() == [(thp, "restored")]  # the kernel took "madvise"
    assert snapshot(root) == before


def test_writing_a_selector_listing_back_is_what_the_kernel_refuses(root: Path) -> None:
    """Why `selector` exists: without it the old value is the listing, and revert fails."""
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    journal = Journal(SysRoot(root), writer=kernel_selector_writer)
    journal.apply([Change("thp", thp, "always [madvise] never\n", "never", "THP")])
    assert journal.revert() == [(thp, "failed: Invalid argument")]


def test_a_selector_change_without_a_selected_word_is_skipped(root: Path) -> None:
    (root / "sys/kernel/mm/transparent_hugepage/enabled").write_text("never\n")
    change = Change(
        "thp", "/sys/kernel/mm/transparent_hugepage/enabled", "x", "always", "t", selector=True
    )
    result = Journal(SysRoot(root)).apply([change])
    assert result.skipped and "no [selected] choice" in result.skipped[0][1]


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("always [madvise] never\n", "madvise"),
        ("always defer defer+madvise [madvise] never\n", "madvise"),
        ("[none] mq-deadline kyber bfq\n", "none"),
        ("never\n", None),
        ("[a] [b]", None),
        ("", None),
        (None, None),
    ],
)
def test_selected_choice(text: str | None, word: str | None) -> None:
    assert selected_choice(text) == word


def test_write_file_leaves_no_temporary_file_when_the_rename_fails(root: Path, monkeypatch) -> None:
    target = root / "etc/default/keyboard"
    original = target.read_bytes()

    def replace(src, dst) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        write_file(target, "XKBLAYOUT=us\n", kernel=False)
    assert not temp_path(target).exists()
    assert target.read_bytes() == original


def test_write_file_keeps_line_ends_and_undecodable_bytes(tmp_path: Path) -> None:
    target = tmp_path / "cmdline.txt"
    target.write_bytes(b"a\r\nb\xff\n")
    text = read_current(target)
    assert text is not None
    write_file(target, text, kernel=False)
    assert target.read_bytes() == b"a\r\nb\xff\n"
    write_file(target, text, kernel=True)
    assert target.read_bytes() == b"a\r\nb\xff\n"


def test_plan_json_has_exactly_the_documented_fields() -> None:
    change = Change(
        "thp",
        "/sys/kernel/mm/transparent_hugepage/enabled",
        "madvise",
        "never",
        "why",
        selector=True,
    )
    assert change.to_dict() == {
        "kind": "thp",
        "path": change.path,
        "old": "madvise",
        "new": "never",
        "reason": "why",
    }


# -- folders the journal creates --------------------------------------------------------------

DROPIN = "/etc/systemd/system.conf.d/90-edged-cpuaffinity.conf"


def test_a_missing_folder_is_created_and_revert_removes_it(root: Path) -> None:
    before = tree_state(root)
    assert not (root / "etc/systemd").exists()
    journal = Journal(SysRoot(root))
    result = journal.apply(
        [Change("systemd-conf", DROPIN, None, "[Manager]\nCPUAffinity=0-2\n", "drop-in")]
    )
    assert [c.path for c in result.applied] == [DROPIN] and not result.skipped
    assert (root / DROPIN.lstrip("/")).read_text() == "[Manager]\nCPUAffinity=0-2\n"
    records = journal.records()
    assert [(r["op"], r.get("path")) for r in records] == [
        ("mkdir", "/etc/systemd"),
        ("mkdir", "/etc/systemd/system.conf.d"),
        ("set", DROPIN),
        ("done", None),
    ]
    done = journal.revert()
    assert done == [
        (DROPIN, "removed"),
        ("/etc/systemd/system.conf.d", "removed"),
        ("/etc/systemd", "removed"),
    ]
    assert tree_state(root) == before


def test_the_mkdir_record_is_fsynced_before_the_folder_is_made(root: Path, monkeypatch) -> None:
    journal_file = root / STATE / JOURNAL_NAME
    events: list[str] = []
    real_fsync, real_mkdir = os.fsync, ConfinedRoot.mkdir

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == str(journal_file):
            events.append("fsync " + json.loads(journal_file.read_text().splitlines()[-1])["op"])

    def mkdir(self: ConfinedRoot, device_path: str, *args, **kwargs) -> None:
        if device_path.startswith("/etc/"):  # the journal's one mkdir, through its root
            last = json.loads(journal_file.read_text().splitlines()[-1])
            assert last == {**last, "op": "mkdir", "path": device_path}
            events.append("mkdir " + Path(device_path).name)
        real_mkdir(self, device_path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(ConfinedRoot, "mkdir", mkdir)
    Journal(SysRoot(root)).apply([Change("systemd-conf", DROPIN, None, "x\n", "drop-in")])
    assert events[:5] == [
        "fsync mkdir",
        "mkdir systemd",
        "fsync mkdir",
        "mkdir system.conf.d",
        "fsync set",
    ]


def test_a_crash_between_the_mkdir_record_and_the_mkdir_reverts_cleanly(root: Path) -> None:
    before = tree_state(root)
    journal = Journal(SysRoot(root))
    journal._append({"op": "mkdir", "path": "/etc/systemd"})  # then the power went
    assert journal.revert() == [("/etc/systemd", "absent")]
    assert tree_state(root) == before


def test_revert_keeps_a_made_folder_that_is_no_longer_empty(root: Path) -> None:
    journal = Journal(SysRoot(root))
    journal.apply([Change("systemd-conf", DROPIN, None, "x\n", "drop-in")])
    (root / "etc/systemd/system.conf.d/other.conf").write_text("mine\n")
    done = dict(journal.revert())
    assert done[DROPIN] == "removed"
    assert done["/etc/systemd/system.conf.d"].startswith("kept")
    assert (root / "etc/systemd/system.conf.d/other.conf").read_text() == "mine\n"


def test_a_file_in_the_way_of_a_folder_is_skipped(root: Path) -> None:
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/systemd").write_text("not a folder\n")
    journal = Journal(SysRoot(root))
    result = journal.apply([Change("systemd-conf", DROPIN, None, "x\n", "drop-in")])
    assert result.skipped and "not a directory" in result.skipped[0][1]
    assert "mkdir" not in ops(journal) and "set" not in ops(journal)


def test_a_mask_into_a_missing_folder_creates_it_and_revert_removes_it(root: Path) -> None:
    before = tree_state(root)
    journal = Journal(SysRoot(root))
    path = "/etc/systemd/system/cups.service"
    result = journal.apply([Change("mask", path, None, "/dev/null", "trim")])
    assert result.applied and os.readlink(root / path.lstrip("/")) == "/dev/null"
    journal.revert()
    assert tree_state(root) == before


# -- trust: root acts on the journal, so nobody else may have written it ----------------------


def test_a_journal_folder_owned_by_another_user_is_refused(root: Path) -> None:
    journal = Journal(SysRoot(root))
    journal.apply(changes_for()[:2])
    applied = snapshot(root)
    os.chown(journal.path.parent, 12345, 12345)  # e.g. the daemon user's /var/lib/edged
    with pytest.raises(
        UntrustedJournal,
        match=r"edged: the journal folder is owned by uid "
        r"12345, not by uid 0",
    ):
        Journal(SysRoot(root)).revert()
    with pytest.raises(UntrustedJournal, match="owned by uid 12345"):
        Journal(SysRoot(root)).apply(changes_for())
    assert snapshot(root) == applied and journal.path.exists()


@pytest.mark.parametrize("mode", [0o620, 0o602])
def test_a_group_or_world_writable_journal_is_refused(root: Path, mode: int) -> None:
    journal = Journal(SysRoot(root))
    journal.apply(changes_for()[:2])
    applied = snapshot(root)
    journal.path.chmod(mode)
    with pytest.raises(
        UntrustedJournal,
        match=rf"{JOURNAL_NAME}: the journal file is "
        rf"group/world-writable \(mode 0{mode:o}\)",
    ):
        journal.revert()
    assert snapshot(root) == applied


def test_a_journal_symlink_is_refused(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("")
    (root / STATE).mkdir(parents=True)
    (root / STATE / JOURNAL_NAME).symlink_to(elsewhere)
    with pytest.raises(UntrustedJournal, match="not a regular file"):
        Journal(SysRoot(root)).apply(changes_for())
    assert elsewhere.read_text() == ""


def test_a_record_that_escapes_the_root_is_refused(root: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (root / STATE).mkdir(parents=True)
    forged = {"op": "set", "path": f"/../{victim.name}", "old": "owned\n", "new": "x"}
    (root / STATE / JOURNAL_NAME).write_text(json.dumps(forged) + "\n")
    (root / STATE / JOURNAL_NAME).chmod(0o600)
    with pytest.raises(UntrustedJournal, match=r"line 1: path '/\.\./victim' is not a plain"):
        Journal(SysRoot(root)).revert()
    assert victim.read_text() == "keep\n"


def test_a_new_journal_is_owner_only_whatever_the_umask(root: Path) -> None:
    old_umask = os.umask(0o002)  # Debian's default for users with a private group
    try:
        journal = Journal(SysRoot(root))
        journal.apply(changes_for()[:1])
    finally:
        os.umask(old_umask)
    assert journal.path.stat().st_mode & 0o077 == 0
    assert journal.path.parent.stat().st_mode & 0o022 == 0
    journal.revert()  # and it trusts what it made


# -- a journal left by an older boot ---------------------------------------------------------

BOOT_A, BOOT_B = "0f5c1d5e-4f53-4d7e-9d1c-6b7a1f0f2c11", "7c2e9a40-1b7d-4c44-8b5e-3f9e0a6d5b22"


def set_boot(root: Path, boot_id: str) -> None:
    path = root / "proc/sys/kernel/random/boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot_id + "\n")


def test_records_carry_the_boot_id(root: Path) -> None:
    set_boot(root, BOOT_A)
    journal = Journal(SysRoot(root))
    journal.apply(changes_for())
    sets = [r for r in journal.records() if r["op"] in ("set", "mkdir")]
    assert sets and {r["boot_id"] for r in sets} == {BOOT_A}


@pytest.mark.parametrize("how", ["apply", "revert"])
def test_a_journal_from_an_older_boot_reverts_files_and_drops_kernel_values(
    root: Path, how: str
) -> None:
    set_boot(root, BOOT_A)
    before = snapshot(root)
    Journal(SysRoot(root)).apply(changes_for())
    # Power lost without revert; the next boot. The kernel starts from its defaults, and IRQ
    # 24 now belongs to another device that a user set to CPU 2: a stale "old" of "0-3"
    # must not be written over it.
    for rel, value in before.items():
        if rel.startswith(("proc/", "sys/")) and value[0] != "dir":
            (root / rel).write_bytes(value[0])
    set_boot(root, BOOT_B)
    (root / "proc/irq/24/smp_affinity_list").write_text("2\n")
    rebooted = {**snapshot(root)}
    assert rebooted["etc/default/irqbalance"][0] == b"IRQBALANCE_BANNED_CPULIST=2-3\n"

    journal = Journal(SysRoot(root))
    if how == "revert":
        done = dict(journal.revert())
    else:
        result = journal.apply([])
        done = dict(result.stale)
        assert result.to_dict()["stale"]
    assert done[IRQ.format(24)].startswith(f"dropped: written in an older boot ({BOOT_A})")
    assert done["/sys/devices/virtual/workqueue/cpumask"].startswith("dropped")
    assert done["/etc/default/irqbalance"] == "removed"
    assert done["/boot/firmware/cmdline.txt"] == "restored"
    # Files are back to their original content, kernel values are what this boot has.
    expected = {rel: value for rel, value in rebooted.items() if rel != "etc/default/irqbalance"}
    expected["boot/firmware/cmdline.txt"] = before["boot/firmware/cmdline.txt"]
    expected["etc/default/grub"] = before["etc/default/grub"]
    assert snapshot(root) == expected
    assert (root / "proc/irq/24/smp_affinity_list").read_text() == "2\n"
    aside = [p.name for p in (root / STATE).iterdir() if ".stale-" in p.name]
    assert len(aside) == 1
    assert not journal.pending()

    # A fresh apply in this boot records this boot's originals, and revert restores them.
    fresh = Journal(SysRoot(root))
    fresh.apply(changes_for())
    grub = [r for r in fresh.records() if r.get("path") == "/etc/default/grub"]
    assert grub[0]["old"] == GRUB.decode("utf-8", "surrogateescape")
    assert {r["boot_id"] for r in fresh.records() if r["op"] == "set"} == {BOOT_B}
    fresh.revert()
    assert snapshot(root) == expected


def test_a_journal_of_this_boot_is_not_stale(root: Path) -> None:
    set_boot(root, BOOT_A)
    journal = Journal(SysRoot(root))
    journal.apply(changes_for())
    assert journal.retire_stale() == []
    assert journal.pending()


# -- the tuning journal and the persistent journal ---------------------------------------------

MASK = "/etc/systemd/system/apt-daily.timer"


def split_changes() -> list[Change]:
    """changes_for() plus a mask in a folder the root does not have yet (the persistent
    journal records the folders it makes)."""
    return [*changes_for(), Change("mask", MASK, None, "/dev/null", "apt-daily wakes a core")]


PERSISTENT_PATHS = {"/boot/firmware/cmdline.txt", "/etc/default/grub", MASK}


def set_paths(journal: Journal) -> set[str]:
    return {r["path"] for r in journal.records() if r["op"] == "set"}


def test_journals_route_by_kind_and_revert_runtime_keeps_the_persistent_ones(root: Path) -> None:
    before = snapshot(root)
    journals = Journals(SysRoot(root))
    result = journals.apply(split_changes())
    assert [c.path for c in result.applied] == [c.path for c in split_changes()]  # plan order
    assert {c.path for c in split_changes() if outlives_tuning(c)} == PERSISTENT_PATHS
    assert set_paths(journals.persistent) == PERSISTENT_PATHS
    assert set_paths(journals.tuning) == {c.path for c in changes_for()} - PERSISTENT_PATHS
    assert journals.persistent.path == root / STATE / PERSISTENT_JOURNAL_NAME
    applied = snapshot(root)

    reverted = dict(journals.revert(runtime_only=True))
    assert set(reverted) == {c.path for c in changes_for()} - PERSISTENT_PATHS
    after = snapshot(root)
    for rel in after.keys() | before.keys():
        persistent = any(
            rel == p.lstrip("/") or p.lstrip("/").startswith(rel + "/") for p in PERSISTENT_PATHS
        )
        assert after.get(rel) == (applied if persistent else before).get(rel), rel
    assert os.readlink(root / MASK.lstrip("/")) == "/dev/null"
    assert journals.persistent.pending() and not journals.tuning.pending()

    reverted = dict(journals.revert())
    assert set(reverted) >= PERSISTENT_PATHS
    assert snapshot(root) == before  # and the folders the mask needed are gone again
    assert not journals.pending() and journals.revert() == []


def test_journals_apply_twice_changes_nothing(root: Path) -> None:
    journals = Journals(SysRoot(root))
    journals.apply(split_changes())
    applied = snapshot(root)
    records = (len(journals.tuning.records()), len(journals.persistent.records()))
    again = journals.apply(split_changes())
    assert not again.applied and not again.skipped
    assert [c.path for c in again.unchanged] == [c.path for c in split_changes()]
    assert snapshot(root) == applied
    # No new "set" records: a later revert still finds each original as its `old`.
    assert [r["op"] for r in journals.tuning.records()[records[0] :]] == ["done"]
    assert [r["op"] for r in journals.persistent.records()[records[1] :]] == ["done"]


def test_without_persistent_changes_there_is_no_persistent_journal(root: Path) -> None:
    journals = Journals(SysRoot(root))
    runtime = [c for c in changes_for() if not outlives_tuning(c)]
    journals.apply(runtime)
    assert journals.tuning.path.exists() and not journals.persistent.path.exists()


def test_an_older_boots_tuning_journal_is_retired_but_the_persistent_one_kept(root: Path) -> None:
    set_boot(root, BOOT_A)
    before = snapshot(root)
    Journals(SysRoot(root)).apply(split_changes())
    for rel, value in before.items():  # power lost; the kernel starts from its defaults
        if rel.startswith(("proc/", "sys/")) and value[0] != "dir":
            (root / rel).write_bytes(value[0])
    set_boot(root, BOOT_B)
    persistent_before = (root / STATE / PERSISTENT_JOURNAL_NAME).read_bytes()

    journals = Journals(SysRoot(root))
    assert Journal(SysRoot(root), persistent=True).retire_stale() == []
    stale = dict(journals.apply([]).stale)
    assert stale["/etc/default/irqbalance"] == "removed"
    assert stale["/sys/devices/virtual/workqueue/cpumask"].startswith("dropped")
    assert not PERSISTENT_PATHS & set(stale)
    assert (root / "boot/firmware/cmdline.txt").read_bytes() == cmdline_new().encode()
    assert os.readlink(root / MASK.lstrip("/")) == "/dev/null"
    assert (root / STATE / PERSISTENT_JOURNAL_NAME).read_bytes() == persistent_before
    assert journals.persistent.pending()

    journals.revert()  # a plain revert in the new boot still restores them exactly
    expected = {
        **before,
        "proc/sys/kernel/random/boot_id": snapshot(root)["proc/sys/kernel/random/boot_id"],
    }
    assert snapshot(root) == expected
    names = sorted(p.name for p in (root / STATE).iterdir())
    assert any(n.startswith(f"{PERSISTENT_JOURNAL_NAME}.reverted-") for n in names), names


def test_journals_refuse_an_untrusted_persistent_journal_before_writing(root: Path) -> None:
    Journals(SysRoot(root)).apply(split_changes())
    applied = snapshot(root)
    (root / STATE / PERSISTENT_JOURNAL_NAME).chmod(0o666)
    with pytest.raises(UntrustedJournal, match=PERSISTENT_JOURNAL_NAME):
        Journals(SysRoot(root)).revert()
    assert snapshot(root) == applied  # the tuning journal was not reverted either
    with pytest.raises(UntrustedJournal, match=PERSISTENT_JOURNAL_NAME):
        Journals(SysRoot(root)).apply(changes_for())


def test_live_masks_survive_the_services_stop_and_a_plain_revert_starts_what_ran(
    tmp_path: Path,
) -> None:
    """Live-looking root, systemctl faked at its runner (this machine's systemd is never
    asked): `apply --trim` masks and stops units; edged-tune's stop (`revert --runtime`) asks
    systemctl nothing and leaves them masked; a plain revert unmasks and starts what ran."""
    from sysconf.services import plan_trim
    from sysconf.systemctl import Systemctl
    from tests.support.images import image_root
    from tests.support.systemctl import RUNNING, FakeSystemctl, LiveLooking

    root_dir = image_root(tmp_path)
    fake = FakeSystemctl(active=RUNNING)
    root = LiveLooking(root_dir)
    tuning = Change("sysctl", "/proc/sys/kernel/timer_migration", None, "0", "timers")
    (root_dir / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (root_dir / "proc/sys/kernel/timer_migration").write_text("1\n")
    before = tree_state(root_dir)
    masks = plan_trim(root)
    result = Journals(root, systemctl=Systemctl(runner=fake)).apply([tuning, *masks])
    assert len(result.applied) == len(masks) + 1 and fake.active == set()

    fake.calls.clear()
    journals = Journals(root, systemctl=Systemctl(runner=fake))
    assert dict(journals.revert(runtime_only=True)) == {tuning.path: "restored"}
    assert fake.calls == [] and fake.active == set()
    assert (root_dir / "proc/sys/kernel/timer_migration").read_text() == "1\n"
    for change in masks:
        assert os.readlink(root_dir / change.path.lstrip("/")) == "/dev/null"

    reverted = journals.revert()
    started = {p.rsplit("/", 1)[1] for p, a in reverted if a.endswith(", started")}
    assert started == RUNNING and fake.active == RUNNING
    assert tree_state(root_dir) == before
