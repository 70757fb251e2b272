"""Device-tree rules (sysconf.dtcheck) on real board trees and on fdtput-mutated copies."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from sysconf.dtcheck import RULES, check_tree, devicetree_check
from sysconf.fdt import FdtError, load_fdt, materialize
from sysconf.findings import REGISTRY, AuditContext, Finding
from sysconf.sysroot import SysRoot

CLEAN = "freescale/imx93-11x11-evk.dtb"  # no rule fires on it
# Clean too, and with many enabled DMA users: the base for the DMA mutations.
DMA_CLEAN = "freescale/imx8mp-tqma8mpql-mba8mpxl.dtb"
RPI4 = "broadcom/bcm2711-rpi-4-b.dtb"  # v3d GPU + a 64 MiB linux,cma pool: clean too


def _fired(findings: list[Finding], rule: str) -> list[Finding]:
    return [f for f in findings if f.id == rule and f.status != "pass"]


def _check(path: Path, source: str | None = None) -> list[Finding]:
    return check_tree(load_fdt(path), source or path.name)


def _copy(dtb_corpus: Path, board: str, tmp_path: Path) -> Path:
    dest = tmp_path / Path(board).name
    shutil.copyfile(dtb_corpus / board, dest)
    return dest


def _fdtput(*args: str | Path) -> None:
    subprocess.run(["fdtput", *map(str, args)], check=True, capture_output=True)


def _assert_only_passes(findings: list[Finding]) -> None:
    assert [f for f in findings if f.status != "pass"] == []
    assert sorted(f.id for f in findings) == sorted(RULES)


def test_corpus_scan(dtb_corpus: Path) -> None:
    """Every rule over every board: never raises, fast; prints per-rule hit counts."""
    hits: Counter[str] = Counter()
    boards: dict[str, set[str]] = {rule: set() for rule in RULES}
    files = sorted(dtb_corpus.rglob("*.dtb"))
    assert len(files) > 500
    start = time.perf_counter()
    for path in files:
        rel = str(path.relative_to(dtb_corpus))
        findings = check_tree(load_fdt(path), rel)
        for f in findings:
            assert f.id in RULES
            assert f.evidence and f.evidence[0].path.startswith(f"{rel}:/")
            if f.status != "pass":
                hits[f.id] += 1
                boards[f.id].add(rel)
                assert f.subject.startswith("/")
        # exactly one pass per rule that found nothing
        passed = [f.id for f in findings if f.status == "pass"]
        assert sorted(passed) == sorted(set(RULES) - {f.id for f in findings
                                                      if f.status != "pass"})
    elapsed = time.perf_counter() - start
    print(f"\n{len(files)} trees in {elapsed:.2f} s")
    for rule in RULES:
        print(f"  {rule:28} {hits[rule]:5} findings on {len(boards[rule]):4} boards")
    assert elapsed < 20
    # Rules that fire on upstream trees (seen when this test was written, 6.1.176).
    for rule in ("DT-DMA-DISABLED-CONTROLLER", "DT-DMA-NAMES-MISMATCH", "DT-DMA-SHARED-REQUEST",
                 "DT-CMA-MISSING", "DT-DMA-PIO-FALLBACK"):
        assert hits[rule] > 0, rule
    assert hits["DT-PHANDLE-DANGLING"] == 0  # dtc resolves every label


def test_clean_boards(dtb_corpus: Path) -> None:
    _assert_only_passes(_check(dtb_corpus / CLEAN))
    _assert_only_passes(_check(dtb_corpus / RPI4))
    _assert_only_passes(_check(dtb_corpus / DMA_CLEAN))


def test_dma_disabled_controller_real(dtb_corpus: Path) -> None:
    board = "qcom/qrb5165-rb5.dtb"
    hits = _fired(_check(dtb_corpus / board, board), "DT-DMA-DISABLED-CONTROLLER")
    subjects = {f.subject for f in hits}
    assert "/soc@0/geniqup@9c0000/spi@980000" in subjects
    f = next(f for f in hits if f.subject == "/soc@0/geniqup@9c0000/spi@980000")
    assert (f.severity, f.status) == ("fail", "fail")
    assert f.evidence[0].path == f"{board}:/soc@0/geniqup@9c0000/spi@980000"
    assert "/soc@0/dma-controller@900000" in f.evidence[0].observed
    assert "disabled" in f.evidence[0].observed


def test_dma_disabled_controller_mutated(dtb_corpus: Path, tmp_path: Path) -> None:
    copy = _copy(dtb_corpus, DMA_CLEAN, tmp_path)
    tree = load_fdt(copy)
    user = next(n for n in tree.walk() if n.status_ok and "dmas" in n.properties
                and n.path.startswith("/soc"))
    provider = tree.by_phandle(user.prop_u32s("dmas")[0])
    assert provider is not None
    _fdtput("-t", "s", copy, provider.path, "status", "disabled")
    hits = _fired(_check(copy), "DT-DMA-DISABLED-CONTROLLER")
    assert user.path in {f.subject for f in hits}


def test_dma_names_missing_real(dtb_corpus: Path) -> None:
    board = "rockchip/rk3566-quartz64-a.dtb"
    hits = _fired(_check(dtb_corpus / board), "DT-DMA-NAMES-MISMATCH")
    assert "/serial@fe650000" in {f.subject for f in hits}
    assert all(f.severity == "warn" for f in hits)


def test_dma_names_mutated(dtb_corpus: Path, tmp_path: Path) -> None:
    copy = _copy(dtb_corpus, DMA_CLEAN, tmp_path)
    tree = load_fdt(copy)
    users = [n for n in tree.walk() if n.status_ok and len(n.prop_strings("dma-names")) >= 2]
    a, b = users[0], users[1]
    _fdtput("-d", copy, a.path, "dma-names")  # no dma-names at all
    _fdtput("-t", "s", copy, b.path, "dma-names", "rx")  # one name for two entries
    hits = {f.subject: f for f in _fired(_check(copy), "DT-DMA-NAMES-MISMATCH")}
    assert set(hits) == {a.path, b.path}
    assert "no dma-names" in hits[a.path].evidence[0].observed
    assert "['rx']" in hits[b.path].evidence[0].observed


def test_phandle_dangling_mutated(dtb_corpus: Path, tmp_path: Path) -> None:
    copy = _copy(dtb_corpus, CLEAN, tmp_path)
    tree = load_fdt(copy)
    node = next(n for n in tree.walk() if n.status_ok and "clocks" in n.properties
                and n.path.startswith("/soc"))
    other = next(n for n in tree.walk() if n.status_ok and "interrupt-parent" in n.properties
                 and n is not node)
    cells = node.prop_u32s("clocks")
    _fdtput("-t", "x", copy, node.path, "clocks", "0xdead", *(f"{c:x}" for c in cells[1:]))
    _fdtput("-t", "x", copy, other.path, "interrupt-parent", "0xbeef")
    hits = {f.subject: f for f in _fired(_check(copy), "DT-PHANDLE-DANGLING")}
    assert set(hits) == {node.path, other.path}
    assert "0xdead" in hits[node.path].title
    assert "interrupt-parent" in hits[other.path].title
    assert hits[node.path].status == "fail"


def test_shared_request_real(dtb_corpus: Path) -> None:
    board = "qcom/msm8992-xiaomi-libra.dtb"
    hits = _fired(_check(dtb_corpus / board), "DT-DMA-SHARED-REQUEST")
    assert {f.subject for f in hits} == {"/soc/i2c@f9927000", "/soc/i2c@f9967000"}


def test_shared_request_mutated(dtb_corpus: Path, tmp_path: Path) -> None:
    copy = _copy(dtb_corpus, DMA_CLEAN, tmp_path)
    tree = load_fdt(copy)
    users = [n for n in tree.walk() if n.status_ok and "dmas" in n.properties
             and n.path.startswith("/soc")]
    a, b = users[0], users[1]
    _fdtput("-t", "x", copy, b.path, "dmas", *(f"{c:x}" for c in a.prop_u32s("dmas")))
    _fdtput("-t", "s", copy, b.path, "dma-names", *a.prop_strings("dma-names"))
    hits = _fired(_check(copy), "DT-DMA-SHARED-REQUEST")
    assert {f.subject for f in hits} == {a.path, b.path}


def test_cma_missing_real(dtb_corpus: Path) -> None:
    hits = _fired(_check(dtb_corpus / "freescale/imx8mp-evk.dtb"), "DT-CMA-MISSING")
    assert len(hits) == 1
    assert "/soc@0/gpu@38000000" in hits[0].title


def test_cma_mutations(dtb_corpus: Path, tmp_path: Path) -> None:
    small = _copy(dtb_corpus, RPI4, tmp_path)
    _fdtput("-t", "x", small, "/reserved-memory/linux,cma", "size", "2000000")  # 32 MiB
    hits = _fired(_check(small), "DT-CMA-SMALL")
    assert [f.subject for f in hits] == ["/reserved-memory/linux,cma"]
    assert "32 MiB" in hits[0].title and hits[0].severity == "fail"

    (tmp_path / "gone").mkdir()
    gone = _copy(dtb_corpus, RPI4, tmp_path / "gone")
    _fdtput("-r", gone, "/reserved-memory/linux,cma")
    assert len(_fired(_check(gone), "DT-CMA-MISSING")) == 1

    (tmp_path / "nomap").mkdir()
    nomap = _copy(dtb_corpus, RPI4, tmp_path / "nomap")
    _fdtput(nomap, "/reserved-memory/linux,cma", "no-map")  # empty (boolean) property
    hits = _fired(_check(nomap), "DT-CMA-NOMAP-REUSABLE")
    assert [f.subject for f in hits] == ["/reserved-memory/linux,cma"]
    assert hits[0].status == "fail"


def test_pio_fallback_real(dtb_corpus: Path) -> None:
    board = "freescale/imx8mm-beacon-kit.dtb"
    hits = _fired(_check(dtb_corpus / board), "DT-DMA-PIO-FALLBACK")
    assert [f.subject for f in hits] == ["/soc@0/bus@30800000/spba-bus@30800000/serial@30890000"]
    assert hits[0].severity == "info"


def test_registered_check(dtb_corpus: Path, tmp_path: Path) -> None:
    assert REGISTRY["devicetree"].prefix == "DT"
    tree = load_fdt(dtb_corpus / CLEAN)
    ctx = AuditContext(root=SysRoot.at(tmp_path), dtbs=[("a.dtb", tree), ("b.dtb", tree)])
    findings = list(devicetree_check(ctx))
    assert len(findings) == 2 * len(RULES)
    assert {f.evidence[0].path.split(":")[0] for f in findings} == {"a.dtb", "b.dtb"}

    skipped = list(devicetree_check(AuditContext(root=SysRoot.at(tmp_path / "empty"))))
    assert [(f.status, f.title) for f in skipped] == [("skip", "no device tree")]

    root = tmp_path / "image"
    materialize(load_fdt(dtb_corpus / "qcom/qrb5165-rb5.dtb"),
                root / "sys/firmware/devicetree/base")
    live = list(devicetree_check(AuditContext(root=SysRoot.at(root))))
    assert _fired(live, "DT-DMA-DISABLED-CONTROLLER")
    assert all(f.evidence[0].path.startswith("/sys/firmware/devicetree/base:/") for f in live)


def test_truncated_dtb_fails_before_checks(dtb_corpus: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.dtb"
    cut.write_bytes((dtb_corpus / CLEAN).read_bytes()[:5000])
    with pytest.raises(FdtError, match="truncated"):
        load_fdt(cut)
