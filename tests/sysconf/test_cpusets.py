"""sysconf.cpusets: the CPU sets the kernel reports and the inference/housekeeping decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from sysconf.cpulist import parse_cpulist
from sysconf.cpusets import CpuPlan, CpuSets, decide, parse_cmdline, parse_isolcpus, read_cpusets
from sysconf.sysroot import SysRoot
from tests.support.roots import board_root, snapshot_live


def sets(online: list[int], isolated: list[int] | None = None) -> CpuSets:
    return CpuSets(
        online=online,
        isolated=isolated or [],
        nohz_full=[],
        isolcpus=[],
        isolcpus_flags=[],
        rcu_nocbs=[],
        irqaffinity=[],
        cmdline="",
    )


# -- reading ----------------------------------------------------------------------------------


def test_live_read_matches_the_kernel_files() -> None:
    cs = read_cpusets(SysRoot())
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert cs.online == online and online
    assert set(cs.isolated) <= set(cs.online)
    assert cs.cmdline == Path("/proc/cmdline").read_text().strip()
    isolated = Path("/sys/devices/system/cpu/isolated")
    assert cs.isolated == (parse_cpulist(isolated.read_text()) if isolated.exists() else [])


def test_snapshot_of_this_machine_reads_like_the_machine(tmp_path: Path) -> None:
    assert read_cpusets(SysRoot(snapshot_live(tmp_path))) == read_cpusets(SysRoot())


def test_board_with_isolation_on_the_command_line(tmp_path: Path) -> None:
    root = board_root(
        tmp_path,
        cpus=8,
        isolated="4-7",
        cmdline="console=ttyS2,1500000n8 isolcpus=managed_irq,domain,4-7 "
        "nohz_full=4-7 rcu_nocbs=all irqaffinity=0-3 quiet",
    )
    cs = read_cpusets(SysRoot(root))
    assert cs.online == list(range(8))
    assert cs.isolated == cs.nohz_full == [4, 5, 6, 7]
    assert cs.isolcpus == [4, 5, 6, 7]
    assert cs.isolcpus_flags == ["managed_irq", "domain"]
    assert cs.rcu_nocbs == list(range(8))  # "all"
    assert cs.irqaffinity == [0, 1, 2, 3]
    assert decide(cs) == CpuPlan((4, 5, 6, 7), (0, 1, 2, 3), "isolated")


def test_missing_files_mean_empty_sets(tmp_path: Path) -> None:
    cs = read_cpusets(SysRoot(tmp_path))
    assert cs == sets([])
    with pytest.raises(ValueError, match="no online CPUs"):
        decide(cs)


def test_malformed_values_read_as_empty(tmp_path: Path) -> None:
    root = board_root(tmp_path, cpus=4, cmdline="isolcpus=domain,3-1 rcu_nocbs=x irqaffinity=")
    (root / "sys/devices/system/cpu/isolated").write_text("garbage\n")
    cs = read_cpusets(SysRoot(root))
    assert (cs.isolated, cs.isolcpus, cs.rcu_nocbs, cs.irqaffinity) == ([], [], [], [])
    assert cs.isolcpus_flags == ["domain"]


# -- the command line -------------------------------------------------------------------------


def test_cmdline_flags_values_and_empty_values() -> None:
    params = parse_cmdline("ro quiet root=/dev/mmcblk0p2 nohz_full= console=ttyS0,115200n8\n")
    assert params == {
        "ro": None,
        "quiet": None,
        "root": "/dev/mmcblk0p2",
        "nohz_full": "",
        "console": "ttyS0,115200n8",
    }


def test_cmdline_quotes_as_the_kernel_strips_them() -> None:
    params = parse_cmdline('dyndbg="file foo.c +p" "acpi_osi=Windows 2020" opt="a=b" plain=x"y"z')
    assert params["dyndbg"] == "file foo.c +p"
    assert params["acpi_osi"] == "Windows 2020"
    assert params["opt"] == "a=b"  # only the first = splits
    assert params["plain"] == 'x"y"z'  # quotes inside a value stay


def test_cmdline_last_one_wins_and_dashes_equal_underscores() -> None:
    params = parse_cmdline("isolcpus=1 rcu-nocbs=1 isolcpus=2-3 rcu_nocbs=3")
    assert params["isolcpus"] == "2-3"
    assert params["rcu_nocbs"] == "3"


def test_cmdline_stops_at_init_arguments() -> None:
    # This machine's own command line passes init arguments after "--".
    params = parse_cmdline("console=ttyS0 quiet -- --firecracker-init --addr 0.0.0.0:2024")
    assert params == {"console": "ttyS0", "quiet": None}
    assert "--addr" not in parse_cmdline(Path("/proc/cmdline").read_text())


@pytest.mark.parametrize(
    ("value", "flags", "cpus"),
    [
        ("managed_irq,domain,2-3", ["managed_irq", "domain"], [2, 3]),
        ("2-3", ["domain"], [2, 3]),  # no flag: the kernel applies domain isolation
        ("nohz,managed_irq,1,3", ["nohz", "managed_irq"], [1, 3]),
        ("managed_irq,4-N", ["managed_irq"], [4, 5, 6, 7]),  # N: the last CPU
        ("0-7:1/4", ["domain"], [0, 4]),  # stride: first 1 of every 4
        ("domain,", ["domain"], []),
    ],
)
def test_isolcpus_flags_and_cpus(value: str, flags: list[str], cpus: list[int]) -> None:
    assert parse_isolcpus(value, last_cpu=7) == (flags, cpus)


# -- decide -----------------------------------------------------------------------------------


def test_isolated_set_is_used_when_nothing_is_configured() -> None:
    assert decide(sets([0, 1, 2, 3], [2, 3])) == CpuPlan((2, 3), (0, 1), "isolated")


def test_isolated_set_wins_over_configured_with_a_note() -> None:
    plan = decide(sets([0, 1, 2, 3], [2, 3]), configured=[3])
    assert (plan.inference, plan.housekeeping, plan.source) == ((2, 3), (0, 1), "isolated")
    [note] = plan.notes
    assert "configured inference CPUs 3 differ from the kernel's isolated set 2-3" in note
    # Configured cores equal to the isolated set: nothing to say.
    assert decide(sets([0, 1, 2, 3], [2, 3]), configured=[3, 2]).notes == ()


def test_configured_is_used_without_an_isolated_set() -> None:
    assert decide(sets([0, 1, 2, 3]), configured=[2]) == CpuPlan((2,), (0, 1, 3), "configured")


def test_override_wins_over_isolated_and_configured() -> None:
    plan = decide(sets([0, 1, 2, 3], [2, 3]), configured=[2], override=[1])
    assert (plan.inference, plan.housekeeping, plan.source) == ((1,), (0, 2, 3), "override")
    assert len(plan.notes) == 2
    assert "override 1 is used instead of the kernel's isolated set 2-3" in plan.notes[0]
    assert "override 1 differs from the configured inference CPUs 2" in plan.notes[1]
    assert decide(sets([0, 1, 2, 3]), override=[3]) == CpuPlan((3,), (0, 1, 2), "override")


def test_override_is_checked_like_configured() -> None:
    with pytest.raises(ValueError, match=r"override inference CPUs 5 are not online"):
        decide(sets([0, 1, 2, 3], [2, 3]), override=[5])
    with pytest.raises(ValueError, match=r"\(override\) would leave no housekeeping"):
        decide(sets([0, 1]), override=[0, 1])
    # Offline configured cores are an error even when the isolated set wins.
    with pytest.raises(ValueError, match=r"configured inference CPUs 7 are not online"):
        decide(sets([0, 1, 2, 3], [2, 3]), configured=[7])


def test_default_is_the_last_online_cores() -> None:
    assert decide(sets([0, 1])) == CpuPlan((1,), (0,), "default")
    assert decide(sets([0, 1, 2, 3, 4, 5, 6, 7]), count=4).inference == (4, 5, 6, 7)
    # After a hot-unplug the last *online* core counts, not the last number.
    assert decide(sets([0, 1, 3])).inference == (3,)


def test_isolated_offline_cpus_are_ignored() -> None:
    assert decide(sets([0, 1, 2], [3])).source == "default"


def test_housekeeping_never_empty() -> None:
    with pytest.raises(ValueError, match="no housekeeping CPU"):
        decide(sets([0]))  # a 1-CPU system
    with pytest.raises(ValueError, match=r"inference CPUs 0-3 \(configured\) would leave no"):
        decide(sets([0, 1, 2, 3]), configured=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="no housekeeping CPU"):
        decide(sets([0, 1]), count=2)


def test_configured_offline_or_empty_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"CPUs 4,6 are not online \(online: 0-3\)"):
        decide(sets([0, 1, 2, 3]), configured=[3, 4, 6])
    with pytest.raises(ValueError, match="empty"):
        decide(sets([0, 1]), configured=[])
    with pytest.raises(ValueError, match="at least 1"):
        decide(sets([0, 1]), count=0)


def test_plan_to_dict() -> None:
    plan = decide(sets([0, 1, 2, 3, 4, 5]), configured=[2, 3, 5])
    assert plan.to_dict() == {
        "inference": [2, 3, 5],
        "housekeeping": [0, 1, 4],
        "source": "configured",
        "inference_list": "2-3,5",
        "housekeeping_list": "0-1,4",
        "notes": [],
    }


def test_live_machine_gets_a_plan_or_a_clear_error() -> None:
    cs = read_cpusets(SysRoot())
    if len(cs.online) < 2:
        with pytest.raises(ValueError, match="housekeeping"):
            decide(cs)
        return
    plan = decide(cs)
    assert plan.housekeeping and set(plan.inference).isdisjoint(plan.housekeeping)
    assert sorted(plan.inference + plan.housekeeping) == cs.online
