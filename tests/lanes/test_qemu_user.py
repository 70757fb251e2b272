"""scripts/qemu_user.py: the emulators of the isa lanes, fetched from Debian trixie's qemu-user.

The isa-avx2 lane (make test-isa-avx2) relies on two facts checked here with the real binary:
under `qemu-x86_64 -cpu Haswell,-hle,-rtm` this venv's python runs, and numpy's runtime CPU
dispatch (which reads CPUID) sees AVX2 and FMA but no AVX-512 and no VNNI, whatever this
host has; /proc/cpuinfo meanwhile still shows the host's flags.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.qemu_user import AVX2_CPU, _ready, qemu_binary

REPO = Path(__file__).resolve().parents[2]
# The emulator is fetched into the test-data cache (scripts/qemu_user.py) and runs Python.
pytestmark = [pytest.mark.integration, pytest.mark.needs_data]

# Run under emulation: numpy's view of CPUID, and the flags /proc/cpuinfo shows.
PROBE = """
import json
from numpy._core._multiarray_umath import __cpu_features__ as features
flags = set()
for line in open("/proc/cpuinfo"):
    if line.startswith("flags"):
        flags |= set(line.split(":", 1)[1].split())
print(json.dumps({"numpy": features, "cpuinfo": sorted(flags)}))
"""


def _host_flags() -> set[str]:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return flags


@pytest.fixture(scope="module")
def qemu_x86() -> Path:
    if platform.machine() != "x86_64":
        pytest.skip(f"the pinned qemu-user build is amd64; this host is {platform.machine()}")
    if _ready() is None and shutil.which("apt-get") is None:
        pytest.skip("apt-get not found: qemu-user cannot be fetched from Debian trixie")
    return qemu_binary("x86_64")


def test_haswell_is_avx2_without_avx512_or_vnni(qemu_x86: Path) -> None:
    proc = subprocess.run(
        [str(qemu_x86), "-cpu", AVX2_CPU, sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # -hle,-rtm: no "TCG doesn't support requested feature" lines on every start.
    assert "warning" not in proc.stderr, proc.stderr
    seen = json.loads(proc.stdout)
    numpy = seen["numpy"]
    assert numpy["AVX2"] and numpy["FMA3"]
    assert not numpy["AVX512F"] and not numpy["AVX512VNNI"] and not numpy["AVX512_SKX"]
    # The kernel, not the emulator, answers /proc/cpuinfo: the host's flags, VNNI and all.
    assert set(seen["cpuinfo"]) == _host_flags()


def test_cli_prints_the_paths(qemu_x86: Path) -> None:
    script = REPO / "scripts" / "qemu_user.py"
    for arch in ("x86_64", "aarch64"):
        proc = subprocess.run(
            [sys.executable, str(script), "--print-path", arch],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        path = Path(proc.stdout.strip())
        assert path == qemu_x86.with_name(f"qemu-{arch}")
        version = subprocess.run([str(path), "--version"], capture_output=True, text=True)
        assert version.stdout.startswith(f"qemu-{arch} version 10."), version.stdout
    bad = subprocess.run(
        [sys.executable, str(script), "--print-path", "riscv64"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
