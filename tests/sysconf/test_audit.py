"""edgectl audit: the live system (read only), board roots before and after `edgectl apply`,
thermal fixture roots, and the four output formats scripts and CI rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from edged.cli.audit import main
from sysconf.cpulist import parse_cpulist
from tests.support.roots import board_root
from tests.support.thermal_roots import thermal_root

REPO = Path(__file__).resolve().parents[2]
KEYS = {"id", "severity", "status", "title", "evidence", "remedy", "fixable"}


def audit(capsys, *args: str, rc: int | None = 0) -> str:
    code = main(["audit", *args])
    out = capsys.readouterr()
    if rc is not None:
        assert code == rc, out.err
    return out.out


def audit_json(capsys, *args: str, rc: int | None = 0) -> dict:
    return json.loads(audit(capsys, *args, "--format", "json", rc=rc))


@pytest.fixture
def board(tmp_path: Path) -> Path:
    return board_root(tmp_path / "root", cpus=4)


@pytest.mark.timing
def test_live_audit_is_read_only_fast_and_error_free(capsys) -> None:
    start = time.perf_counter()
    report = audit_json(capsys, rc=None)
    elapsed = time.perf_counter() - start
    print(f"live audit: {elapsed * 1000:.0f} ms, {report['summary']}", file=sys.stderr)
    assert elapsed < 5.0  # loose: a loaded 2-core CI machine (a slow check is seconds more)
    assert report["summary"]["error"] == 0, [
        f for f in report["findings"] if f["status"] == "error"
    ]
    ids = {f["id"] for f in report["findings"]}
    assert {"ISO-ISOLATED-CORES", "ISO-NOHZ-CPU0", "KRN-CMDLINE"} <= ids
    if not os.path.isdir("/sys/class/thermal") or not any(
        n.startswith("thermal_zone") for n in os.listdir("/sys/class/thermal")
    ):
        thm = [f for f in report["findings"] if f["id"].startswith("THM")]
        assert [(f["id"], f["status"]) for f in thm] == [("THM-ZONES", "skip")]
    # live: no boot config is proposed without --boot; the cmdline finding is not fixable
    cmdline = next(f for f in report["findings"] if f["id"] == "KRN-CMDLINE")
    assert not cmdline["fixable"]


def test_json_shape(capsys, board: Path) -> None:
    report = audit_json(capsys, "--root", str(board), "--inference-cpus", "3")
    assert set(report) == {"findings", "summary"}
    assert set(report["summary"]) == {"pass", "warn", "fail", "skip", "error"}
    assert sum(report["summary"].values()) == len(report["findings"])
    for f in report["findings"]:
        assert set(f) >= KEYS
        assert isinstance(f["fixable"], bool)
        for e in f["evidence"]:
            assert set(e) == {"path", "observed", "expected"}


@pytest.mark.integration
def test_board_irq_findings_are_fixable_and_apply_clears_them(capsys, board: Path) -> None:
    args = ("--root", str(board), "--inference-cpus", "3")
    before = audit_json(capsys, *args)
    irqs = [f for f in before["findings"] if f["id"] == "IRQ-AFFINITY" and f["status"] == "warn"]
    assert irqs, "a fresh board routes IRQs to the inference core"
    for f in irqs:
        assert f["fixable"] and f["remedy"].startswith(f"edgectl apply --root {board}")
        assert f["evidence"][0]["path"] == f"/proc/irq/{f['subject']}/smp_affinity_list"
        assert 3 in parse_cpulist(f["evidence"][0]["observed"])
        assert 3 not in parse_cpulist(f["evidence"][0]["expected"])
    assert any(f["id"] == "IRQ-UNMOVABLE" and f["status"] == "warn" for f in before["findings"])
    assert all(not f["fixable"] for f in before["findings"] if f["id"] == "IRQ-UNMOVABLE")

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edged.cli.main",
            "apply",
            "--root",
            str(board),
            "--inference-cpus",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "EDGED_STATE_DIR": "/nonexistent-edged-state"},
    )
    assert proc.returncode == 0, proc.stderr

    after = audit_json(capsys, *args)
    left = [
        f
        for f in after["findings"]
        if f["id"].startswith("IRQ") and f["fixable"] and f["status"] in ("warn", "fail")
    ]
    assert left == []
    assert any(f["id"] == "IRQ-AFFINITY" and f["status"] == "pass" for f in after["findings"])
    assert len(after["findings"]) < len(before["findings"])


def test_nohz_on_cpu0_fails_and_fail_on_levels(capsys, tmp_path: Path) -> None:
    clean = board_root(tmp_path / "a", cpus=4)
    # warnings only: exit 0 at the default threshold, 1 with --fail-on warn
    audit(capsys, "--root", str(clean), "--inference-cpus", "3", rc=0)
    audit(capsys, "--root", str(clean), "--inference-cpus", "3", "--fail-on", "warn", rc=1)
    bad = board_root(tmp_path / "b", cpus=4, isolated="0-1")
    report = audit_json(capsys, "--root", str(bad), "--inference-cpus", "3", rc=1)
    nohz = next(f for f in report["findings"] if f["id"] == "ISO-NOHZ-CPU0")
    assert nohz["status"] == "fail" and nohz["severity"] == "fail"
    audit(capsys, "--root", str(bad), "--inference-cpus", "3", "--skip", "ISO-NOHZ", rc=0)


def test_isolated_board_passes_isolated_cores(capsys, tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4, isolated="2-3")
    report = audit_json(capsys, "--root", str(root))
    iso = next(f for f in report["findings"] if f["id"] == "ISO-ISOLATED-CORES")
    assert iso["status"] == "pass" and "2-3" in iso["title"]
    cmd = next(f for f in report["findings"] if f["id"] == "KRN-CMDLINE")
    assert cmd["status"] == "warn"  # irqaffinity= is missing from the fixture's cmdline
    assert any(e["expected"] == "irqaffinity=0-1" for e in cmd["evidence"])


def test_junit_one_testcase_per_finding(capsys, board: Path) -> None:
    report = audit_json(capsys, "--root", str(board), "--inference-cpus", "3")
    xml = audit(capsys, "--root", str(board), "--inference-cpus", "3", "--format", "junit")
    tree = ET.fromstring(xml)
    cases = tree.findall(".//testcase")
    assert len(cases) == len(report["findings"])
    names = [c.get("name") for c in cases]
    assert len(set(names)) == len(names), "id+subject names each testcase once"
    failures = sum(1 for c in cases if c.find("failure") is not None)
    s = report["summary"]
    assert failures == s["warn"] + s["fail"]
    assert sum(1 for c in cases if c.find("skipped") is not None) == s["skip"]
    suite = tree.find("testsuite")
    assert suite is not None and suite.get("tests") == str(len(cases))


def test_sarif_structure(capsys, board: Path) -> None:
    report = audit_json(capsys, "--root", str(board), "--inference-cpus", "3")
    sarif = json.loads(
        audit(capsys, "--root", str(board), "--inference-cpus", "3", "--format", "sarif")
    )
    assert sarif["version"] == "2.1.0" and "sarif" in sarif["$schema"]
    run = sarif["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    rule_ids = [r["id"] for r in rules]
    assert len(rule_ids) == len(set(rule_ids))
    assert {r["ruleId"] for r in run["results"]} <= set(rule_ids)
    assert len(run["results"]) == report["summary"]["warn"] + report["summary"]["fail"]
    prints = [r["partialFingerprints"]["edgedFindingHash/v1"] for r in run["results"]]
    assert len(set(prints)) == len(prints)
    for r in run["results"]:
        assert r["level"] in ("warning", "error")
        assert rules[r["ruleIndex"]]["id"] == r["ruleId"]
        assert r["message"]["text"]
    # stable: the same root gives the same fingerprints
    again = json.loads(
        audit(capsys, "--root", str(board), "--inference-cpus", "3", "--format", "sarif")
    )
    assert [r["partialFingerprints"] for r in again["runs"][0]["results"]] == [
        r["partialFingerprints"] for r in run["results"]
    ]


def test_stats_per_check_only_when_asked(capsys, board: Path) -> None:
    base = ("--root", str(board), "--inference-cpus", "3")
    report = audit_json(capsys, *base, "--stats")
    assert set(report) == {"findings", "summary", "checks"}
    assert [c["check"] for c in report["checks"]] == [
        "devicetree",
        "services",
        "isolation",
        "thermal",
        "models",
    ]
    assert all(c["ok"] and c["seconds"] >= 0 for c in report["checks"])
    assert sum(c["findings"] for c in report["checks"]) == len(report["findings"])
    text = audit(capsys, *base, "--only", "IRQ")  # the table goes to stderr, the report not
    code = main(["audit", *base, "--only", "IRQ", "--stats"])
    out = capsys.readouterr()
    assert code == 0 and out.out == text
    header, *rows = out.err.splitlines()
    assert header.split() == ["check", "ok", "seconds", "findings"]
    by = {row.split()[0]: row.split() for row in rows}
    assert by["isolation"][1] == "yes" and int(by["isolation"][3]) > 0
    assert by["thermal"][3] == "0"  # it ran (a check may yield other prefixes), none kept


def test_only_and_skip_filter_by_id_prefix(capsys, board: Path) -> None:
    base = ("--root", str(board), "--inference-cpus", "3")
    only = audit_json(capsys, *base, "--only", "IRQ")
    assert only["findings"] and all(f["id"].startswith("IRQ") for f in only["findings"])
    two = audit_json(capsys, *base, "--only", "KRN", "--only", "ISO")
    assert {f["id"][:3] for f in two["findings"]} == {"KRN", "ISO"}
    skipped = audit_json(capsys, *base, "--skip", "IRQ", "--skip", "THM")
    assert skipped["findings"]
    assert not any(f["id"].startswith(("IRQ", "THM")) for f in skipped["findings"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dtb", "/nonexistent/board.dtb"], "/nonexistent/board.dtb: "),
        (["--inference-cpus", "x"], "--inference-cpus"),
        (["--inference-cpus", "0-3"], "--inference-cpus"),  # no housekeeping core left
    ],
)
def test_input_errors_exit_2(capsys, board: Path, args: list[str], message: str) -> None:
    assert main(["audit", "--root", str(board), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgectl: error: ") and message in err


def test_garbage_dtb_and_missing_root_exit_2(capsys, tmp_path: Path) -> None:
    junk = tmp_path / "junk.dtb"
    junk.write_bytes(b"\x00not a device tree")
    assert main(["audit", "--root", str(tmp_path), "--dtb", str(junk)]) == 2
    assert f"edgectl: error: {junk}" in capsys.readouterr().err
    assert main(["audit", "--root", str(tmp_path / "missing")]) == 2
    assert "edgectl: error:" in capsys.readouterr().err


def test_output_file_and_plain_text(capsys, board: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.txt"
    assert audit(capsys, "--root", str(board), "--inference-cpus", "3", "--output", str(out)) == ""
    text = out.read_text()
    assert "\033[" not in text
    assert text.splitlines()[0] == "ISO"
    assert "IRQ\n" in text and "remedy (fixable by edgectl apply)" in text
    assert text.rstrip().splitlines()[-1].endswith("error")


def _put(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n")


def test_thermal_findings(capsys, tmp_path: Path) -> None:
    root = thermal_root(
        tmp_path / "hot",
        {"cpu-thermal": 88000, "gpu-thermal": 72000, "npu-thermal": 40000},
        throttled="50006",
    )
    report = audit_json(capsys, "--root", str(root), "--only", "THM", rc=1)
    by = {(f["id"], f["subject"]): f for f in report["findings"]}
    assert by[("THM-ZONE-TRIP", "thermal_zone0")]["status"] == "fail"  # past hot
    assert by[("THM-ZONE-TRIP", "thermal_zone1")]["status"] == "warn"  # past passive
    assert by[("THM-ZONE-TRIP", "thermal_zone2")]["status"] == "pass"
    assert by[("THM-COOLING-ACTIVE", "cooling_device0")]["severity"] == "info"
    assert {s for (i, s) in by if i == "THM-CPU-CAPPED"} == {"cpu0", "cpu1", "cpu2", "cpu3"}
    now = by[("THM-PI-THROTTLED-NOW", "")]
    assert now["status"] == "fail" and "throttled" in now["title"]
    assert now["evidence"][0]["observed"] == "0x50006"
    boot = by[("THM-PI-THROTTLED-BOOT", "")]
    assert boot["status"] == "warn" and "under_voltage" in boot["title"]

    cool = thermal_root(tmp_path / "cool", {"cpu-thermal": 45000}, throttled="0")
    report = audit_json(capsys, "--root", str(cool), "--only", "THM", rc=None)
    statuses = {f["id"]: f["status"] for f in report["findings"]}
    assert statuses["THM-ZONE-TRIP"] == "pass"
    assert statuses["THM-PI-THROTTLED-NOW"] == "pass"
    assert statuses["THM-PI-THROTTLED-BOOT"] == "pass"


def test_no_thermal_zones_is_one_skip(capsys, board: Path) -> None:
    report = audit_json(capsys, "--root", str(board), "--only", "THM")
    assert [(f["id"], f["status"], f["title"]) for f in report["findings"]] == [
        ("THM-ZONES", "skip", "no thermal zones (VM?)")
    ]


@pytest.mark.integration
def test_module_entry_point(board: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edged.cli.audit",
            "audit",
            "--root",
            str(board),
            "--inference-cpus",
            "3",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["findings"]


def test_text_colour_only_when_asked() -> None:
    from sysconf.audit.findings import Finding
    from sysconf.audit.report import render_text

    findings = [
        Finding(id="KRN-X", severity="warn", status="warn", title="x"),
        Finding(id="KRN-Y", severity="warn", status="pass", title="y"),
    ]
    assert "\033[33m" in render_text(findings, colour=True)
    assert "\033[" not in render_text(findings, colour=False)


def test_single_cpu_root_skips_isolation(capsys, tmp_path: Path) -> None:
    _put(tmp_path, "/sys/devices/system/cpu/online", "0")
    report = audit_json(capsys, "--root", str(tmp_path), "--skip", "DT")
    assert report["summary"]["error"] == 0
    iso = [f for f in report["findings"] if f["id"].startswith(("ISO", "IRQ", "KRN"))]
    assert [(f["id"], f["status"]) for f in iso] == [("ISO-INFERENCE-CPUS", "skip")]


# -- --config -----------------------------------------------------------------------------------


def _config(tmp_path: Path, text: str, models_dir: Path) -> Path:
    (tmp_path / "m.onnx").symlink_to(models_dir / "ppocr_cls.onnx")  # read by the config
    path = tmp_path / "edged.toml"
    path.write_text(text)
    return path


def test_config_gives_trim_keep_and_inference_cores(
    capsys, tmp_path: Path, models_dir: Path
) -> None:
    from tests.support.systemctl import add_units

    root = add_units(board_root(tmp_path / "root", cpus=4))
    (root / "lib/systemd/system/poller.service").write_text("[Service]\nExecStart=/bin/true\n")
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    os.symlink("/lib/systemd/system/poller.service", wants / "poller.service")
    config = _config(
        tmp_path,
        '[[models]]\nname = "m"\npath = "m.onnx"\ncpus = "3"\n\n'
        '[audit]\ntrim = ["poller"]\nkeep = ["cups"]\n',
        models_dir,
    )
    plain = audit_json(capsys, "--root", str(root), "--inference-cpus", "3", rc=None)
    report = audit_json(capsys, "--root", str(root), "--config", str(config), rc=None)
    trimmed = {f["subject"] for f in report["findings"] if f["id"] == "SVC-TRIM"}
    assert "cups.service" in {f["subject"] for f in plain["findings"] if f["id"] == "SVC-TRIM"}
    assert "cups.service" not in trimmed and "poller.service" in trimmed
    iso = next(f for f in report["findings"] if f["id"] == "ISO-ISOLATED-CORES")
    assert "inference cores 3 (configured)" in iso["title"]
    # --inference-cpus wins over the models' cpus
    other = audit_json(
        capsys, "--root", str(root), "--config", str(config), "--inference-cpus", "2-3", rc=None
    )
    iso = next(f for f in other["findings"] if f["id"] == "ISO-ISOLATED-CORES")
    assert "inference cores 2-3" in iso["title"]


@pytest.mark.parametrize(
    "text, key",
    [
        ("[audit]\ntrim = [1]\n", "audit.trim"),
        ('[audit]\ntrim = ["ssh"]\n', "audit.trim[0]"),
        ("[audit]\nbogus = 1\n", "audit.bogus"),
        ('[[models]]\nname = "m"\npath = "m.onnx"\ncpus = "0-3"\n', "models.cpus"),
        ("[audit\n", ""),
    ],
)
def test_config_errors_exit_2_naming_the_key(
    capsys, board: Path, tmp_path: Path, text: str, key: str, models_dir: Path
) -> None:
    config = _config(tmp_path, text, models_dir)
    assert main(["audit", "--root", str(board), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edgectl: error: {config}") and key in err


def test_missing_config_exits_2(capsys, board: Path, tmp_path: Path) -> None:
    assert main(["audit", "--root", str(board), "--config", str(tmp_path / "none.toml")]) == 2
    assert "no such file" in capsys.readouterr().err


# -- SVC-CPUAFFINITY, SVC-JOURNALD-RATELIMIT, ISO-ISOLATED-OFFLINE ------------------------------


def _svc_root(tmp_path: Path, isolated: str = "") -> Path:
    root = board_root(tmp_path / "root", cpus=4, isolated=isolated)
    (root / "lib/systemd/system").mkdir(parents=True)
    (root / "lib/systemd/system/cron.service").write_text("[Service]\n")
    return root


def _find(report: dict, fid: str) -> dict:
    found = [f for f in report["findings"] if f["id"] == fid]
    assert len(found) == 1, found
    return found[0]


def test_cpuaffinity_absent_then_set_by_dropin(capsys, tmp_path: Path) -> None:
    root = _svc_root(tmp_path)
    args = ("--root", str(root), "--inference-cpus", "3", "--only", "SVC")
    f = _find(audit_json(capsys, *args), "SVC-CPUAFFINITY")
    assert f["status"] == "warn" and f["fixable"]
    assert f["evidence"][0]["expected"] == "CPUAffinity=0-2"
    assert f["remedy"] == f"edgectl provision --root {root} --inference-cpus 3"
    _put(root, "/etc/systemd/system.conf", "[Manager]\n#CPUAffinity=1 2\n")
    assert _find(audit_json(capsys, *args), "SVC-CPUAFFINITY")["status"] == "warn"
    _put(
        root, "/etc/systemd/system.conf.d/90-edged-cpuaffinity.conf", "[Manager]\nCPUAffinity=0-2\n"
    )
    f = _find(audit_json(capsys, *args), "SVC-CPUAFFINITY")
    assert f["status"] == "pass"
    # Assignments merge (systemd-system.conf(5)): the main file's 3 joins the drop-in's 0-2...
    _put(root, "/etc/systemd/system.conf", "[Manager]\nCPUAffinity=3\n")
    f = _find(audit_json(capsys, *args), "SVC-CPUAFFINITY")
    assert f["status"] == "warn" and f["evidence"][0]["observed"] == "3 0-2"
    # ...unless the later file resets with an empty assignment first: then it wins.
    _put(
        root,
        "/etc/systemd/system.conf.d/90-edged-cpuaffinity.conf",
        "[Manager]\nCPUAffinity=\nCPUAffinity=0 1,2\n",
    )
    assert _find(audit_json(capsys, *args), "SVC-CPUAFFINITY")["status"] == "pass"
    # A later-sorting drop-in overrides again.
    _put(root, "/etc/systemd/system.conf.d/99-other.conf", "[Manager]\nCPUAffinity=\n")
    f = _find(audit_json(capsys, *args), "SVC-CPUAFFINITY")
    assert f["status"] == "warn"
    assert f["evidence"][0]["path"] == "/etc/systemd/system.conf.d/99-other.conf"


def test_cpuaffinity_uses_the_isolated_set_and_passes_without_one(capsys, tmp_path: Path) -> None:
    root = _svc_root(tmp_path / "a", isolated="2-3")
    f = _find(audit_json(capsys, "--root", str(root), "--only", "SVC"), "SVC-CPUAFFINITY")
    assert f["status"] == "warn" and f["evidence"][0]["expected"] == "CPUAffinity=0-1"
    plain = _svc_root(tmp_path / "b")
    f = _find(audit_json(capsys, "--root", str(plain), "--only", "SVC"), "SVC-CPUAFFINITY")
    assert f["status"] == "pass" and "no inference cores" in f["title"]


def test_cpuaffinity_unparseable_value_warns(capsys, tmp_path: Path) -> None:
    root = _svc_root(tmp_path)
    _put(root, "/etc/systemd/system.conf", "[Manager]\nCPUAffinity=all\n")
    f = _find(
        audit_json(capsys, "--root", str(root), "--inference-cpus", "3", "--only", "SVC"),
        "SVC-CPUAFFINITY",
    )
    assert f["status"] == "warn" and f["evidence"][0]["observed"].startswith("unreadable")


@pytest.mark.parametrize(
    "conf, status",
    [
        ("Storage=persistent\nRateLimitBurst=0\n", "warn"),
        ("Storage=persistent\nRateLimitIntervalSec=0\n", "warn"),
        ("Storage=persistent\nRateLimitBurst=1000000\n", "warn"),
        ("Storage=persistent\nRateLimitIntervalSec=100ms\nRateLimitBurst=10000\n", "warn"),
        ("Storage=persistent\nRateLimitIntervalSec=30s\nRateLimitBurst=10000\n", "pass"),
        ("Storage=persistent\nRateLimitIntervalSec=1min 30s\nRateLimitBurst=50000\n", "pass"),
        ("Storage=persistent\n", "pass"),
        ("Storage=volatile\nRateLimitBurst=0\n", "pass"),
    ],
)
def test_journald_ratelimit(capsys, tmp_path: Path, conf: str, status: str) -> None:
    root = _svc_root(tmp_path)
    _put(root, "/etc/systemd/journald.conf", "[Journal]\n#RateLimitBurst=10000\n")
    _put(root, "/etc/systemd/journald.conf.d/50-local.conf", "[Journal]\n" + conf)
    f = _find(audit_json(capsys, "--root", str(root), "--only", "SVC"), "SVC-JOURNALD-RATELIMIT")
    assert f["severity"] == "info" and f["status"] == status
    if status == "warn":
        assert f["evidence"][0]["observed"] == "Storage=persistent"
        assert "RateLimitBurst=10000" in f["remedy"]


def test_parse_timespan() -> None:
    from sysconf.services import parse_timespan

    assert parse_timespan("30s") == 30 and parse_timespan("30") == 30
    assert parse_timespan("1min 30s") == 90 and parse_timespan("500ms") == 0.5
    assert parse_timespan("2h") == 7200 and parse_timespan("0") == 0
    for bad in ("", "s", "5 parsecs"):
        with pytest.raises(ValueError):
            parse_timespan(bad)


def test_isolated_cpu_offline_fails(capsys, tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4, isolated="3")
    _put(root, "/sys/devices/system/cpu/online", "0-2\n")
    _put(root, "/sys/devices/system/cpu/offline", "3\n")
    report = audit_json(capsys, "--root", str(root), "--only", "ISO", rc=1)
    f = _find(report, "ISO-ISOLATED-OFFLINE")
    assert (f["severity"], f["status"], f["subject"]) == ("fail", "fail", "3")
    assert f["evidence"][0] == {
        "path": "/sys/devices/system/cpu/online",
        "observed": "0-2",
        "expected": "includes 3",
    }
    assert "cpu3/online" in f["remedy"]


def test_isolated_cpus_online_pass_and_cmdline_only_counts(capsys, tmp_path: Path) -> None:
    root = board_root(tmp_path / "a", cpus=4, isolated="2-3")
    assert (
        _find(audit_json(capsys, "--root", str(root), "--only", "ISO"), "ISO-ISOLATED-OFFLINE")[
            "status"
        ]
        == "pass"
    )
    # isolcpus= names CPU 5 on a 4-CPU board (the kernel ignores it): still not online.
    cmd = board_root(
        tmp_path / "b", cpus=4, cmdline="root=/dev/mmcblk0p2 isolcpus=managed_irq,domain,3,5"
    )
    f = _find(
        audit_json(capsys, "--root", str(cmd), "--only", "ISO", rc=None), "ISO-ISOLATED-OFFLINE"
    )
    assert f["status"] == "fail" and f["subject"] == "5"
    plain = board_root(tmp_path / "c", cpus=4)
    ids = {
        f["id"]
        for f in audit_json(capsys, "--root", str(plain), "--only", "ISO", rc=None)["findings"]
    }
    assert "ISO-ISOLATED-OFFLINE" not in ids


# -- KRN-SCHED-RT-RUNTIME ----------------------------------------------------------------------


def _rt_finding(root: Path, **options):
    from sysconf.audit.checks.isolation import check_isolation
    from sysconf.audit.findings import AuditContext
    from sysconf.sysroot import SysRoot

    ctx = AuditContext(root=SysRoot(root), options={"inference_cpus": [3], **options})
    found = [f for f in check_isolation(ctx) if f.id == "KRN-SCHED-RT-RUNTIME"]
    assert len(found) == 1
    return found[0]


def test_rt_throttling_in_an_image_root(tmp_path: Path) -> None:
    """No /proc/sys value: the kernel default unless the root's sysctl.d turns it off."""
    root = board_root(tmp_path / "root", cpus=4)
    (root / "proc/sys/kernel/sched_rt_runtime_us").unlink(missing_ok=True)
    default = _rt_finding(root)
    assert (default.status, default.severity, default.fixable) == ("warn", "warn", False)
    assert "50 ms every 1 s" in default.title and "if a model runs SCHED_FIFO" in default.title
    assert "kernel default" in default.evidence[0].path
    assert "90-edged-rt.conf" in default.remedy and "sysctl -w" not in default.remedy
    _put(root, "etc/sysctl.d/90-edged-rt.conf", "kernel.sched_rt_runtime_us = -1\n")
    off = _rt_finding(root)
    assert off.status == "pass" and off.evidence[0].path == "/etc/sysctl.d/90-edged-rt.conf"


def test_rt_throttling_running_value_and_realtime_option(tmp_path: Path) -> None:
    root = board_root(tmp_path / "root", cpus=4)
    _put(root, "proc/sys/kernel/sched_rt_runtime_us", "950000\n")
    _put(root, "proc/sys/kernel/sched_rt_period_us", "1000000\n")
    rt = _rt_finding(root, realtime=True)
    assert rt.status == "warn" and rt.fixable and "a model runs SCHED_FIFO" in rt.title
    assert rt.remedy.startswith("sysctl -w kernel.sched_rt_runtime_us=-1")
    assert _rt_finding(root, realtime=False).status == "pass"  # the safety net stays
    _put(root, "proc/sys/kernel/sched_rt_runtime_us", "-1\n")
    assert _rt_finding(root, realtime=True).status == "pass"
    _put(root, "proc/sys/kernel/sched_rt_runtime_us", "1000000\n")  # runtime = period: off
    assert _rt_finding(root, realtime=True).status == "pass"
