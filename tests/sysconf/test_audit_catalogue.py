"""The audit's finding ids, pinned: scripts, SARIF ruleIds and CI baselines key on them, so
renaming one, or changing its severity, must fail here until it is changed on purpose.

Also: every id a check emits on the fixture roots is one its module declares, the checks are
found one per module of sysconf/audit/checks/, and one end-to-end JSON report
(tests/golden/audit_imx8mp.json) stays byte for byte what `edgectl audit` printed.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from sysconf.audit import checks as checks_package
from sysconf.audit import runner
from sysconf.audit.checks.devicetree import check_tree
from sysconf.audit.findings import AuditContext, Check, Finding
from sysconf.fdt import load_fdt
from sysconf.sysroot import SysRoot
from tests.support.images import image_root
from tests.support.roots import board_root
from tests.support.thermal_roots import thermal_root

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("EDGED_UPDATE_GOLDEN") == "1"
BOARD_DTB = "freescale/imx8mp-evk.dtb"

# Every (id, severity) a finding can carry. Written out, not computed: this list is the promise.
PINNED = [
    ("DT-CHECK-ERROR", "warn"),
    ("DT-CMA-MISALIGNED", "warn"),
    ("DT-CMA-MISSING", "warn"),
    ("DT-CMA-NOMAP-REUSABLE", "fail"),
    ("DT-CMA-NOT-REUSABLE", "warn"),
    ("DT-CMA-OUTSIDE-DMA-WINDOW", "fail"),
    ("DT-CMA-OUTSIDE-MEMORY", "fail"),
    ("DT-CMA-SMALL", "fail"),
    ("DT-DMA-DISABLED-CONTROLLER", "fail"),
    ("DT-DMA-NAMES-MISMATCH", "warn"),
    ("DT-DMA-PIO-FALLBACK", "info"),
    ("DT-DMA-RANGES-BROKEN", "warn"),
    ("DT-DMA-SHARED-REQUEST", "warn"),
    ("DT-NO-TREE", "info"),
    ("DT-PHANDLE-DANGLING", "fail"),
    ("DT-RESERVED-FOR-DISABLED", "info"),
    ("IRQ-AFFINITY", "warn"),
    ("IRQ-DEFAULT-AFFINITY", "warn"),
    ("IRQ-IRQBALANCE-BAN", "warn"),
    ("IRQ-UNMOVABLE", "warn"),
    ("ISO-CHECK-ERROR", "warn"),
    ("ISO-INFERENCE-CPUS", "warn"),
    ("ISO-ISOLATED-CORES", "info"),
    ("ISO-ISOLATED-OFFLINE", "fail"),
    ("ISO-NOHZ-CPU0", "fail"),
    ("KRN-CMDLINE", "warn"),
    ("KRN-GOVERNOR", "warn"),
    ("KRN-SCHED-RT-RUNTIME", "warn"),
    ("KRN-SYSCTL", "warn"),
    ("KRN-THP", "warn"),
    ("KRN-WORKQUEUE-MASK", "warn"),
    ("MDL-CHECK-ERROR", "warn"),
    ("MDL-TRUST", "fail"),  # a file that is not the one signed, or refused under enforce
    ("MDL-TRUST", "warn"),
    ("SVC-CHECK-ERROR", "warn"),
    ("SVC-CPUAFFINITY", "warn"),
    ("SVC-DOUBLE-LOGGING", "warn"),
    ("SVC-JOURNALD-RATELIMIT", "info"),
    ("SVC-JOURNALD-STORAGE", "info"),
    ("SVC-PROTECTED", "warn"),
    ("SVC-TRIM", "warn"),
    ("THM-CHECK-ERROR", "warn"),
    ("THM-COOLING-ACTIVE", "info"),
    ("THM-CPU-CAPPED", "warn"),
    ("THM-PI-THROTTLED-BOOT", "warn"),
    ("THM-PI-THROTTLED-NOW", "fail"),
    ("THM-ZONE-TRIP", "fail"),  # past a hot or critical trip
    ("THM-ZONE-TRIP", "warn"),
    ("THM-ZONES", "info"),
]


def _severities(check: Check, fid: str) -> set[str]:
    if fid == runner.error_id(check.prefix):
        return {runner.CHECK_ERROR.severity}
    rule = check.catalogue.rules[fid]
    return {s for s in (rule.severity, rule.escalated) if s}


def test_every_finding_id_is_pinned() -> None:
    declared = []
    for check in runner.load_checks():
        ids = [runner.error_id(check.prefix), *check.catalogue.rules]
        declared += [(fid, severity) for fid in ids for severity in _severities(check, fid)]
    assert sorted(declared) == PINNED


def test_one_registered_check_per_module() -> None:
    modules = sorted(
        f"{checks_package.__name__}.{m.name}" for m in pkgutil.iter_modules(checks_package.__path__)
    )
    found = runner.load_checks()
    assert sorted(check.run.__module__ for check in found) == modules
    assert len({check.prefix for check in found}) == len(found)
    # the run order, which is the order of the JSON/JUnit/SARIF findings
    names = [check.name for check in found]
    assert names == ["devicetree", "services", "isolation", "thermal", "models"]


def test_text_sections_come_from_the_catalogues() -> None:
    places = runner.sections()
    in_order = sorted(places, key=places.__getitem__)
    assert in_order == ["ISO", "IRQ", "SVC", "KRN", "DT", "THM", "MDL"]


def _contexts(tmp_path: Path, dtb_corpus: Path) -> list[AuditContext]:
    """Fixture roots that between them reach most ids: boards before and after isolation,
    x86, a single core, an image with units, a hot board, and device trees that fire rules."""

    def ctx(root: Path, dtbs: tuple[str, ...] = (), **options) -> AuditContext:
        trees = [(name, load_fdt(dtb_corpus / name)) for name in dtbs]
        return AuditContext(root=SysRoot.at(root), dtbs=trees, options=options)

    unsigned = {"model": "cls", "path": "/m/cls.onnx", "state": "unsigned", "reason": "no pin"}
    single = tmp_path / "single/sys/devices/system/cpu"
    single.mkdir(parents=True)
    (single / "online").write_text("0\n")
    offline = board_root(tmp_path / "offline", cpus=4, isolated="3")
    (offline / "sys/devices/system/cpu/online").write_text("0-2\n")
    return [
        ctx(board_root(tmp_path / "arm", cpus=4, isolated="2-3"), (BOARD_DTB,)),
        ctx(board_root(tmp_path / "x86", cpus=4, arm=False), inference_cpus=[3]),
        ctx(
            board_root(tmp_path / "nohz", cpus=4, isolated="0-1"),
            inference_override=[3],
            realtime=True,
        ),
        ctx(tmp_path / "single"),
        ctx(offline),
        ctx(
            image_root(tmp_path / "image"), trim=["ssh", "cron"], keep=["cups"], inference_cpus=[3]
        ),
        ctx(
            thermal_root(
                tmp_path / "hot", {"cpu-thermal": 88000, "gpu-thermal": 72000}, throttled="50006"
            )
        ),
        ctx(tmp_path / "single", ("qcom/qrb5165-rb5.dtb", "freescale/imx8mm-beacon-kit.dtb")),
        ctx(tmp_path / "single", model_trust={"mode": "warn", "verdicts": [unsigned]}),
    ]


def test_emitted_ids_are_declared_by_their_check(tmp_path: Path, dtb_corpus: Path) -> None:
    seen: set[str] = set()
    for ctx in _contexts(tmp_path, dtb_corpus):
        for check in runner.load_checks():
            for finding in check.run(ctx):
                assert finding.id in check.catalogue.rules, (check.name, finding.id)
                assert finding.severity in _severities(check, finding.id), finding
                seen.add(finding.id)
    for tree in sorted((dtb_corpus / "freescale").glob("imx8m*.dtb"))[:20]:
        seen |= {f.id for f in check_tree(load_fdt(tree), tree.name)}
    never = (
        {fid for fid, _ in PINNED}
        - seen
        - {runner.error_id(c.prefix) for c in runner.load_checks()}
    )
    print(f"ids not reached by these fixtures: {sorted(never)}", file=sys.stderr)
    assert not never, sorted(never)  # the fixtures keep reaching every id


def test_a_crashing_check_is_one_error_finding_and_counted(monkeypatch, tmp_path: Path) -> None:
    from sysconf.audit.checks.thermal import CATALOGUE
    from sysconf.audit.findings import REGISTRY

    def crash(ctx: AuditContext):
        yield CATALOGUE.finding("THM-ZONES", "pass")
        raise RuntimeError("boom")

    runner.load_checks()
    monkeypatch.setitem(REGISTRY, "thermal", Check("thermal", CATALOGUE, crash, order=40))
    result = runner.run(AuditContext(root=SysRoot.at(tmp_path)), only=["THM"])
    assert [(f.id, f.status) for f in result.findings] == [
        ("THM-ZONES", "pass"),
        ("THM-CHECK-ERROR", "error"),
    ]
    assert "check thermal failed: RuntimeError: boom" in result.findings[-1].title
    stats = {s.check: s for s in result.checks}
    assert (stats["thermal"].ok, stats["thermal"].findings) == (False, 1)
    assert stats["isolation"].ok and stats["isolation"].findings == 0  # --only THM
    assert all(s.seconds >= 0 for s in result.checks)


def test_finding_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Finding("KRN-X", "warn", "warn", "x")  # type: ignore[misc]


def test_end_to_end_json_is_unchanged(tmp_path: Path, dtb_corpus: Path) -> None:
    """`edgectl audit --root ROOT --dtb imx8mp-evk.dtb --format json` on the arm fixture board
    with cores 2-3 isolated; the paths of the run are placeholders in the golden file."""
    root = board_root(tmp_path / "root", cpus=4, arm=True, isolated="2-3")
    edgectl = Path(sys.executable).with_name("edgectl")
    done = subprocess.run(
        [
            str(edgectl),
            "audit",
            "--root",
            str(root),
            "--dtb",
            str(dtb_corpus / BOARD_DTB),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    text = done.stdout.replace(str(root), "ROOT").replace(str(dtb_corpus), "DTB_CORPUS")
    golden = GOLDEN / "audit_imx8mp.json"
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs (EDGED_UPDATE_GOLDEN=1 rewrites it)"
