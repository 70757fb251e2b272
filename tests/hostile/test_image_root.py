"""`edgectl plan/apply --root DIR` on an image whose files are not files: a FIFO where a config
file should be (it hung `plan`), a character device twin of /dev/zero (it filled memory), a
block device (its content would have landed in the journal), a link to a device node, and a
device node or FIFO where a kernel file of the image's /proc is. Each is never opened: `plan`
finishes and leaves the file out, `apply` exits 2 naming it with nothing written (no journal
either), and nothing outside DIR changes. Subprocesses with a timeout and a memory limit, on
fixture roots (never the live system).

And the choice for an image's /proc and /sys (no live kernel there): a kernel file is written
in place only when the image holds it as a regular file, never created."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sysconf import SysRoot
from sysconf.changes import Change, Journal
from sysconf.confined import ConfinedRoot, PathRefused
from sysconf.regular_files import MAX_READ_BYTES, NotRegularFile, TooLarge
from tests.support import REPO
from tests.support.roots import board_root

pytestmark = pytest.mark.integration
IRQBALANCE = "/etc/default/irqbalance"
MEMORY_LIMIT = 2 * 2**30  # reading /dev/zero's twin to the end hits this within seconds


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def edgectl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edged.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,  # a FIFO read blocked forever: the test's failure then
        preexec_fn=_limit_memory,
        env={**os.environ, "EDGED_STATE_DIR": "/nonexistent-edged-state"},
    )


def plan_args(root: Path) -> list[str]:
    return ["--root", str(root), "--inference-cpus", "6-7", "--json"]


def planned_paths(root: Path) -> list[str]:
    done = edgectl("plan", *plan_args(root))
    assert done.returncode == 0, done.stderr
    return [c["path"] for c in json.loads(done.stdout)["changes"]]


def state(top: Path) -> dict[str, object]:
    """Every name under `top` with what it is: a regular file's bytes and mode, a link's
    target, a special file's type and numbers (never opened: that is what is under test)."""
    out: dict[str, object] = {}
    for folder, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            path = Path(folder, name)
            st = path.lstat()
            rel = path.relative_to(top).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = (path.read_bytes(), stat.S_IMODE(st.st_mode))
            else:
                out[rel] = (stat.S_IFMT(st.st_mode), st.st_rdev)
    return out


def host_block_device() -> tuple[int, int] | None:
    """The numbers of a block device this machine has (its content must never be read)."""
    try:
        names = sorted(os.listdir("/sys/dev/block"))
    except OSError:
        return None
    for name in names:
        major, _, minor = name.partition(":")
        if major.isdigit() and minor.isdigit():
            return int(major), int(minor)
    return None


def make_special(target: Path, kind: str) -> None:
    """Replace `target` by a special file of `kind` (root's mknod; skipped otherwise)."""
    if kind != "fifo" and os.geteuid() != 0:
        pytest.skip("mknod of a device node needs root")
    if target.exists() or target.is_symlink():
        target.unlink()
    try:
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "chardev":
            os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
        elif kind == "blockdev":
            numbers = host_block_device()
            if numbers is None:
                pytest.skip("this machine lists no block device in /sys/dev/block")
            os.mknod(target, 0o600 | stat.S_IFBLK, os.makedev(*numbers))
        elif kind == "link-to-chardev":
            # A link is data inside the image: /dev/zero of the image, a twin of the host's.
            target.symlink_to("/dev/zero")
        else:
            raise AssertionError(kind)
    except PermissionError as exc:  # a container without CAP_MKNOD
        pytest.skip(f"cannot mknod here: {exc}")


CASES = [
    (IRQBALANCE, "fifo"),
    (IRQBALANCE, "chardev"),
    (IRQBALANCE, "blockdev"),
    (IRQBALANCE, "link-to-chardev"),
    ("irq", "fifo"),
    ("irq", "chardev"),
]
KIND_WORDS = {
    "fifo": "a FIFO",
    "chardev": "a character device",
    "blockdev": "a block device",
    "link-to-chardev": "a character device",
}


@pytest.mark.parametrize(("where", "kind"), CASES)
def test_plan_leaves_special_files_out_and_apply_refuses_the_root(
    tmp_path: Path, where: str, kind: str
) -> None:
    root = board_root(tmp_path / "root", cpus=8, managed=(0, 1))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("host file\n")
    paths = planned_paths(root)
    if where == "irq":
        where = next(p for p in paths if p.startswith("/proc/irq/") and p[10].isdigit())
    assert where in paths
    target = root / where.lstrip("/")
    make_special(target, kind)
    named = target
    if kind == "link-to-chardev":
        named = root / "dev" / "zero"
        named.parent.mkdir(exist_ok=True)
        make_special(named, "chardev")
    before, outside_before = state(root), state(tmp_path / "outside")

    plan = edgectl("plan", *plan_args(root))
    assert plan.returncode == 0, plan.stderr
    assert where not in [c["path"] for c in json.loads(plan.stdout)["changes"]]

    applied = edgectl("apply", *plan_args(root))
    assert applied.returncode == 2, applied.stdout + applied.stderr
    assert "Traceback" not in applied.stderr
    assert str(named) in applied.stderr and KIND_WORDS[kind] in applied.stderr, applied.stderr
    assert "nothing was applied" in applied.stderr
    assert state(root) == before  # nothing written: not even a journal
    assert not (root / "var/lib/edged/tuning-journal.jsonl").exists()
    assert state(tmp_path / "outside") == outside_before


