"""`edgectl provision --root DIR`: the whole tuned configuration written into an image root,
idempotent, audited clean afterwards, and reverted byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path

from edged.cli.main import main
from sysconf.cpusets import CpuPlan
from sysconf.provision import (
    SYSCTL_CONF,
    WANTS,
    provision_changes,
    sysctl_conf,
)
from sysconf.services import AFFINITY_DROPIN
from sysconf.sysroot import SysRoot
from tests.support.images import PROVISION, image
from tests.support.roots import tree_state
from tests.support.systemctl import EXPECTED_TRIM

CPUS = CpuPlan((3,), (0, 1, 2), "configured")


def provision(root: Path, capsys) -> dict:
    capsys.readouterr()
    assert main([*PROVISION, "--root", str(root)]) == 0
    return json.loads(capsys.readouterr().out)


def audit(root: Path, capsys) -> dict:
    capsys.readouterr()
    main(["audit", "--root", str(root), "--inference-cpus", "3", "--format", "json"])
    return json.loads(capsys.readouterr().out)


def test_provision_audit_idempotent_revert(tmp_path, capsys):
    root = image(tmp_path)
    before = tree_state(root)
    audited = audit(root, capsys)
    fixable_before = {
        f["id"] for f in audited["findings"] if f["fixable"] and f["status"] in ("warn", "fail")
    }
    assert {"SVC-TRIM", "KRN-CMDLINE", "SVC-CPUAFFINITY"} <= fixable_before

    report = provision(root, capsys)
    assert not report["skipped"], report["skipped"]
    assert report["cpus"]["housekeeping_list"] == "0-2"

    assert (root / SYSCTL_CONF.lstrip("/")).read_text() == sysctl_conf()
    conf = (root / SYSCTL_CONF.lstrip("/")).read_text()
    for line in (
        "kernel.timer_migration = 0",
        "vm.stat_interval = 10",
        "kernel.nmi_watchdog = 0",
        "kernel.numa_balancing = 0",
    ):
        assert line in conf.splitlines()
    dropin = (root / AFFINITY_DROPIN.lstrip("/")).read_text()
    assert "[Manager]\nCPUAffinity=\nCPUAffinity=0-2\n" in dropin
    grub = (root / "etc/default/grub").read_text()
    assert (
        'GRUB_CMDLINE_LINUX_DEFAULT="quiet isolcpus=managed_irq,domain,3 nohz_full=3 '
        'rcu_nocbs=3 irqaffinity=0-2"'
    ) in grub
    etc = root / "etc/systemd/system"
    for unit in EXPECTED_TRIM:
        assert os.readlink(etc / unit) == "/dev/null", unit
    # The units were not in the image: installed from the repo's systemd/ and enabled.
    repo = Path(__file__).resolve().parents[2] / "systemd"
    for unit in ("edged.service", "edged-tune.service"):
        assert (etc / unit).read_bytes() == (repo / unit).read_bytes()
        assert os.readlink(etc / "multi-user.target.wants" / unit) == f"/etc/systemd/system/{unit}"
    # The plan's runtime changes were applied too (see sysconf/provision.py).
    assert {c["kind"] for c in report["applied"]} >= {
        "irq",
        "cmdline",
        "mask",
        "enable",
        "unit",
        "sysctl-conf",
        "systemd-conf",
    }

    after = audit(root, capsys)
    left = [f for f in after["findings"] if f["fixable"] and f["status"] in ("warn", "fail")]
    assert not left, left
    assert all(f["status"] == "pass" for f in after["findings"] if f["id"] == "SVC-TRIM")
    # What is left of KRN-CMDLINE is the running kernel's /proc/cmdline: the next boot fixes it.
    assert all(
        "was not booted" in f["title"]
        for f in after["findings"]
        if f["id"] == "KRN-CMDLINE" and f["status"] != "pass"
    )

    state = tree_state(root)
    again = provision(root, capsys)
    assert again["applied"] == [] and again["skipped"] == []
    assert tree_state(root) == state

    capsys.readouterr()
    assert main(["revert", "--root", str(root)]) == 0
    assert tree_state(root) == before


def test_units_in_image_are_enabled_in_place(tmp_path, capsys):
    root = image(tmp_path, boot="rpi")
    lib = root / "lib/systemd/system"
    (lib / "edged.service").write_text("[Service]\nExecStart=/usr/bin/edged\n")
    (lib / "edged-tune.service").write_text("[Service]\nExecStart=/usr/bin/edgectl apply\n")
    before = tree_state(root)
    changes = provision_changes(SysRoot.at(root), CPUS)
    kinds = {c.kind for c in changes}
    assert "unit" not in kinds and "cmdline" in kinds
    provision(root, capsys)
    wants = root / WANTS.lstrip("/")
    assert os.readlink(wants / "edged.service") == "/lib/systemd/system/edged.service"
    assert os.readlink(wants / "edged-tune.service") == "/lib/systemd/system/edged-tune.service"
    assert not (root / "etc/systemd/system/edged.service").exists()
    assert "isolcpus=managed_irq,domain,3" in (root / "boot/firmware/cmdline.txt").read_text()
    assert provision_changes(SysRoot.at(root), CPUS) == []
    assert main(["revert", "--root", str(root)]) == 0
    assert tree_state(root) == before


def test_missing_dropin_folder_is_created_and_revert_removes_it(tmp_path, capsys):
    root = image(tmp_path)
    (root / "etc/systemd/system.conf.d").rmdir()
    before = tree_state(root)
    report = provision(root, capsys)
    assert not report["skipped"], report["skipped"]
    assert AFFINITY_DROPIN in [c["path"] for c in report["applied"]]
    dropin = (root / AFFINITY_DROPIN.lstrip("/")).read_text()
    assert "[Manager]\nCPUAffinity=\nCPUAffinity=0-2\n" in dropin
    capsys.readouterr()
    assert main(["revert", "--root", str(root)]) == 0
    assert not (root / "etc/systemd/system.conf.d").exists()
    assert tree_state(root) == before


def test_provisioned_files_are_persistent_revert_runtime_keeps_them(tmp_path, capsys):
    """What provision writes for the first boot (sysctl.d, the CPUAffinity drop-in, enable
    links, the boot line, masks) is in the persistent journal: edged-tune's stop
    (`revert --runtime`) keeps it; only the runtime tuning is restored."""
    root = image(tmp_path)
    before = tree_state(root)
    report = provision(root, capsys)
    persistent = Path(report["persistent_journal"])
    paths = {json.loads(line).get("path") for line in persistent.read_text().splitlines()}
    assert {SYSCTL_CONF, AFFINITY_DROPIN, "/etc/default/grub", f"{WANTS}/edged.service"} <= paths
    capsys.readouterr()
    assert main(["revert", "--runtime", "--root", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    reverted = {r["path"] for r in out["reverted"]}
    assert reverted and not reverted & paths and out["kept_persistent"]
    assert (root / SYSCTL_CONF.lstrip("/")).read_text() == sysctl_conf()
    assert os.path.islink(root / WANTS.lstrip("/") / "edged.service")
    assert main(["revert", "--root", str(root)]) == 0
    assert tree_state(root) == before


def test_root_required(capsys):
    assert main(["provision", "--inference-cpus", "3"]) == 2
    assert "--root" in capsys.readouterr().err
    assert main(["provision", "--root", "/", "--inference-cpus", "0"]) == 2


def test_realtime_model_turns_rt_throttling_off_in_image(tmp_path, capsys, models_dir):
    """A model with rt_priority in --config: provisioning writes sched_rt_runtime_us = -1 into
    sysctl.d, and the audit with the same config then passes KRN-SCHED-RT-RUNTIME."""
    root = image(tmp_path)
    config = tmp_path / "edged.toml"
    model = tmp_path / "m.onnx"
    model.symlink_to(models_dir / "ppocr_cls.onnx")  # the config reads it; the audit does not
    config.write_text(f'[[models]]\nname = "m"\npath = "{model}"\ncpus = "3"\nrt_priority = 10\n')

    def rt_finding() -> dict:
        capsys.readouterr()
        main(["audit", "--root", str(root), "--config", str(config), "--format", "json"])
        found = json.loads(capsys.readouterr().out)["findings"]
        return next(f for f in found if f["id"] == "KRN-SCHED-RT-RUNTIME")

    assert rt_finding()["status"] == "warn"
    capsys.readouterr()
    assert main(["provision", "--root", str(root), "--config", str(config), "--json"]) == 0
    conf = (root / SYSCTL_CONF.lstrip("/")).read_text()
    assert conf == sysctl_conf(realtime=True)
    assert "kernel.sched_rt_runtime_us = -1" in conf.splitlines()
    assert "sched_rt_runtime_us" not in sysctl_conf()
    assert rt_finding()["status"] == "pass"
