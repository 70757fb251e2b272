"""sysconf.irq: /proc/interrupts parsing, what cannot move, and the IRQ plan through the journal.

Everything that writes goes to a root under tmp_path: a snapshot of this machine's own IRQ files
or a synthetic board (tests/support/roots.py). This machine's /proc/irq is only read.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from sysconf.changes import Change, Journal, write_file
from sysconf.cpulist import parse_cpulist, parse_cpumask
from sysconf.cpusets import CpuPlan, decide, read_cpusets
from sysconf.irq import (
    IrqLine,
    parse_interrupts,
    plan_irqs,
    read_interrupts,
    read_irq_report,
    set_banned_cpus,
)
from sysconf.sysroot import SysRoot
from tests.support.roots import (
    DEBIAN_IRQBALANCE,
    board,
    board_root,
    snapshot_live,
    tree_state,
)


def plan_for(root: Path, inference: list[int]) -> CpuPlan:
    return decide(read_cpusets(SysRoot(root)), configured=inference)


def by_path(changes: list[Change]) -> dict[str, Change]:
    return {c.path: c for c in changes}


def irq_changes(changes: list[Change]) -> dict[str, str]:
    """{irq number: new affinity list} of the per-IRQ changes."""
    return {c.path.split("/")[3]: c.new for c in changes if c.kind == "irq"}


# -- parsing ----------------------------------------------------------------------------------

X86 = """\
            CPU0       CPU1       CPU2       CPU3
   0:         44          0          0          0   IO-APIC   2-edge      timer
   1:          0          9          0          0   IO-APIC   1-edge      i8042, ehci_hcd:usb1
  24:          0          0       3101          0  IR-PCI-MSI 512000-edge      ahci[0000:00:1f.2]
  25:          0          0          0          0  DMAR-MSI      -edge      dmar0
 NMI:          1          2          3          4   Non-maskable interrupts
 LOC:     397935     438956       1000       2000   Local timer interrupts
 ERR:          0
 MIS:          7
"""

ARM = """\
           CPU0       CPU1       CPU2       CPU3
 11:       1234       5678        910       1112     GICv3  27 Level     arch_timer
 20:          7          0          0          0     GICv3 130 Level     fe2c0000.mmc
 77:          3          0          0          0  rockchip_gpio_irq   5 Edge      fe2c0000.mmc cd
 97:         76          0          0          0  ITS-MSI 524288 Edge      nvme0q1
