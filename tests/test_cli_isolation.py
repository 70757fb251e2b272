"""edgectl plan / apply / revert on roots (never the live system): JSON shapes scripts rely
on, the journal inside the root, exact revert, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from roots import board_root, snapshot_live, tree_state

REPO = Path(__file__).resolve().parent.parent


def edgectl(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    assert "--root" in args or args[0] == "plan", "tests must never apply to the live system"
    proc = subprocess.run([sys.executable, "-m", "edged.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "EDGED_STATE_DIR": "/nonexistent-edged-state"})
    assert proc.returncode == rc, proc.stderr
    return proc


@pytest.mark.parametrize("kind", ["live-snapshot", "arm8"])
def test_plan_apply_revert_round_trip(tmp_path: Path, kind: str) -> None:
    if kind == "live-snapshot":
        root = snapshot_live(tmp_path / "root")
        cpus = str(max(os.sched_getaffinity(0)))
    else:
        root = board_root(tmp_path / "root", cpus=8, managed=(0, 1))
        cpus = "6-7"
    before = tree_state(root)
    plan = json.loads(edgectl("plan", "--root", str(root), "--inference-cpus", cpus,
                              "--json").stdout)
    assert plan["changes"], "a fresh root needs changes"
    for change in plan["changes"]:
        assert set(change) == {"kind", "path", "old", "new", "reason"}
        assert (root / change["path"].lstrip("/")).exists()
    assert plan["cpus"]["inference_list"] == cpus
    applied = json.loads(edgectl("apply", "--root", str(root), "--inference-cpus", cpus,
                                 "--json").stdout)
    assert len(applied["applied"]) + len(applied["skipped"]) == len(plan["changes"])
    journal = root / "var" / "lib" / "edged" / "tuning-journal.jsonl"
    assert journal.exists()  # the image carries its own journal
    again = json.loads(edgectl("plan", "--root", str(root), "--inference-cpus", cpus,
                               "--json").stdout)
    assert again["changes"] == [], "applying twice must change nothing"
    reverted = json.loads(edgectl("revert", "--root", str(root), "--json").stdout)
    assert len(reverted["reverted"]) == len(applied["applied"])
    assert tree_state(root) == before
    assert "nothing to revert" in edgectl("revert", "--root", str(root)).stdout


def test_plan_text_names_unmovable_irqs(tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4, managed=(0, 1, 2, 3))
    text = edgectl("plan", "--root", str(root), "--inference-cpus", "3").stdout
    assert "inference CPUs 3, housekeeping 0-2" in text
    assert "cannot move IRQ" in text and "managed_irq" in text


def test_config_cpus_and_boot_line(tmp_path: Path, models_dir: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    (root / "boot" / "firmware").mkdir(parents=True)
    (root / "boot" / "firmware" / "cmdline.txt").write_text(
        "console=serial0,115200 console=tty1 root=PARTUUID=6c586e13-02 rootwait\n")
    config = tmp_path / "edged.toml"
    config.write_text(f'[[models]]\nname = "m"\npath = "{models_dir / "ppocr_cls.onnx"}"\n'
                      f'cpus = "2-3"\n')
    plan = json.loads(edgectl("plan", "--root", str(root), "--config", str(config),
                              "--json").stdout)
    assert plan["cpus"]["inference_list"] == "2-3" and plan["cpus"]["source"] == "configured"
    [cmdline] = [c for c in plan["changes"] if c["kind"] == "cmdline"]
    assert "isolcpus=managed_irq,domain,2-3" in cmdline["new"]
    assert "irqaffinity=0-1" in cmdline["new"] and "rootwait" in cmdline["new"]


@pytest.mark.parametrize(("args", "message"), [
    (("--inference-cpus", "0-3"), "housekeeping"),
    (("--inference-cpus", "9"), "CPUs 9 are not online"),
    (("--inference-cpus", "x"), "--inference-cpus: bad CPU list"),
])
def test_bad_cpus_exit_2(tmp_path: Path, args, message: str) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    proc = edgectl("plan", "--root", str(root), *args, rc=2)
    assert message in proc.stderr and proc.stderr.startswith("edgectl: error: ")


def test_corrupt_journal_is_a_clear_error(tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    edgectl("apply", "--root", str(root), "--inference-cpus", "3")
    journal = root / "var" / "lib" / "edged" / "tuning-journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    proc = edgectl("revert", "--root", str(root), rc=2)
    assert "tuning-journal.jsonl: line 2" in proc.stderr
    assert journal.exists()  # nothing was touched


def test_image_root_takes_its_cpus_from_the_board_dtb(tmp_path: Path, dtb_corpus: Path) -> None:
    image = tmp_path / "image"
    (image / "etc" / "default").mkdir(parents=True)
    (image / "etc" / "default" / "grub").write_text('GRUB_CMDLINE_LINUX_DEFAULT="quiet"\n')
    proc = edgectl("plan", "--root", str(image), rc=2)
    assert "no CPU information" in proc.stderr and "--dtb" in proc.stderr
    dtb = dtb_corpus / "freescale" / "imx8mp-evk.dtb"  # 4 Cortex-A53
    plan = json.loads(edgectl("plan", "--root", str(image), "--dtb", str(dtb), "--json").stdout)
    assert plan["cpus"]["inference_list"] == "3" and plan["cpus"]["housekeeping_list"] == "0-2"
    [grub] = [c for c in plan["changes"] if c["kind"] == "cmdline"]
    assert "isolcpus=managed_irq,domain,3" in grub["new"]


def test_rt_priority_in_config_turns_rt_throttling_off(tmp_path: Path) -> None:
    """Only a config with a SCHED_FIFO model (rt_priority) plans sched_rt_runtime_us=-1."""
    root = board_root(tmp_path / "root", cpus=4)
    runtime = root / "proc/sys/kernel/sched_rt_runtime_us"
    runtime.parent.mkdir(parents=True, exist_ok=True)
    runtime.write_text("950000\n")
    (tmp_path / "m.onnx").write_bytes(b"")
    config = tmp_path / "edged.toml"
    model = '[[models]]\nname = "m"\npath = "m.onnx"\ncpus = "3"\n'

    def planned() -> list[dict]:
        plan = json.loads(edgectl("plan", "--root", str(root), "--config", str(config),
                                  "--json").stdout)
        return [c for c in plan["changes"] if c["path"] == "/proc/sys/kernel/sched_rt_runtime_us"]

    config.write_text(model)
    assert planned() == []
    config.write_text(model + "rt_priority = 50\n")
    assert [(c["old"], c["new"]) for c in planned()] == [("950000\n", "-1")]
    before = tree_state(root)
    edgectl("apply", "--root", str(root), "--config", str(config), "--json")
    assert runtime.read_text() == "-1"
    edgectl("revert", "--root", str(root), "--json")
    assert tree_state(root) == before