def test_a_link_out_of_proc_to_the_hosts_dev_zero_is_not_read(tmp_path: Path) -> None:
    """The probes join paths and let the host follow links (sysconf.sysroot): DIR/proc/
    interrupts -> /dev/zero was the host's /dev/zero, read until memory ran out."""
    root = board_root(tmp_path / "root", cpus=8)
    interrupts = root / "proc" / "interrupts"
    interrupts.unlink()
    interrupts.symlink_to("/dev/zero")
    plan = edgectl("plan", *plan_args(root))
    assert plan.returncode == 0, plan.stderr[-2000:]
    applied = edgectl("apply", *plan_args(root))
    assert applied.returncode == 2 and "Traceback" not in applied.stderr, applied.stderr[-2000:]
    assert str(interrupts) in applied.stderr


def test_the_confined_reader_never_reads_a_special_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    os.mkfifo(root / "etc" / "fifo")
    files = ConfinedRoot(root, refused=[])
    with pytest.raises(NotRegularFile, match="a FIFO"):
        files.read_bytes("/etc/fifo")
    assert files.refused and "etc/fifo" in files.refused[0]
    if os.geteuid() == 0:
        (root / "dev").mkdir()
        os.mknod(root / "dev" / "zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        (root / "etc" / "zero").symlink_to("/dev/zero")  # the image's /dev/zero
        with pytest.raises(NotRegularFile, match="a character device"):
            files.read_bytes("/etc/zero")
    big = root / "etc" / "big"
    with big.open("wb") as f:
        f.truncate(MAX_READ_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(TooLarge, match="larger than"):
        files.read_bytes("/etc/big")
    # The probes' reader answers "absent" for each, and notes why.
    sysroot = SysRoot(root)
    assert sysroot.read_bytes("/etc/fifo") is None and sysroot.read_bytes("/etc/big") is None
    assert len(sysroot.refused) == 2


def test_a_kernel_file_write_never_goes_through_a_fifo_or_device(tmp_path: Path) -> None:
    """An image's proc/irq/N/smp_affinity_list as a FIFO (a reader is waiting, so a write
    would not block but land in it) and as a node with /dev/null's numbers."""
    root = tmp_path / "root"
    folder = root / "proc" / "irq" / "24"
    folder.mkdir(parents=True)
    fifo = folder / "smp_affinity_list"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    files = ConfinedRoot(root)
    try:
        with pytest.raises(NotRegularFile, match="a FIFO"):
            files.write("/proc/irq/24/smp_affinity_list", "3", kernel=True)
        assert os.read(reader, 16) == b""  # nothing reached it
    finally:
        os.close(reader)
    with pytest.raises(PathRefused, match="a FIFO"):
        files.write("/proc/irq/24/smp_affinity_list", "3", kernel=False)  # nor replaced
    if os.geteuid() == 0:
        node = folder / "effective_affinity_list"
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        with pytest.raises(NotRegularFile, match="a character device"):
            files.write("/proc/irq/24/effective_affinity_list", "3", kernel=True)
        assert stat.S_ISCHR(node.lstat().st_mode)


def test_an_images_missing_kernel_file_is_not_created(tmp_path: Path) -> None:
    """An image's /proc and /sys are no live kernel: apply writes a kernel file there only
    when the image has it (a captured tree), and never makes one up."""
    root = tmp_path / "root"
    (root / "proc" / "sys" / "kernel").mkdir(parents=True)
    (root / "proc" / "sys" / "kernel" / "timer_migration").write_text("1\n")
    journal = Journal(SysRoot(root))
    result = journal.apply(
        [
            Change("sysctl", "/proc/sys/kernel/timer_migration", "1\n", "0", "timers"),
            Change("sysctl", "/proc/sys/kernel/made_up", None, "0", "not in the image"),
        ]
    )
    assert [c.path for c in result.applied] == ["/proc/sys/kernel/timer_migration"]
    ((skipped, why),) = result.skipped
    assert skipped.path == "/proc/sys/kernel/made_up" and why.startswith("ENOENT")
    assert not (root / "proc" / "sys" / "kernel" / "made_up").exists()
    assert (root / "proc" / "sys" / "kernel" / "timer_migration").read_text() == "0"
    journal.revert()
    assert (root / "proc" / "sys" / "kernel" / "timer_migration").read_text() == "1\n"


def test_apply_of_a_change_whose_file_is_a_fifo_writes_nothing(tmp_path: Path) -> None:
    """A change (or a revert record) naming a FIFO is refused before any change is written,
    the ones before it included."""
    root = tmp_path / "root"
    (root / "etc" / "default").mkdir(parents=True)
    (root / "etc" / "default" / "a").write_text("A=1\n")
    os.mkfifo(root / "etc" / "default" / "b")
    journal = Journal(SysRoot(root))
    done = threading.Event()

    def apply() -> None:
        with pytest.raises(NotRegularFile, match="a FIFO"):
            journal.apply(
                [
                    Change("irqbalance", "/etc/default/a", "A=1\n", "A=2\n", "first"),
                    Change("irqbalance", "/etc/default/b", "", "B=2\n", "second"),
                ]
            )
        done.set()

    worker = threading.Thread(target=apply, daemon=True)
    worker.start()
    worker.join(30)
    assert done.is_set(), "apply blocked on the FIFO"
    assert (root / "etc" / "default" / "a").read_text() == "A=1\n"
    assert not journal.path.exists()