IPI0:        97        102         11         12       Rescheduling interrupts
Err:          0
"""


def test_parse_x86_rows() -> None:
    cpus, rows = parse_interrupts(X86)
    assert cpus == [0, 1, 2, 3]
    rows_by = {r.irq: r for r in rows}
    assert rows_by["24"] == IrqLine(
        "24", [0, 0, 3101, 0], "IR-PCI-MSI", "512000", "ahci[0000:00:1f.2]", True, "edge"
    )
    assert rows_by["1"].actions == "i8042, ehci_hcd:usb1"  # shared line, both actions
    assert (rows_by["25"].hwirq, rows_by["25"].trigger) == ("", "edge")  # no domain
    assert rows_by["LOC"] == IrqLine(
        "LOC", [397935, 438956, 1000, 2000], actions="Local timer interrupts"
    )
    assert rows_by["MIS"].counts == [7] and not rows_by["MIS"].numeric


def test_parse_arm_rows() -> None:
    _, rows = parse_interrupts(ARM)
    rows_by = {r.irq: r for r in rows}
    assert rows_by["11"] == IrqLine(
        "11", [1234, 5678, 910, 1112], "GICv3", "27", "arch_timer", True, "Level"
    )
    assert rows_by["77"].chip == "rockchip_gpio_irq"
    assert rows_by["77"].actions == "fe2c0000.mmc cd"  # an action name with a space
    assert (rows_by["97"].chip, rows_by["97"].hwirq) == ("ITS-MSI", "524288")
    assert rows_by["IPI0"].actions == "Rescheduling interrupts"
    assert rows_by["Err"].counts == [0]


def test_parse_gaps_in_the_header_and_odd_lines() -> None:
    text = (
        "           CPU0       CPU2       CPU3\n"
        "  5:   1   2   3  RISC-V INTC   5 Edge      riscv-timer\n"
        "this is not a row\n"
        "  6:   1   2\n"  # a truncated row: what is there is kept
        "\n"
    )
    cpus, rows = parse_interrupts(text)
    assert cpus == [0, 2, 3]  # CPU1 offline
    assert rows[0].chip == "RISC-V INTC" and rows[0].actions == "riscv-timer"
    assert rows[0].count_on(cpus, [2, 3]) == 5
    assert rows[1] == IrqLine("6", [1, 2], numeric=True)
    assert parse_interrupts("") == ([], [])


def test_parse_live_snapshot(tmp_path: Path) -> None:
    root = snapshot_live(tmp_path)
    text = (root / "proc/interrupts").read_text()
    cpus, rows = read_interrupts(SysRoot(root))
    assert cpus == read_cpusets(SysRoot(root)).online
    assert len(rows) == len([line for line in text.splitlines()[1:] if line.strip()])
    numeric = [r for r in rows if r.numeric]
    assert numeric, "no numbered IRQ rows"
    for row in numeric:
        assert len(row.counts) == len(cpus), row
        assert row.chip and row.actions, row
        assert (root / f"proc/irq/{row.irq}").is_dir(), row
    named = [r for r in rows if not r.numeric]
    assert named, "no named rows (LOC:, IPI0:, ...)"
    for row in named:
        assert 1 <= len(row.counts) <= len(cpus), row
        if len(row.counts) == len(cpus):
            assert row.actions, row  # the description ("Local timer interrupts")


@pytest.mark.parametrize("cpus", [4, 6, 8])
@pytest.mark.parametrize("arm", [True, False])
def test_parse_board_roots(tmp_path: Path, cpus: int, arm: bool) -> None:
    root = board_root(tmp_path, cpus=cpus, arm=arm)
    header, rows = read_interrupts(SysRoot(root))
    layout = board(cpus, arm)
    assert header == list(range(cpus))
    numeric = {r.irq: r for r in rows if r.numeric}
    assert set(numeric) == {str(i.irq) for i in layout.irqs}
    for spec in layout.irqs:
        row = numeric[str(spec.irq)]
        assert (row.chip, row.hwirq, row.trigger, row.actions, row.counts) == (
            spec.chip,
            spec.hwirq,
            spec.trigger,
            spec.action,
            spec.counts,
        )
    named = [r.irq for r in rows if not r.numeric]
    expected = [f"IPI{i}" for i in range(7)] + ["Err"] if arm else ["NMI", "LOC", "RES", "ERR"]
    assert set(expected) <= set(named)


# -- classification ---------------------------------------------------------------------------


def test_arm_per_cpu_interrupts_cannot_move(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4)
    changes, unmovable = plan_irqs(SysRoot(root), plan_for(root, [2, 3]))
    found = {u.irq: u for u in unmovable}
    assert "PPI 27" in found["11"].why and "nohz_full=2-3" in found["11"].remedy
    assert found["11"].name == "arch_timer"
    assert "13" in found  # arm-pmu: a PPI that fired there
    assert "12" not in found  # vgic never fired: not worth a line
    assert {"IPI0", "IPI1", "IPI5"} <= set(found)
    assert "IPI2" not in found and "Err" not in found
    # Per-CPU ones are never planned, even though their files exist.
    assert not {"11", "12", "13"} & set(irq_changes(changes))


def test_managed_queue_irqs_via_debugfs(tmp_path: Path) -> None:
    layout = board(4)
    root = board_root(tmp_path, cpus=4, managed=layout.nvme_queues, readonly_modes=False)
    changes, unmovable = plan_irqs(SysRoot(root), plan_for(root, [2, 3]))
    found = {u.irq: u for u in unmovable}
    queues_there = {str(irq) for irq in layout.nvme_queues[2:]}  # nvme0q3, q4: CPUs 2, 3
    assert queues_there <= set(found)
    for irq in queues_there:
        assert "IRQD_AFFINITY_MANAGED" in found[irq].why
        assert "isolcpus=managed_irq,2-3" in found[irq].remedy
    # Queues of housekeeping CPUs are not reported, and no queue is planned.
    assert not {str(irq) for irq in layout.nvme_queues[:2]} & set(found)
    assert not {str(irq) for irq in layout.nvme_queues} & set(irq_changes(changes))
    assert "96" in irq_changes(changes)  # the admin queue is an ordinary IRQ


def test_read_only_affinity_files_are_unmovable(tmp_path: Path) -> None:
    layout = board(4)
    root = board_root(tmp_path, cpus=4)  # no debugfs; the kernel's 0444 modes tell
    changes, unmovable = plan_irqs(SysRoot(root), plan_for(root, [3]))
    found = {u.irq: u for u in unmovable}
    assert str(layout.nvme_queues[3]) in found
    assert "read-only" in found[str(layout.nvme_queues[3])].why
    assert "isolcpus=managed_irq,3" in found[str(layout.nvme_queues[3])].remedy
    assert {"77", "78"} <= set(found)  # chained GPIO interrupts
    assert not {"77", "78"} & set(irq_changes(changes))


def test_irq_without_affinity_file(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4)
    npu = board(4).by_action("fdab0000.npu").irq  # fired only on CPU 3
    (root / f"proc/irq/{npu}/smp_affinity_list").unlink()
    changes, unmovable = plan_irqs(SysRoot(root), plan_for(root, [3]))
    (problem,) = [u for u in unmovable if u.irq == str(npu)]
    assert "no /proc/irq" in problem.why
    assert str(npu) not in irq_changes(changes)


# -- planning ---------------------------------------------------------------------------------


def test_plan_on_this_machine(tmp_path: Path) -> None:
    root = snapshot_live(tmp_path)
    online = read_cpusets(SysRoot(root)).online
    if len(online) < 2:
        pytest.skip("a 1-CPU machine has no core to isolate")
    inference = [online[-1]]  # CPU 1 on the 2-CPU test machine
    plan = plan_for(root, inference)
    report = read_irq_report(SysRoot(root))
    changes, unmovable = plan_irqs(SysRoot(root), plan)
    for change in changes:
        assert (root / change.path.lstrip("/")).exists(), change.path
        assert change.old == (root / change.path.lstrip("/")).read_text().strip()
    for change in (c for c in changes if c.kind == "irq"):
        new = parse_cpulist(change.new)
        assert new and inference[0] not in new, change
        assert change.reason.startswith(f"IRQ {change.path.split('/')[3]} (")
    planned = set(irq_changes(changes))
    reported = {u.irq for u in unmovable}
    for irq, cpus in report.affinity.items():
        if inference[0] not in cpus:
            assert irq not in planned  # already off the inference core: no change
        elif irq not in report.read_only:
            assert irq in planned
        else:
            assert irq in reported and irq not in planned
    default = by_path(changes).get("/proc/irq/default_smp_affinity")
    current = (root / "proc/irq/default_smp_affinity").read_text().strip()
    if inference[0] in parse_cpumask(current):
        assert default is not None
        assert len(default.new) == len(current) and default.new.count(",") == current.count(",")
        assert inference[0] not in parse_cpumask(default.new)
        assert parse_cpumask(default.new)


def test_plan_board_two_inference_cores(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4)
    layout = board(4)
    changes, _ = plan_irqs(SysRoot(root), plan_for(root, [2, 3]))
    moved = irq_changes(changes)
    assert moved[str(layout.by_action("fdab0000.npu").irq)] == "0-1"  # was pinned to 3
    assert moved[str(layout.by_action("xhci-hcd:usb1").irq)] == "0-1"  # was 2-3
    assert moved[str(layout.by_action("mmc0").irq)] == "0-1"
    assert str(layout.by_action("eth0").irq) not in moved  # already on 0-1: no change
    default = by_path(changes)["/proc/irq/default_smp_affinity"]
    assert (default.old, default.new, default.kind) == ("f", "3", "irq-default")
    npu = by_path(changes)[f"/proc/irq/{layout.by_action('fdab0000.npu').irq}/smp_affinity_list"]
    assert npu.old == "3"
    assert npu.reason == ("IRQ 29 (fdab0000.npu) off inference cores 2-3: effective 3 -> 0-1")
    assert (changes[0].kind, changes[-1].kind) == ("irq-default", "irqbalance")


def test_plan_board_one_inference_core_keeps_the_rest_of_an_affinity(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4)
    layout = board(4)
    moved = irq_changes(plan_irqs(SysRoot(root), plan_for(root, [3]))[0])
    assert moved[str(layout.by_action("xhci-hcd:usb1").irq)] == "2"  # 2-3 minus 3
    assert moved[str(layout.by_action("fdab0000.npu").irq)] == "0-2"  # nothing left: all
    assert moved[str(layout.by_action("mmc0").irq)] == "0-2"


def test_plan_x86_board(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=6, arm=False)
    changes, unmovable = plan_irqs(SysRoot(root), plan_for(root, [5]))
    moved = irq_changes(changes)
    layout = board(6, arm=False)
    assert moved[str(layout.by_action("i915").irq)] == "0-4"
    assert str(layout.by_action("enp1s0").irq) not in moved  # pinned to CPU 0
    assert {"LOC", "RES", "CAL"} <= {u.irq for u in unmovable}
    assert str(layout.nvme_queues[5]) in {u.irq for u in unmovable}
    assert by_path(changes)["/proc/irq/default_smp_affinity"].new == "1f"


def test_missing_effective_affinity_is_said(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4)
    npu = board(4).by_action("fdab0000.npu").irq
    (root / f"proc/irq/{npu}/effective_affinity_list").unlink()  # kernels before 4.15
    changes, _ = plan_irqs(SysRoot(root), plan_for(root, [3]))
    change = by_path(changes)[f"/proc/irq/{npu}/smp_affinity_list"]
    assert "effective unknown -> 0-2" in change.reason


def test_default_mask_keeps_width_and_groups(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=8)
    (root / "proc/irq/default_smp_affinity").write_text("00000000,000000ff\n")
    changes, _ = plan_irqs(SysRoot(root), plan_for(root, [6, 7]))
    assert by_path(changes)["/proc/irq/default_smp_affinity"].new == "00000000,0000003f"


def test_nothing_to_protect_and_no_housekeeping() -> None:
    assert plan_irqs(SysRoot(Path("/nonexistent")), CpuPlan((), (0, 1), "configured")) == ([], [])
    with pytest.raises(ValueError, match="no housekeeping"):
        plan_irqs(SysRoot(Path("/nonexistent")), CpuPlan((0, 1), (), "configured"))


def test_effective_on(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4)
    report = read_irq_report(SysRoot(root))
    on_three = {line.irq for line in report.effective_on([3])}
    layout = board(4)
    assert {str(layout.by_action("fdab0000.npu").irq), "11", "IPI0"} <= on_three
    assert str(layout.by_action("mmc0").irq) not in on_three  # effective CPU 0
    assert "Err" not in on_three


# -- irqbalance -------------------------------------------------------------------------------


def test_irqbalance_debian_commented_line_replaced_rest_byte_for_byte(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4)
    changes, _ = plan_irqs(SysRoot(root), plan_for(root, [2, 3]))
    change = by_path(changes)["/etc/default/irqbalance"]
    assert change.kind == "irqbalance" and change.old == DEBIAN_IRQBALANCE
    old_lines = change.old.splitlines(keepends=True)
    new_lines = change.new.splitlines(keepends=True)
    assert len(old_lines) == len(new_lines)
    differing = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
    assert differing == [("#IRQBALANCE_BANNED_CPULIST=\n", "IRQBALANCE_BANNED_CPULIST=2-3\n")]


def test_irqbalance_rhel_file(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4, irqbalance="rhel")
    change = by_path(plan_irqs(SysRoot(root), plan_for(root, [3]))[0])["/etc/sysconfig/irqbalance"]
    assert "\nIRQBALANCE_BANNED_CPULIST=3\n" in change.new
    assert (
        change.new.replace("IRQBALANCE_BANNED_CPULIST=3\n", "#IRQBALANCE_BANNED_CPULIST=\n")
        == change.old
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # an active assignment wins over a commented one; other lines untouched
        (
            "#IRQBALANCE_BANNED_CPULIST=\nIRQBALANCE_BANNED_CPULIST=1\nX=1\n",
            "#IRQBALANCE_BANNED_CPULIST=\nIRQBALANCE_BANNED_CPULIST=2-3\nX=1\n",
        ),
        # an empty value bans nothing explicitly: it is replaced
        ("IRQBALANCE_BANNED_CPULIST=\n", "IRQBALANCE_BANNED_CPULIST=2-3\n"),
        # already right (quoted, other spelling): kept byte for byte
        ('IRQBALANCE_BANNED_CPULIST="2,3"\n', 'IRQBALANCE_BANNED_CPULIST="2,3"\n'),
        # absent: appended, also after a last line without newline
        (
            "IRQBALANCE_ARGS=--hintpolicy=ignore",
            "IRQBALANCE_ARGS=--hintpolicy=ignore\nIRQBALANCE_BANNED_CPULIST=2-3\n",
        ),
        ("", "IRQBALANCE_BANNED_CPULIST=2-3\n"),
        # CRLF endings survive
        (
            "A=1\r\n# IRQBALANCE_BANNED_CPULIST=0\r\nB=2\r\n",
            "A=1\r\nIRQBALANCE_BANNED_CPULIST=2-3\r\nB=2\r\n",
        ),
        # the deprecated mask is read first by irqbalance: an active one is kept consistent
        (
            "IRQBALANCE_BANNED_CPUS=00000001\n",
            "IRQBALANCE_BANNED_CPUS=0000000c\nIRQBALANCE_BANNED_CPULIST=2-3\n",
        ),
        (
            "#IRQBALANCE_BANNED_CPUS=\nexport IRQBALANCE_BANNED_CPULIST=0\n",
            "#IRQBALANCE_BANNED_CPUS=\nexport IRQBALANCE_BANNED_CPULIST=2-3\n",
        ),
    ],
)
def test_set_banned_cpus(text: str, expected: str) -> None:
    assert set_banned_cpus(text, (2, 3)) == expected
    assert set_banned_cpus(expected, (2, 3)) == expected  # idempotent


def test_irqbalance_installed_without_defaults_file_is_noted(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4, irqbalance="binary")
    changes, _ = plan_irqs(SysRoot(root), plan_for(root, [3]))
    assert not [c for c in changes if c.kind == "irqbalance"]
    assert (
        "irqbalance is installed but has no defaults file"
        in by_path(changes)["/proc/irq/default_smp_affinity"].reason
    )


# -- apply, idempotence, revert ---------------------------------------------------------------


def _roots(tmp_path: Path, kind: str) -> tuple[Path, list[int]]:
    if kind == "live":
        root = snapshot_live(tmp_path / "root")
        online = read_cpusets(SysRoot(root)).online
        if len(online) < 2:
            pytest.skip("a 1-CPU machine has no core to isolate")
        return root, [online[-1]]
    if kind == "arm4":
        return board_root(tmp_path / "root", cpus=4), [2, 3]
    if kind == "arm8-managed":
        return board_root(
            tmp_path / "root",
            cpus=8,
            managed=board(8).nvme_queues,
            isolated="4-7",
            irqbalance="rhel",
        ), [4, 5, 6, 7]
    return board_root(tmp_path / "root", cpus=6, arm=False), [5]


@pytest.mark.parametrize("kind", ["live", "arm4", "arm8-managed", "x86-6"])
def test_apply_is_idempotent_and_revert_is_exact(tmp_path: Path, kind: str) -> None:
    root, inference = _roots(tmp_path, kind)
    sysroot = SysRoot(root)
    before = tree_state(root)
    plan = plan_for(root, inference)
    changes, _ = plan_irqs(sysroot, plan)
    assert changes

    journal = Journal(sysroot, state_dir="/var/lib/edged")
    result = journal.apply(changes)
    assert len(result.applied) == len(changes) and not result.skipped
    for change in changes:
        assert (root / change.path.lstrip("/")).read_text().strip() == change.new.strip()
    assert (root / "var/lib/edged").is_dir()

    again, _ = plan_irqs(sysroot, plan)
    assert again == []  # applied: nothing left to do

    journal.revert()
    assert tree_state(root) == before  # every byte and mode, journal folder aside


def test_refused_write_is_skipped_and_revert_still_exact(tmp_path: Path) -> None:
    """An older kernel: no debugfs, every file 0644, so managed queues are planned and the
    kernel answers EIO when they are written."""
    layout = board(4)
    root = board_root(tmp_path, cpus=4, readonly_modes=False)
    before = tree_state(root)
    changes, unmovable = plan_irqs(SysRoot(root), plan_for(root, [2, 3]))
    managed_paths = {f"/proc/irq/{irq}/smp_affinity_list" for irq in layout.nvme_queues[2:]}
    assert managed_paths <= set(by_path(changes))
    assert not {str(irq) for irq in layout.nvme_queues} & {u.irq for u in unmovable}

    def kernel(path: Path, content: str, is_kernel: bool) -> None:
        if "/".join(path.parts[-3:-1]) in {f"irq/{irq}" for irq in layout.nvme_queues}:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        write_file(path, content, is_kernel)

    journal = Journal(SysRoot(root), writer=kernel)
    result = journal.apply(changes)
    assert {c.path for c, _ in result.skipped} == managed_paths
    assert all(why.startswith("EIO") for _, why in result.skipped)
    journal.revert()
    assert tree_state(root) == before
