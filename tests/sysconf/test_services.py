"""Service and timer trimming: discovery in image roots, the SVC audit check, the mask change
kind in the journal (exact revert), and `edgectl plan/apply/revert --trim` on roots only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edged.config import ConfigError, parse_config
from sysconf.audit.checks.services import check_services
from sysconf.audit.findings import AuditContext
from sysconf.changes import Change, Journal
from sysconf.services import (
    enable_links,
    is_protected,
    plan_trim,
    trim_candidates,
    unit_state,
)
from sysconf.sysroot import SysRoot
from sysconf.systemctl import Systemctl
from tests.support.images import image_root
from tests.support.roots import tree_state
from tests.support.systemctl import EXPECTED_TRIM, RUNNING, FakeSystemctl, LiveLooking

REPO = Path(__file__).resolve().parents[2]


def findings(root: Path, **options) -> list:
    return list(check_services(AuditContext(root=SysRoot.at(root), options=options)))


def ids(found, status: str = "warn") -> dict[str, set[str]]:
    result: dict[str, set[str]] = {}
    for f in found:
        if f.status == status:
            result.setdefault(f.id, set()).add(f.subject)
    return result


# -- discovery and the check ------------------------------------------------------------------


def test_candidates_found_in_image_root(tmp_path: Path) -> None:
    root = SysRoot.at(image_root(tmp_path))
    links = enable_links(root)
    assert links["getty@tty1.service"] == [
        "/etc/systemd/system/getty.target.wants/getty@tty1.service"
    ]
    assert {s.name for s in trim_candidates(root)} == EXPECTED_TRIM
    bluetooth = unit_state(root, "bluetooth")
    assert bluetooth.masked and bluetooth.enabled_by and not bluetooth.enabled
    assert unit_state(root, "fstrim.timer").path == "/etc/systemd/system/fstrim.timer"
    assert unit_state(root, "man-db.timer").path == "/lib/systemd/system/man-db.timer"


def test_protected_never_proposed(tmp_path: Path) -> None:
    root = SysRoot.at(image_root(tmp_path))
    for unit in (
        "systemd-journald.service",
        "ssh",
        "sshd.service",
        "getty@tty1.service",
        "serial-getty@ttyS0.service",
        "systemd-networkd.service",
        "dbus.socket",
        "edged",
        "edged-tune.service",
        "chrony.service",
        "NetworkManager",
    ):
        assert is_protected(unit), unit
    assert not is_protected("cups") and not is_protected("getty-static.service")
    extra = ("ssh.service", "systemd-networkd", "getty@tty1.service", "rsyslog.service")
    proposed = {s.name for s in trim_candidates(root, extra=extra)}
    assert proposed == EXPECTED_TRIM | {"rsyslog.service"}
    found = findings(root.root, trim=list(extra))
    assert ids(found)["SVC-PROTECTED"] == {
        "ssh.service",
        "systemd-networkd.service",
        "getty@tty1.service",
    }
    assert not any(f.subject in ids(found)["SVC-PROTECTED"] for f in found if f.id == "SVC-TRIM")
    assert {c.path.rsplit("/", 1)[1] for c in plan_trim(root, extra=extra)} == proposed


def test_keep_respected(tmp_path: Path) -> None:
    root = SysRoot.at(image_root(tmp_path))
    keep = ("cups", "fstrim.timer")
    assert {s.name for s in trim_candidates(root, keep=keep)} == EXPECTED_TRIM - {
        "cups.service",
        "fstrim.timer",
    }
    assert ids(findings(root.root, keep=list(keep)))["SVC-TRIM"] == EXPECTED_TRIM - {
        "cups.service",
        "fstrim.timer",
    }


def test_check_findings(tmp_path: Path) -> None:
    root = image_root(tmp_path)
    found = findings(root)
    trim = [f for f in found if f.id == "SVC-TRIM"]
    assert {f.subject for f in trim} == EXPECTED_TRIM
    assert all(f.severity == "warn" and f.status == "warn" and f.fixable for f in trim)
    assert all(f"--root {root}" in f.remedy and "--trim" in f.remedy for f in trim)
    assert trim[0].evidence[0].path.startswith("/etc/systemd/system/")
    double = ids(found)["SVC-DOUBLE-LOGGING"]
    assert double == {"rsyslog.service"}
    assert "SVC-JOURNALD-STORAGE" in ids(found)
    # ForwardToSyslog=no in a drop-in, a rate limit: both pass.
    dropin = root / "etc" / "systemd" / "journald.conf.d"
    dropin.mkdir()
    (dropin / "edged.conf").write_text("[Journal]\nForwardToSyslog=no\nRateLimitBurst=500\n")
    warned = ids(findings(root))
    assert "SVC-DOUBLE-LOGGING" not in warned and "SVC-JOURNALD-STORAGE" not in warned


def test_root_without_units_skips(tmp_path: Path) -> None:
    found = findings(tmp_path)
    assert [(f.id, f.status) for f in found] == [("SVC-TRIM", "skip")]


# -- the journal's mask kind ------------------------------------------------------------------


def test_mask_apply_revert_exact(tmp_path: Path) -> None:
    root_dir = image_root(tmp_path)
    root = SysRoot.at(root_dir)
    before = tree_state(root_dir)
    changes = plan_trim(root)
    assert {c.kind for c in changes} == {"mask"} and all(c.new == "/dev/null" for c in changes)
    olds = {c.path.rsplit("/", 1)[1]: c.old for c in changes}
    assert olds["fstrim.timer"] == "/lib/systemd/system/fstrim.timer"
    assert "--no-rlimits" in olds["avahi-daemon.service"] and olds["cups.service"] is None
    result = Journal(root).apply(changes)
    assert len(result.applied) == len(changes) and not result.skipped
    etc = root_dir / "etc" / "systemd" / "system"
    for change in changes:
        assert os.readlink(root.path(change.path)) == "/dev/null"
    assert plan_trim(root) == [] and trim_candidates(root) == []
    again = Journal(root).apply(changes)
    assert len(again.unchanged) == len(changes) and not again.applied
    reverted = Journal(root).revert()
    assert len(reverted) == len(changes)
    assert tree_state(root_dir) == before
    assert (etc / "avahi-daemon.service").stat().st_mode & 0o7777 == 0o640


def live_journal(root_dir: Path, fake: FakeSystemctl) -> Journal:
    return Journal(LiveLooking(root_dir), systemctl=Systemctl(runner=fake))


def test_live_plan_and_finding_describe_live_masking(tmp_path: Path) -> None:
    root = LiveLooking(image_root(tmp_path))
    changes = plan_trim(root)
    assert changes and all("systemctl mask --now" in c.reason for c in changes)
    warned = [
        f
        for f in check_services(AuditContext(root=root))
        if f.id == "SVC-TRIM" and f.status == "warn"
    ]
    assert warned and all(
        f.fixable
        and f.remedy.startswith("edgectl apply --trim (masks ")
        and "--root" not in f.remedy
        and "mask --now" in f.remedy
        for f in warned
    )


def test_live_mask_apply_revert_through_systemctl(tmp_path: Path) -> None:
    """Live: the same mask links as an image root, plus is-active, daemon-reload and stop per
    unit; revert restores the links exactly, reloads once and starts only what ran."""
    root_dir = image_root(tmp_path)
    before = tree_state(root_dir)
    fake = FakeSystemctl(active=RUNNING)
    journal = live_journal(root_dir, fake)
    changes = plan_trim(LiveLooking(root_dir))
    units = [c.path.rsplit("/", 1)[1] for c in changes]
    result = journal.apply(changes)
    assert len(result.applied) == len(changes) and not result.skipped
    for change in changes:
        assert os.readlink(root_dir / change.path.lstrip("/")) == "/dev/null"
    assert fake.calls == [
        call for unit in units for call in (("is-active", unit), ("daemon-reload",), ("stop", unit))
    ]
    assert fake.active == set()
    sets = [r for r in journal.records() if r["op"] == "set"]
    assert {r["unit"]: r["was_active"] for r in sets} == {u: u in RUNNING for u in units}

    fake.calls.clear()
    reverted = live_journal(root_dir, fake).revert()
    assert len(reverted) == len(changes) and not [a for _, a in reverted if "failed" in a]
    started = {p.rsplit("/", 1)[1] for p, a in reverted if a.endswith(", started")}
    assert started == RUNNING
    assert fake.calls[0] == ("daemon-reload",) and fake.calls.count(("daemon-reload",)) == 1
    assert sorted(fake.calls[1:]) == sorted(("start", u) for u in RUNNING)
    assert fake.active == RUNNING
    assert tree_state(root_dir) == before


def test_live_mask_failing_stop_is_taken_back(tmp_path: Path) -> None:
    """A stop that fails leaves no mask behind and a journal that says so: the unit is
    started again, the others are masked, and revert touches only those."""
    root_dir = image_root(tmp_path)
    before = tree_state(root_dir)
    fake = FakeSystemctl(active=RUNNING, fail={("stop", "cups.service"): 1})
    journal = live_journal(root_dir, fake)
    changes = plan_trim(LiveLooking(root_dir))
    result = journal.apply(changes)
    assert [c.path for c, _ in result.skipped] == ["/etc/systemd/system/cups.service"]
    why = result.skipped[0][1]
    assert "systemctl --no-ask-password stop cups.service" in why and "cups.service" in why
    assert "exit 1: Failed to stop: Access denied" in why and "taken back" in why
    assert not (root_dir / "etc/systemd/system/cups.service").is_symlink()
    assert fake.calls[-2:] == [("daemon-reload",), ("start", "cups.service")]
    assert len(result.applied) == len(changes) - 1
    fake.calls.clear()
    reverted = live_journal(root_dir, fake).revert()
    assert "/etc/systemd/system/cups.service" not in {p for p, _ in reverted}
    assert ("start", "cups.service") not in fake.calls
    assert tree_state(root_dir) == before


def test_live_mask_failing_reload_is_taken_back(tmp_path: Path) -> None:
    root_dir = image_root(tmp_path)
    before = tree_state(root_dir)
    fake = FakeSystemctl(active=RUNNING, fail={("daemon-reload",): 1})
    result = live_journal(root_dir, fake).apply(plan_trim(LiveLooking(root_dir)))
    assert not result.applied and result.skipped
    assert all("`systemctl daemon-reload` failed: exit 1" in why for _, why in result.skipped)
    assert not [c for c in fake.calls if c[0] in ("stop", "start")]
    assert live_journal(root_dir, fake).revert() == []  # every mask was taken back
    assert tree_state(root_dir) == before


def test_live_mask_without_systemctl_changes_nothing(tmp_path: Path) -> None:
    """The real subprocess runner with a systemctl that does not exist: a clear error naming
    the unit, nothing written, nothing journalled."""
    root_dir = image_root(tmp_path)
    before = tree_state(root_dir)
    missing = Systemctl(binary=str(tmp_path / "no-such-systemctl"))
    journal = Journal(LiveLooking(root_dir), systemctl=missing)
    changes = plan_trim(LiveLooking(root_dir))
    result = journal.apply(changes)
    assert not result.applied and len(result.skipped) == len(changes)
    for change, why in result.skipped:
        unit = change.path.rsplit("/", 1)[1]
        assert f"is-active {unit}` for {unit} failed" in why and "not found" in why
    assert not journal.pending()
    assert tree_state(root_dir) == before


def test_live_mask_with_a_systemctl_program(tmp_path: Path) -> None:
    """The real runner against a stand-in `systemctl` script (it logs its arguments): the
    subprocess path, exit codes and is-active's words, without this machine's systemd."""
    log = tmp_path / "calls.log"
    program = tmp_path / "systemctl"
    program.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\n'
        'if [ "$1" = is-active ]; then\n'
        '  [ "$2" = cups.service ] && { echo active; exit 0; }\n'
        "  echo inactive; exit 3\n"
        "fi\n"
        'if [ "$3" = man-db.timer ]; then echo boom >&2; exit 5; fi\n'
        "exit 0\n"
    )
    program.chmod(0o755)
    root_dir = image_root(tmp_path / "img")
    before = tree_state(root_dir)
    journal = Journal(LiveLooking(root_dir), systemctl=Systemctl(binary=str(program)))
    result = journal.apply(plan_trim(LiveLooking(root_dir)))
    assert [(c.path.rsplit("/", 1)[1], why.split(":")[0]) for c, why in result.skipped] == [
        ("man-db.timer", f"`{program} --no-ask-password stop man-db.timer` for man-db.timer failed")
    ]
    assert "exit 5: boom" in result.skipped[0][1]
    cups = [r for r in journal.records() if r.get("unit") == "cups.service"]
    assert cups and cups[0]["was_active"] is True
    reverted = journal.revert()
    assert ("/etc/systemd/system/cups.service", "removed, started") in reverted
    assert "--no-ask-password start cups.service" in log.read_text().splitlines()
    assert tree_state(root_dir) == before


def test_live_revert_reports_failed_start(tmp_path: Path) -> None:
    root_dir = image_root(tmp_path)
    before = tree_state(root_dir)
    fake = FakeSystemctl(active=RUNNING)
    live_journal(root_dir, fake).apply(plan_trim(LiveLooking(root_dir)))
    fake.fail = {("start", "avahi-daemon.service"): 1}
    reverted = dict(live_journal(root_dir, fake).revert())
    action = reverted["/etc/systemd/system/avahi-daemon.service"]
    assert action.startswith(
        "failed: link restored, but `systemctl --no-ask-password start "
        "avahi-daemon.service` for avahi-daemon.service failed"
    )
    assert tree_state(root_dir) == before


def test_live_enable_links_still_refused(tmp_path: Path) -> None:
    root_dir = image_root(tmp_path)
    fake = FakeSystemctl()
    change = Change(
        "enable",
        "/etc/systemd/system/multi-user.target.wants/edged.service",
        None,
        "/lib/systemd/system/edged.service",
        "enable edged",
    )
    result = live_journal(root_dir, fake).apply([change])
    assert not result.applied and "refusing" in result.skipped[0][1] and not fake.calls


# -- config ------------------------------------------------------------------------------------


def test_config_audit_table(tmp_path: Path) -> None:
    config = parse_config(
        '[audit]\ntrim = ["rsyslog", "snapd.service"]\nkeep = ["cups"]\n', tmp_path / "edged.toml"
    )
    assert config.audit.trim == ("rsyslog", "snapd.service")
    assert config.audit.keep == ("cups",)
    assert parse_config("", tmp_path / "edged.toml").audit.trim == ()


@pytest.mark.parametrize(
    "text, key",
    [
        ('[audit]\ntrim = "cups"\n', "audit.trim"),
        ("[audit]\nkeep = [1]\n", "audit.keep[0]"),
        ('[audit]\ntrim = ["a/b.service"]\n', "audit.trim[0]"),
        ('[audit]\ntrim = ["cups", "ssh"]\n', "audit.trim[1]"),
        ("[audit]\ntrimm = []\n", "audit.trimm"),
        ("audit = 3\n", "audit"),
    ],
)
def test_config_audit_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, tmp_path / "edged.toml")
    assert key in str(info.value)


# -- edgectl on a root -------------------------------------------------------------------------


def edgectl(*args: str, rc: int | None = 0) -> subprocess.CompletedProcess:
    assert "--root" in args, "tests must never touch the live system"
    proc = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "EDGED_STATE_DIR": "/nonexistent-edged-state"},
    )
    if rc is not None:
        assert proc.returncode == rc, proc.stderr
    return proc


def audit_trim(root: Path) -> set[str]:
    out = edgectl("audit", "--root", str(root), "--only", "SVC", "--format", "json", rc=None)
    assert out.returncode in (0, 1), out.stderr
    return {
        f["subject"]
        for f in json.loads(out.stdout)["findings"]
        if f["id"] == "SVC-TRIM" and f["status"] == "warn"
    }


@pytest.mark.integration
def test_cli_trim_round_trip(tmp_path: Path) -> None:
    root = image_root(tmp_path)
    before = tree_state(root)
    args = ("--root", str(root), "--trim", "--inference-cpus", "1", "--json")
    assert audit_trim(root) == EXPECTED_TRIM
    plain = json.loads(edgectl("plan", *args[:2], *args[3:]).stdout)
    assert not [c for c in plain["changes"] if c["kind"] == "mask"], "masks only with --trim"
    plan = json.loads(edgectl("plan", *args).stdout)
    masks = [c for c in plan["changes"] if c["kind"] == "mask"]
    assert {c["path"].rsplit("/", 1)[1] for c in masks} == EXPECTED_TRIM
    applied = json.loads(edgectl("apply", *args).stdout)
    assert len(applied["applied"]) + len(applied["skipped"]) == len(plan["changes"])
    assert {c["path"] for c in applied["applied"]} >= {c["path"] for c in masks}
    assert audit_trim(root) == set()
    assert json.loads(edgectl("plan", *args).stdout)["changes"] == []
    second = json.loads(edgectl("apply", *args).stdout)
    assert second["applied"] == [] and second["skipped"] == []
    reverted = json.loads(edgectl("revert", "--root", str(root), "--json").stdout)
    assert len(reverted["reverted"]) == len(applied["applied"])
    assert tree_state(root) == before
    assert audit_trim(root) == EXPECTED_TRIM


@pytest.mark.integration
def test_cli_config_keep_and_trim(tmp_path: Path) -> None:
    root = image_root(tmp_path)
    config = tmp_path / "edged.toml"
    config.write_text('[audit]\ntrim = ["rsyslog"]\nkeep = ["cups.service"]\n')
    plan = json.loads(
        edgectl(
            "plan",
            "--root",
            str(root),
            "--trim",
            "--inference-cpus",
            "1",
            "--config",
            str(config),
            "--json",
        ).stdout
    )
    masked = {c["path"].rsplit("/", 1)[1] for c in plan["changes"] if c["kind"] == "mask"}
    assert masked == EXPECTED_TRIM - {"cups.service"} | {"rsyslog.service"}
    config.write_text('[audit]\ntrim = ["ssh"]\n')
    bad = edgectl("plan", "--root", str(root), "--trim", "--config", str(config), rc=2)
    assert "audit.trim[0]" in bad.stderr
