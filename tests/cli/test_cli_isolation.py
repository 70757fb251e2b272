"""edgectl plan / apply / revert / tune on roots (never the live system): JSON shapes
scripts rely on, the journal inside the root, exact revert, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sysconf.actions import answers, catalogue, evidence_from_telemetry
from tests.support.roots import board_root, snapshot_live, tree_state

REPO = Path(__file__).resolve().parents[2]


def edgectl(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    assert "--root" in args or args[0] == "plan", "tests must never apply to the live system"
    proc = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "EDGED_STATE_DIR": "/nonexistent-edged-state"},
    )
    assert proc.returncode == rc, proc.stderr
    return proc


@pytest.mark.parametrize("kind", ["live-snapshot", "arm8"])
@pytest.mark.integration
def test_plan_apply_revert_round_trip(tmp_path: Path, kind: str) -> None:
    if kind == "live-snapshot":
        root = snapshot_live(tmp_path / "root")
        cpus = str(max(os.sched_getaffinity(0)))
    else:
        root = board_root(tmp_path / "root", cpus=8, managed=(0, 1))
        cpus = "6-7"
    before = tree_state(root)
    plan = json.loads(
        edgectl("plan", "--root", str(root), "--inference-cpus", cpus, "--json").stdout
    )
    assert plan["changes"], "a fresh root needs changes"
    for change in plan["changes"]:
        assert set(change) == {"kind", "path", "old", "new", "reason"}
        assert (root / change["path"].lstrip("/")).exists()
    assert plan["cpus"]["inference_list"] == cpus
    applied = json.loads(
        edgectl("apply", "--root", str(root), "--inference-cpus", cpus, "--json").stdout
    )
    assert len(applied["applied"]) + len(applied["skipped"]) == len(plan["changes"])
    journal = root / "var" / "lib" / "edged" / "tuning-journal.jsonl"
    assert journal.exists()  # the image carries its own journal
    again = json.loads(
        edgectl("plan", "--root", str(root), "--inference-cpus", cpus, "--json").stdout
    )
    assert again["changes"] == [], "applying twice must change nothing"
    reverted = json.loads(edgectl("revert", "--root", str(root), "--json").stdout)
    assert len(reverted["reverted"]) == len(applied["applied"])
    assert tree_state(root) == before
    assert "nothing to revert" in edgectl("revert", "--root", str(root)).stdout


@pytest.mark.integration
def test_plan_text_names_unmovable_irqs(tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4, managed=(0, 1, 2, 3))
    text = edgectl("plan", "--root", str(root), "--inference-cpus", "3").stdout
    assert "inference CPUs 3, housekeeping 0-2" in text
    assert "cannot move IRQ" in text and "managed_irq" in text


@pytest.mark.integration
def test_config_cpus_and_boot_line(tmp_path: Path, models_dir: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    (root / "boot" / "firmware").mkdir(parents=True)
    (root / "boot" / "firmware" / "cmdline.txt").write_text(
        "console=serial0,115200 console=tty1 root=PARTUUID=6c586e13-02 rootwait\n"
    )
    config = tmp_path / "edged.toml"
    config.write_text(
        f'[[models]]\nname = "m"\npath = "{models_dir / "ppocr_cls.onnx"}"\ncpus = "2-3"\n'
    )
    plan = json.loads(
        edgectl("plan", "--root", str(root), "--config", str(config), "--json").stdout
    )
    assert plan["cpus"]["inference_list"] == "2-3" and plan["cpus"]["source"] == "configured"
    [cmdline] = [c for c in plan["changes"] if c["kind"] == "cmdline"]
    assert "isolcpus=managed_irq,domain,2-3" in cmdline["new"]
    assert "irqaffinity=0-1" in cmdline["new"] and "rootwait" in cmdline["new"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--inference-cpus", "0-3"), "housekeeping"),
        (("--inference-cpus", "9"), "CPUs 9 are not online"),
        (("--inference-cpus", "x"), "--inference-cpus: bad CPU list"),
    ],
)
@pytest.mark.integration
def test_bad_cpus_exit_2(tmp_path: Path, args, message: str) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    proc = edgectl("plan", "--root", str(root), *args, rc=2)
    assert message in proc.stderr and proc.stderr.startswith("edgectl: error: ")


@pytest.mark.integration
def test_corrupt_journal_is_a_clear_error(tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    edgectl("apply", "--root", str(root), "--inference-cpus", "3")
    journal = root / "var" / "lib" / "edged" / "tuning-journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    proc = edgectl("revert", "--root", str(root), rc=2)
    assert "tuning-journal.jsonl: line 2" in proc.stderr
    assert journal.exists()  # nothing was touched


@pytest.mark.integration
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


@pytest.mark.integration
def test_rt_priority_in_config_turns_rt_throttling_off(tmp_path: Path, models_dir: Path) -> None:
    """Only a config with a SCHED_FIFO model (rt_priority) plans sched_rt_runtime_us=-1."""
    root = board_root(tmp_path / "root", cpus=4)
    runtime = root / "proc/sys/kernel/sched_rt_runtime_us"
    runtime.parent.mkdir(parents=True, exist_ok=True)
    runtime.write_text("950000\n")
    (tmp_path / "m.onnx").symlink_to(models_dir / "ppocr_cls.onnx")
    config = tmp_path / "edged.toml"
    model = '[[models]]\nname = "m"\npath = "m.onnx"\ncpus = "3"\n'

    def planned() -> list[dict]:
        plan = json.loads(
            edgectl("plan", "--root", str(root), "--config", str(config), "--json").stdout
        )
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


# -- precedence: --inference-cpus, else the isolated set, else the config's cpus ---------------


@pytest.mark.integration
def test_isolated_set_wins_over_config_cpus_with_a_note(tmp_path: Path, models_dir: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4, isolated="2-3")
    (tmp_path / "m.onnx").symlink_to(models_dir / "ppocr_cls.onnx")
    config = tmp_path / "edged.toml"
    config.write_text('[[models]]\nname = "m"\npath = "m.onnx"\ncpus = "1"\n')
    plan = json.loads(
        edgectl("plan", "--root", str(root), "--config", str(config), "--json").stdout
    )
    assert (plan["cpus"]["inference_list"], plan["cpus"]["source"]) == ("2-3", "isolated")
    [note] = plan["cpus"]["notes"]
    assert "configured inference CPUs 1 differ from the kernel's isolated set 2-3" in note
    text = edgectl("plan", "--root", str(root), "--config", str(config)).stdout
    assert "inference CPUs 2-3, housekeeping 0-1 (from isolated)" in text
    assert "note: configured inference CPUs 1 differ" in text
    # An explicit --inference-cpus is the operator's override.
    plan = json.loads(
        edgectl(
            "plan", "--root", str(root), "--config", str(config), "--inference-cpus", "3", "--json"
        ).stdout
    )
    assert (plan["cpus"]["inference_list"], plan["cpus"]["source"]) == ("3", "override")


# -- privileges and trust ---------------------------------------------------------------------


def _nothing_may_run(monkeypatch) -> None:
    """Make sure a refused live apply/revert cannot plan or write anything, even if the check
    under test were broken (this machine's own /proc must never be written)."""
    from edged.cli import tuning
    from sysconf.changes import Journal

    def forbidden(*args, **kwargs):
        raise AssertionError("live apply/revert went ahead without root")

    for name in ("placement", "_isolation_plan", "journals"):
        monkeypatch.setattr(tuning, name, forbidden)
    for name in ("apply", "revert", "retire_stale"):
        monkeypatch.setattr(Journal, name, forbidden)


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_live_apply_and_revert_without_root_exit_1(monkeypatch, capsys, command: str) -> None:
    from edged.cli.common import EXIT_FAILED
    from edged.cli.main import main

    _nothing_may_run(monkeypatch)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main([command, "--json"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"edgectl: error: {command} on the live system needs root" in err
    assert "nothing was changed" in err


def test_every_change_refused_for_permission_exits_1(tmp_path: Path, monkeypatch, capsys) -> None:
    """As root in a container without CAP_SYS_ADMIN every write answers EACCES/EROFS:
    that is not success."""
    import errno

    from edged.cli import tuning
    from edged.cli.main import main
    from sysconf.journals import Journals

    root = board_root(tmp_path / "root", cpus=4)
    before = tree_state(root)

    def denied(path: Path, content: str, kernel: bool) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(tuning, "journals", lambda r: Journals(r, writer=denied))
    assert main(["apply", "--root", str(root), "--inference-cpus", "3", "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["skipped"] and not report["applied"]
    assert "every change was refused for lack of permission" in err
    assert tree_state(root) == before


@pytest.mark.integration
def test_a_journal_another_user_can_write_is_refused(tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    edgectl("apply", "--root", str(root), "--inference-cpus", "3")
    applied = tree_state(root)
    journal = root / "var" / "lib" / "edged" / "tuning-journal.jsonl"
    journal.chmod(0o666)
    proc = edgectl("revert", "--root", str(root), rc=2)
    assert f"edgectl: error: {journal}: the journal file is group/world-writable" in proc.stderr
    os.chown(journal, 0, 0)
    journal.chmod(0o600)
    os.chown(journal.parent, 4242, 4242)
    proc = edgectl("apply", "--root", str(root), "--inference-cpus", "3", rc=2)
    assert "journal folder is owned by uid 4242, not by uid 0" in proc.stderr
    assert tree_state(root) == applied
    os.chown(journal.parent, 0, 0)
    edgectl("revert", "--root", str(root))


def test_live_journal_is_not_the_daemon_state_dir(monkeypatch) -> None:
    from edged.cli.tuning import journals
    from sysconf import SysRoot

    monkeypatch.delenv("EDGED_TUNE_STATE_DIR", raising=False)
    monkeypatch.setenv("EDGED_STATE_DIR", "/var/lib/edged")
    assert journals(SysRoot()).path == Path("/var/lib/edged-tune/tuning-journal.jsonl")
    monkeypatch.setenv("EDGED_TUNE_STATE_DIR", "/run/x")
    assert journals(SysRoot()).path == Path("/run/x/tuning-journal.jsonl")


@pytest.mark.integration
def test_apply_after_a_reboot_retires_the_old_boots_journal(tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    boot_id = root / "proc/sys/kernel/random/boot_id"
    boot_id.parent.mkdir(parents=True, exist_ok=True)
    boot_id.write_text("11111111-2222-3333-4444-555555555555\n")
    before = tree_state(root)
    first = json.loads(
        edgectl("apply", "--root", str(root), "--inference-cpus", "3", "--json").stdout
    )
    assert first["stale"] == [] and first["applied"]
    # A reboot without revert: the kernel starts from its defaults again, files keep theirs.
    for rel, value in before.items():
        if rel.startswith(("proc/", "sys/")) and value[0] not in ("dir", "link"):
            (root / rel).write_bytes(value[0])
    boot_id.write_text("66666666-7777-8888-9999-000000000000\n")
    again = json.loads(
        edgectl("apply", "--root", str(root), "--inference-cpus", "3", "--json").stdout
    )
    assert again["stale"] and any("older boot" in n for n in again["notes"])
    actions = {s["action"].split(":")[0] for s in again["stale"]}
    assert actions <= {"dropped", "restored", "removed"} and "dropped" in actions
    edgectl("revert", "--root", str(root))
    assert tree_state(root) == {
        **before,
        "proc/sys/kernel/random/boot_id": (
            b"66666666-7777-8888-9999-000000000000\n",
            before["proc/sys/kernel/random/boot_id"][1],
        ),
    }


# -- the persistent journal: --boot and --trim outlive edged-tune's stop and a reboot ---------

PI_CMDLINE = "console=serial0,115200 console=tty1 root=PARTUUID=6c586e13-02 rootwait\n"


def pi_root(tmp_path: Path) -> Path:
    """A 4-core board with a Pi boot partition and a Debian-like set of units to trim."""
    from tests.support.systemctl import add_units

    root = add_units(board_root(tmp_path / "root", cpus=4))
    (root / "boot" / "firmware").mkdir(parents=True)
    (root / "boot" / "firmware" / "cmdline.txt").write_text(PI_CMDLINE)
    return root


def lasting(report: dict) -> set[str]:
    """Paths of applied changes that must outlive the tuning service (--boot, --trim)."""
    return {c["path"] for c in report["applied"] if c["kind"] in ("cmdline", "mask")}


def split_state(root: Path, paths: set[str]) -> tuple[dict, dict]:
    """tree_state split into (the entries under `paths`, everything else)."""
    state = tree_state(root)
    keys = {k for k in state for p in paths if k == p.lstrip("/")}
    return ({k: state[k] for k in keys}, {k: v for k, v in state.items() if k not in keys})


@pytest.mark.integration
def test_revert_runtime_keeps_boot_line_and_masks_then_revert_restores_all(tmp_path: Path) -> None:
    root = pi_root(tmp_path)
    before = tree_state(root)
    args = ("--root", str(root), "--inference-cpus", "3", "--trim", "--boot", "--json")
    applied = json.loads(edgectl("apply", *args).stdout)
    kept = lasting(applied)
    assert "/boot/firmware/cmdline.txt" in kept and len(kept) > 2  # the line and masks
    assert len(lasting(applied)) < len(applied["applied"])  # and runtime tuning besides
    assert applied["persistent_journal"].endswith("var/lib/edged/persistent-journal.jsonl")
    second = json.loads(edgectl("apply", *args).stdout)
    assert second["applied"] == [] and second["skipped"] == [], "applying twice"
    applied_kept, _ = split_state(root, kept)

    out = json.loads(edgectl("revert", "--runtime", "--root", str(root), "--json").stdout)
    assert out["kept_persistent"] is True
    assert {r["path"] for r in out["reverted"]} == {c["path"] for c in applied["applied"]} - kept
    now_kept, now_rest = split_state(root, kept)
    assert now_kept == applied_kept  # boot line and masks in place
    assert now_rest == {k: v for k, v in before.items() if k not in now_kept}
    assert "isolcpus=managed_irq,domain,3" in (root / "boot/firmware/cmdline.txt").read_text()
    text = edgectl("revert", "--runtime", "--root", str(root)).stdout
    assert "nothing to revert" in text and "without --runtime restores them" in text

    out = json.loads(edgectl("revert", "--root", str(root), "--json").stdout)
    assert {r["path"] for r in out["reverted"]} == kept and out["kept_persistent"] is False
    assert tree_state(root) == before


@pytest.mark.integration
def test_a_reboot_keeps_the_boot_line_and_masks_of_an_older_boot(tmp_path: Path) -> None:
    """Power lost with everything applied: the next start (edged-tune's apply, no --boot or
    --trim) retires the old tuning journal but keeps the persistent changes."""
    root = pi_root(tmp_path)
    boot_id = root / "proc/sys/kernel/random/boot_id"
    boot_id.parent.mkdir(parents=True, exist_ok=True)
    boot_id.write_text("11111111-2222-3333-4444-555555555555\n")
    before = tree_state(root)
    applied = json.loads(
        edgectl(
            "apply", "--root", str(root), "--inference-cpus", "3", "--trim", "--boot", "--json"
        ).stdout
    )
    kept = lasting(applied)
    applied_kept, _ = split_state(root, kept)
    for rel, value in before.items():  # the reboot: kernel defaults again, files keep theirs
        if rel.startswith(("proc/", "sys/")) and value[0] not in ("dir", "link"):
            (root / rel).write_bytes(value[0])
    boot_id.write_text("66666666-7777-8888-9999-000000000000\n")
    again = json.loads(
        edgectl("apply", "--root", str(root), "--inference-cpus", "3", "--json").stdout
    )
    assert again["stale"], "the tuning journal was from the older boot"
    assert not kept & {s["path"] for s in again["stale"]}
    assert split_state(root, kept)[0] == applied_kept
    assert not lasting(again), "nothing of --boot/--trim is re-applied: it stayed"
    edgectl("revert", "--root", str(root))
    assert tree_state(root) == {
        **before,
        "proc/sys/kernel/random/boot_id": (
            b"66666666-7777-8888-9999-000000000000\n",
            before["proc/sys/kernel/random/boot_id"][1],
        ),
    }


@pytest.mark.integration
def test_under_systemd_each_change_is_a_journal_event(tmp_path: Path) -> None:
    """With stderr the journal (as edged-tune.service runs it: $JOURNAL_STREAM names it),
    apply and revert send one event per change to journald, with its fields."""
    from tests.support.journal import JournalSocket

    root = board_root(tmp_path / "root", cpus=8, managed=(0, 1))
    journal = JournalSocket(tmp_path / "journal.sock")
    stderr = (tmp_path / "stderr").open("w")
    st = os.fstat(stderr.fileno())
    env = {
        **os.environ,
        "EDGED_STATE_DIR": "/nonexistent-edged-state",
        "EDGED_JOURNAL_SOCKET": str(journal.path),
        "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
    }
    try:
        for command in (["apply", "--inference-cpus", "6-7", "--json"], ["revert"]):
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "edged.cli.main",
                    command[0],
                    "--root",
                    str(root),
                    *command[1:],
                ],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                cwd=REPO,
                timeout=120,
                env=env,
            )
            assert run.returncode == 0, (tmp_path / "stderr").read_text()
            if command[0] == "apply":
                applied = json.loads(run.stdout)["applied"]
        deadline = time.monotonic() + 10
        while len(journal.records) < 2 * len(applied) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stderr.close()
        journal.close()
    events = [r for r in journal.records if r["EVENT"] == b"tuning_apply"]
    assert len(events) == len(applied) > 0
    first = applied[0]
    assert events[0]["PATH"].decode() == first["path"] and events[0]["NEW"].decode() == first["new"]
    assert (
        events[0]["CHANGE_KIND"].decode() == first["kind"]
        and events[0]["SYSLOG_IDENTIFIER"] == b"edged"
    )
    reverted = [r for r in journal.records if r["EVENT"] == b"tuning_revert"]
    assert {r["PATH"] for r in reverted} >= {e["PATH"] for e in events}


# -- edgectl tune: recorded telemetry in, the causes ranked and answered by the catalogue's
# actions (or said why not), applied through the journal and reverted exactly ---------------


def window(outliers: dict[str, int]) -> dict:
    return {"models": {"det": {"count": 1000, "outliers": outliers}}}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = board_root(tmp_path / "root", cpus=4)
    for path, text in {
        "sys/block/vda/queue/rq_affinity": "1\n",
        "sys/block/loop0/queue/rq_affinity": "1\n",  # no hardware: never proposed
        "sys/class/net/eth0/queues/rx-0/rps_cpus": "0\n",
        "sys/class/net/eth0/queues/tx-0/xps_cpus": "0\n",
        "sys/class/net/lo/queues/rx-0/rps_cpus": "0\n",
    }.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_causes_ranked_answered_applied_and_reverted(root: Path, tmp_path: Path) -> None:
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_text(
        "\n".join(
            json.dumps(w)
            for w in [
                window({"softirq:BLOCK": 30, "irq": 8, "unexplained": 2}),
                window({"softirq:BLOCK": 10, "softirq:NET_RX": 5, "preempted": 1}),
            ]
        )
        + "\n"
    )
    before = tree_state(root)
    args = ["tune", "--telemetry", str(telemetry), "--root", str(root), "--inference-cpus", "3"]
    report = json.loads(edgectl(*args, "--json").stdout)
    assert tree_state(root) == before  # a proposal writes nothing
    causes = {c["cause"]: c for c in report["causes"]}
    assert [c["cause"] for c in report["causes"]] == [
        "softirq:BLOCK",
        "irq",
        "softirq:NET_RX",
        "unexplained",
        "preempted",
    ]
    assert causes["softirq:BLOCK"]["outliers"] == 40 and causes["softirq:BLOCK"]["windows"] == 2
    (block,) = causes["softirq:BLOCK"]["proposals"]
    assert [(c["path"], c["old"], c["new"]) for c in block["changes"]] == [
        ("/sys/block/vda/queue/rq_affinity", "1", "2")
    ]
    (rps,) = causes["softirq:NET_RX"]["proposals"]
    assert [(c["path"], c["new"]) for c in rps["changes"]] == [
        ("/sys/class/net/eth0/queues/rx-0/rps_cpus", "7")
    ]
    (irq,) = causes["irq"]["proposals"]
    assert irq["changes"] and all("3" not in c["new"] for c in irq["changes"] if c["kind"] == "irq")
    assert "no interrupt" in causes["unexplained"]["why_none"]
    (move,) = causes["preempted"]["proposals"]  # threads of a running system: not an image's
    assert move["action"] == "move-intruder" and "this is an image" in move["blocked"]

    text = edgectl(*args, "--apply").stdout
    assert "edgectl revert restores" in text
    assert (root / "sys/block/vda/queue/rq_affinity").read_text().strip() == "2"
    assert (root / "sys/class/net/eth0/queues/rx-0/rps_cpus").read_text().strip() == "7"
    again = json.loads(edgectl(*args, "--json").stdout)  # applied: nothing left to propose
    block_again = {c["cause"]: c for c in again["causes"]}["softirq:BLOCK"]["proposals"][0]
    assert block_again["changes"] == [] and "already completes" in block_again["blocked"]
    edgectl("revert", "--root", str(root))
    assert tree_state(root) == before


def test_kernel_workers_are_answered_by_the_workqueue_mask(root: Path, tmp_path: Path) -> None:
    """Unbound kworkers named as intruders: not movable threads (kernel), but the workqueue
    mask keeps their work off the inference core; per-CPU ones: said why nothing can."""
    (root / "sys/devices/virtual/workqueue").mkdir(parents=True, exist_ok=True)
    (root / "sys/devices/virtual/workqueue/cpumask").write_text("f\n")
    telemetry = tmp_path / "telemetry.json"
    threads = [{"comm": "kworker/u8:2", "pid": 2**22 + 1, "tid": 2**22 + 1, "cpu": 3, "cpu_ms": 40}]
    payload = window({"preempted": 6})
    payload["models"]["det"]["intruders"] = {"span_s": 1.0, "threads": threads}
    telemetry.write_text(json.dumps(payload))
    args = ["tune", "--telemetry", str(telemetry), "--root", str(root), "--inference-cpus", "3"]
    (cause,) = json.loads(edgectl(*args, "--json").stdout)["causes"]
    proposals = {p["action"]: p for p in cause["proposals"]}
    assert "this is an image" in proposals["move-intruder"]["blocked"]
    assert [(c["path"], c["old"], c["new"]) for c in proposals["workqueue-mask"]["changes"]] == [
        ("/sys/devices/virtual/workqueue/cpumask", "f\n", "7")
    ]
    threads[0]["comm"] = "kworker/3:1"
    telemetry.write_text(json.dumps(payload))
    (cause,) = json.loads(edgectl(*args, "--json").stdout)["causes"]
    bound = {p["action"]: p for p in cause["proposals"]}["workqueue-mask"]
    assert not bound["changes"] and "per-CPU kernel workers" in bound["blocked"]


def test_bad_telemetry_is_a_clear_error(root: Path, tmp_path: Path) -> None:
    for name, text, words in [
        ("missing.json", None, "No such file"),
        ("lines.jsonl", '{"models": {}}\n{"models": \n', "line 2: not JSON"),
        ("other.json", '{"topic": "audit"}', "not telemetry payloads"),
    ]:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        err = edgectl("tune", "--telemetry", str(path), "--root", str(root), rc=2).stderr
        assert str(path) in err and words in err


def test_the_catalogue() -> None:
    modules = catalogue()
    names = [m.NAME for m in modules]
    assert len(names) == len(set(names)) >= 4
    for module in modules:
        assert module.RISK in ("low", "medium", "high") and module.ANSWERS
        assert module.__doc__, f"{module.__name__} says what it changes and why"
    assert [m.NAME for m in modules if answers(m, "softirq:BLOCK")] == ["block-rq-affinity"]
    evidence = evidence_from_telemetry([window({"irq": 2, "x": 0}), window({"irq": 1})])
    assert [(e.cause, e.outliers, e.windows) for e in evidence] == [("irq", 3, 2)]
