"""A real Debian root (debootstrap --variant=minbase, cached in the test data folder):
audited, provisioned, audited again, then reverted to the byte."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.roots import tree_state

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _archive() -> str:
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and line.rstrip("/").endswith("/debian"):
                return line.split()[1]
    return "http://deb.debian.org/debian"


@pytest.fixture(scope="session")
def minbase(test_data: Path) -> Path:
    """Built once (≈30 s and ≈200 MB here) and kept beside the other test data."""
    cached = test_data / "images" / f"{SUITE}-minbase"
    if (cached / "etc" / "debian_version").exists():
        return cached
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        pytest.skip("debootstrap needs root")
    partial = cached.with_name(cached.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["debootstrap", "--variant=minbase", SUITE, str(partial), _archive()],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(f"debootstrap failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    partial.rename(cached)
    return cached


def _special_files(folder: str, names: list[str]) -> list[str]:
    """Device nodes, FIFOs and sockets are not copied: reading /dev/full or /dev/zero as a
    file never ends (the image's /dev holds real nodes made by debootstrap)."""
    keep = (stat.S_ISREG, stat.S_ISDIR, stat.S_ISLNK)
    return [
        n
        for n in names
        if not any(test(os.lstat(os.path.join(folder, n)).st_mode) for test in keep)
    ]


def edgectl(*args: str, rc: int | None = 0) -> subprocess.CompletedProcess:
    assert "--root" in args, "this test never touches the live system"
    proc = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    if rc is not None:
        assert proc.returncode == rc, proc.stderr
    return proc


def fixable_problems(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["fixable"] and f["status"] in ("warn", "fail")]


def test_audit_provision_audit_revert(minbase: Path, tmp_path: Path, dtb_corpus: Path) -> None:
    image = tmp_path / "image"
    shutil.copytree(minbase, image, symlinks=True, ignore=_special_files)
    dtb = str(dtb_corpus / "freescale" / "imx8mp-evk.dtb")  # the board this image is for
    before = tree_state(image)

    first = json.loads(
        edgectl("audit", "--root", str(image), "--dtb", dtb, "--format", "json", rc=None).stdout
    )
    assert not [f for f in first["findings"] if f["status"] == "error"], first["summary"]
    trims = {
        f["subject"] for f in first["findings"] if f["id"] == "SVC-TRIM" and f["status"] == "warn"
    }
    assert {"apt-daily.timer", "apt-daily-upgrade.timer"} <= trims  # minbase enables these

    provision = json.loads(
        edgectl(
            "provision", "--root", str(image), "--dtb", dtb, "--inference-cpus", "3", "--json"
        ).stdout
    )
    assert provision["applied"] and not provision["skipped"], provision["skipped"]
    assert (image / "etc/systemd/system/apt-daily.timer").resolve() == Path("/dev/null")
    assert (
        "CPUAffinity=0-2"
        in (image / "etc/systemd/system.conf.d/90-edged-cpuaffinity.conf").read_text()
    )
    assert "kernel.timer_migration = 0" in (image / "etc/sysctl.d/90-edged.conf").read_text()
    assert (image / "etc/systemd/system/multi-user.target.wants/edged.service").is_symlink()

    again = json.loads(
        edgectl(
            "audit",
            "--root",
            str(image),
            "--dtb",
            dtb,
            "--inference-cpus",
            "3",
            "--format",
            "json",
            rc=None,
        ).stdout
    )
    assert fixable_problems(again) == [], fixable_problems(again)
    second = json.loads(
        edgectl(
            "provision", "--root", str(image), "--dtb", dtb, "--inference-cpus", "3", "--json"
        ).stdout
    )
    assert second["applied"] == []  # idempotent

    edgectl("revert", "--root", str(image))
    assert tree_state(image) == before
