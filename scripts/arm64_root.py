#!/usr/bin/env python3
"""Build the aarch64 lane's root: Debian bookworm arm64 with python3.11 and edged's runtime
dependencies as aarch64 wheels, run on this x86 host under qemu-user (issue 11).

Everything comes from package registries, pinned by sha256 in two committed lock files, and is
cached; nothing is installed on the host and no maintainer script runs:

* scripts/arm64-debs.lock: the root's 46 Debian packages (python3.11, libstdc++6, libgomp1,
  ca-certificates and their closure), and the amd64 cross compiler (gcc-12-aarch64-linux-gnu
  and the libraries it runs with) that builds hdrhistogram's C module, which has no aarch64
  wheel. Fetched with apt-get under a private apt state (bookworm, -updates, -security; arm64
  and amd64 lists), the host's apt configuration left alone; unpacked with the project's
  pure-Python .deb reader. When a Debian point release has replaced a pinned version, the
  current candidate is taken instead (apt checks it against the signed Release file): a
  warning names its version and sha256, and the lock should be refreshed.
* scripts/arm64-wheels.lock: cp311 manylinux aarch64 wheels in pip's `--require-hashes`
  format, installed by the host's pip with `--target --platform ... --no-deps` into
  ROOT/opt/edged/lib/python3.11/site-packages (ROOT/opt/edged is a venv of the root's python).
* hdrhistogram 0.10.8's sdist (HDRH below): `hdrh/` and the cross-compiled `pyhdrh` module
  (`hdrh.histogram` imports it at import time, so it cannot be left out).

The root's stdlib and site-packages are byte-compiled on the host (python 3.11, same magic
number; `import numpy` under emulation drops from 5-7 s to about 1.3 s), and ROOT/sys holds the
emulated CPU's `midr_el1` files (OpenVINO prints a line on stderr without them).

Running it: ROOT/opt/edged/bin/{python3,edgectl,edged} are host shell scripts that exec
`qemu-aarch64 -L ROOT -cpu $EDGED_ARM64_CPU -0 <wrapper> ROOT/usr/bin/python3.11`, so
sys.executable is the wrapper and a child started as [sys.executable, ...] is emulated too. The
emulator is scripts/qemu_user.py's (path baked in; EDGED_ARM64_QEMU overrides it), the CPU
`cortex-a76` unless EDGED_ARM64_CPU names another qemu model. The project's code is not copied
into the root: every `ensure` writes site-packages/edged-src.pth naming the checkout this script
is in, so the root runs the working tree (qemu -L serves only paths that exist in ROOT; the rest,
/work/main included, is the host's). One root serves every checkout that uses the cache, so the
last `ensure` decides which working tree it runs. The midr_el1 files follow the CPU `ensure` was
given (EDGED_ARM64_CPU by default) and this host's CPUs: call `ensure` again after changing
either (any value silences OpenVINO; only the value's CPU differs).

Cache: $EDGED_TEST_DATA/arm64-root/<key>/ (default ~/.cache/edged/test-data), key = sha256 of
the two lock files, the qemu pin, HDRH and LAYOUT. A build runs in a temporary folder that is
renamed when it is complete (build.json is its stamp), so a half-built root is never used; the
previous key is kept, older ones removed. Every build is smoke-tested (an emulated import of
the runtimes, nothing on stderr) on cortex-a76. Downloads are kept in arm64-root/debs and
/wheels, so a lock change fetches only what changed. A warm start (everything cached) only
checks the stamp and rewrites the wrappers, the .pth and midr_el1 when they differ.

Refreshing the locks (a new Debian point release, new wheel versions):

    .venv/bin/python scripts/arm64_root.py --update-locks
    make arm64-root

`--update-locks` resolves ROOT_PACKAGES' closure with `apt-get -s install` (empty dpkg status,
no recommends) and CROSS_PACKAGES' candidates under the private apt state, takes each one's
sha256 from the signed index, and rewrites scripts/arm64-debs.lock; then it runs `pip download`
of WHEEL_REQUIREMENTS (with their dependencies) for cp311 aarch64, constrained to the versions
installed in the Python running it (the project's x86 venv, so x86 and aarch64 compare like with
like), and rewrites scripts/arm64-wheels.lock from the downloaded files' sha256. Review the diff,
then commit both files. (To change hdrhistogram, edit HDRH with its sdist's sha256.)

Usage: arm64_root.py [--print-path] [--json] [--rebuild] | --update-locks
  --print-path  print the root's path on stdout
  --json        print the root's paths, versions and any fallback as JSON on stdout
  --rebuild     build again even when the cached root is complete (it replaces the root:
                stop programs running in it first)
Importable: `ensure(progress=...) -> Path` (the root), `paths(root)`.
Exit codes: 0 ready, 1 a download, check or build step failed (the message names what and why),
2 bad arguments. Progress, timings and warnings go to stderr, as `arm64-root: ...` lines.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from scripts.fetch_test_data import (
    FetchError,
    _apt_env,
    _deb_data_tar,
    _debian_archive_uri,
    cache_dir,
    check_sha,
    sha256_file,
)
from scripts.qemu_user import QEMU_DEB, qemu_binary

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEBS_LOCK = HERE / "arm64-debs.lock"
WHEELS_LOCK = HERE / "arm64-wheels.lock"
LAYOUT = 1  # bump when the root's layout or the build recipe changes: a new cache key

SUITE = "bookworm"
ARCHES = ("arm64", "amd64")  # arm64 native (the root), amd64 for the cross compiler
ROOT_PACKAGES = ("python3.11", "python3", "libstdc++6", "libgomp1", "ca-certificates")
# gcc-12's aarch64 cross compiler and what it runs with on a bare amd64 host (its own libbfd is
# in binutils-aarch64-linux-gnu; libsframe in libbinutils), the arm64 libc and Python headers.
_CROSS = """
    gcc-12-aarch64-linux-gnu:amd64 cpp-12-aarch64-linux-gnu:amd64
    gcc-12-aarch64-linux-gnu-base:amd64 binutils-aarch64-linux-gnu:amd64 libbinutils:amd64
    libjansson4:amd64 libisl23:amd64 libmpc3:amd64 libmpfr6:amd64 libgmp10:amd64 libzstd1:amd64
    zlib1g:amd64 libgcc-12-dev-arm64-cross:all libc6-dev-arm64-cross:all
    linux-libc-dev-arm64-cross:all libc6-arm64-cross:all libgcc-s1-arm64-cross:all
    libpython3.11-dev:arm64
"""
CROSS_PACKAGES = tuple(tuple(entry.split(":", 1)) for entry in _CROSS.split())
# What edged, edgectl (quantize too) and the daemon import in the root; their dependencies are
# resolved into the lock by --update-locks. Host-side test tools (pytest, tritonclient) are not
# here: the lane drives the root from the host's pytest.
_REQUIREMENTS = """
    numpy onnxruntime openvino ai-edge-litert rknn-toolkit-lite2 onnx flatbuffers uvicorn
    httptools uvloop prometheus-client orjson paho-mqtt psutil pyudev tqdm pillow sympy grpcio
"""
WHEEL_REQUIREMENTS = tuple(_REQUIREMENTS.split())


@dataclass(frozen=True)
class Sdist:
    name: str
    version: str
    sha256: str
    c_source: str  # the C module's source in the sdist, built with the cross compiler
    module: str  # its extension module's name

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


HDRH = Sdist(
    name="hdrhistogram",
    version="0.10.8",
    sha256="88986eea184d1330c53fca98adf58799339a23ac27f488887b0423c7ce569c34",
    c_source="src/python-codec.c",
    module="pyhdrh",
)
# pip's --platform matches tags exactly: every manylinux tag up to bookworm's glibc 2.36 is
# listed, or pip quietly picks old releases (openvino 2023.1, ai-edge-litert 1.4).
GLIBC_MINOR = 36
PLATFORM_ARGS = (
    *["--only-binary=:all:", "--implementation=cp", "--python-version=3.11"],
    *["--abi=cp311", "--abi=abi3", "--abi=none"],
    *["--platform=any", "--platform=linux_aarch64", "--platform=manylinux2014_aarch64"],
    *(f"--platform=manylinux_2_{n}_aarch64" for n in range(17, GLIBC_MINOR + 1)),
)
DEFAULT_CPU = "cortex-a76"  # asimd + dotprod: RK3588, Raspberry Pi 5
VENV = "opt/edged"
SITE = f"{VENV}/lib/python3.11/site-packages"
PTH = "edged-src.pth"
KEEP = 2  # complete roots kept in the cache: the current one and the one before
TIMEOUT_S = 900  # a stuck mirror or index fails the step, not the CI run's whole budget
# Imported (and hdrh's C module used) by the emulated python before a build is accepted.
SMOKE = """
import json, platform, sys
import numpy, onnxruntime, openvino, onnx, PIL.Image, uvloop, httptools, orjson, psutil
import ai_edge_litert.interpreter, rknnlite.api, pyudev, paho.mqtt.client, prometheus_client
import uvicorn, flatbuffers, tqdm
from hdrh.histogram import HdrHistogram
h = HdrHistogram(1, 60_000_000, 3)
h.record_value(1234)
assert HdrHistogram.decode(h.encode()).get_total_count() == 1
print(json.dumps({"machine": platform.machine(), "executable": sys.executable,
    "python": platform.python_version(), "numpy": numpy.__version__,
    "onnxruntime": onnxruntime.__version__,
    "openvino": openvino.__version__.split("-")[0]}))
"""
CPU_DIR = "sys/devices/system/cpu"


def log(msg: str) -> None:
    print(f"arm64-root: {msg}", file=sys.stderr, flush=True)


Progress = Callable[[str], None]


# --- lock files --------------------------------------------------------------------------------


class LockError(FetchError):
    pass


@dataclass(frozen=True)
class DebPin:
    role: str  # "root": unpacked into the root; "cross": the compiler's, in a temporary folder
    package: str
    arch: str  # the package's Architecture: arm64, amd64 or all
    version: str
    sha256: str

    @property
    def name(self) -> str:
        """apt's name for it: pkg:arch (arch-all packages have no arch qualifier)."""
        return self.package if self.arch == "all" else f"{self.package}:{self.arch}"

    @property
    def filename(self) -> str:
        """The file `apt-get download` writes (the epoch's ':' escaped, as apt does)."""
        return f"{self.package}_{self.version.replace(':', '%3a')}_{self.arch}.deb"


@dataclass(frozen=True)
class WheelPin:
    name: str
    version: str
    sha256: str


_SHA = re.compile(r"[0-9a-f]{64}")
_WHEEL_LINE = re.compile(
    r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)\s+--hash=sha256:(?P<sha>\S+)"
)


def _lock_lines(text: str) -> Iterator[tuple[int, str]]:
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            yield number, line


def parse_debs_lock(text: str, source: str = "arm64-debs.lock") -> list[DebPin]:
    """`role package arch version sha256` lines; '#' starts a comment."""
    pins: list[DebPin] = []
    seen: set[tuple[str, str]] = set()
    for number, line in _lock_lines(text):
        fields = line.split()
        where = f"{source}:{number}"
        if len(fields) != 5:
            raise LockError(f"{where}: expected 'role package arch version sha256', got {line!r}")
        role, package, arch, version, sha = fields
        if role not in ("root", "cross"):
            raise LockError(f"{where}: role {role!r} is neither 'root' nor 'cross'")
        if arch not in ("arm64", "amd64", "all"):
            raise LockError(f"{where}: architecture {arch!r} is not arm64, amd64 or all")
        if not _SHA.fullmatch(sha):
            raise LockError(f"{where}: {sha!r} is not a sha256 (64 lowercase hex digits)")
        if (package, arch) in seen:
            raise LockError(f"{where}: {package}:{arch} is pinned twice")
        seen.add((package, arch))
        pins.append(DebPin(role, package, arch, version, sha))
    if not any(pin.role == "root" for pin in pins):
        raise LockError(f"{source}: no 'root' package pinned")
    return pins


def parse_wheels_lock(text: str, source: str = "arm64-wheels.lock") -> list[WheelPin]:
    """pip's `name==version --hash=sha256:HEX` lines (one hash each); '#' starts a comment."""
    pins: list[WheelPin] = []
    seen: set[str] = set()
    for number, line in _lock_lines(text):
        where = f"{source}:{number}"
        match = _WHEEL_LINE.fullmatch(line)
        if match is None:
            raise LockError(f"{where}: expected 'name==version --hash=sha256:HEX', got {line!r}")
        name = re.sub(r"[-_.]+", "-", match["name"]).lower()
        if not _SHA.fullmatch(match["sha"]):
            raise LockError(f"{where}: {match['sha']!r} is not a sha256 (64 lowercase hex digits)")
        if name in seen:
            raise LockError(f"{where}: {name} is pinned twice")
        seen.add(name)
        pins.append(WheelPin(name, match["version"], match["sha"]))
    if not pins:
        raise LockError(f"{source}: no wheel pinned")
    return pins


def cache_key(debs_lock: bytes, wheels_lock: bytes) -> str:
    """What the root is built from: both lock files, the emulator's pin, HDRH and LAYOUT."""
    h = hashlib.sha256()
    for part in (
        debs_lock,
        wheels_lock,
        json.dumps(asdict(QEMU_DEB), sort_keys=True).encode(),
        json.dumps(asdict(HDRH), sort_keys=True).encode(),
        json.dumps([LAYOUT, PLATFORM_ARGS]).encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


# --- paths ---------------------------------------------------------------------------------------


def cache_root() -> Path:
    return cache_dir() / "arm64-root"


def paths(root: Path) -> dict[str, Path]:
    """The root's programs (host-side wrappers) and its site-packages."""
    bin_dir = root / VENV / "bin"
    return {
        "root": root,
        "python": bin_dir / "python3",
        "edgectl": bin_dir / "edgectl",
        "edged": bin_dir / "edged",
        "site_packages": root / SITE,
    }


def _chosen_cpu(cpu: str | None) -> str:
    return cpu or os.environ.get("EDGED_ARM64_CPU") or DEFAULT_CPU


def _qemu() -> Path:
    env = os.environ.get("EDGED_ARM64_QEMU")
    return Path(env) if env else qemu_binary("aarch64")  # qemu_user.py logs a fetch itself


@contextmanager
def _step(progress: Progress, what: str) -> Iterator[dict[str, str]]:
    """Times a step; the caller may put a detail into the yielded dict's "detail"."""
    start = time.monotonic()
    info: dict[str, str] = {}
    yield info
    detail = f" ({info['detail']})" if info.get("detail") else ""
    progress(f"{what}: {time.monotonic() - start:.1f} s{detail}")


def _run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    except subprocess.TimeoutExpired as exc:
        raise FetchError(f"{what}: no answer in {TIMEOUT_S} s") from exc
    except OSError as exc:
        raise FetchError(f"{what}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-600:]
        raise FetchError(f"{what} failed (exit {proc.returncode}): {tail}")
    return proc


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _tree_size(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            with suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _write_if_changed(path: Path, text: str, mode: int = 0o644) -> bool:
    """Atomically replace `path` with `text` unless it already holds it. True if written."""
    try:
        if path.read_text() == text and (path.stat().st_mode & 0o777) == mode:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)
    return True


# --- Debian packages -----------------------------------------------------------------------------


def _apt_state(state: Path) -> dict[str, str]:
    """_apt_env's private state for bookworm, with -updates and -security added."""
    env = _apt_env(state, ARCHES, SUITE)
    sources = state / "sources.list"
    line = sources.read_text().strip()
    uri = _debian_archive_uri()
    lines = [
        line,
        line.replace(f" {SUITE} ", f" {SUITE}-updates "),
        line.replace(f" {uri} ", f" {_security_uri(uri)} ").replace(
            f" {SUITE} ", f" {SUITE}-security "
        ),
    ]
    sources.write_text("\n".join(lines) + "\n")
    return env


def _security_uri(uri: str) -> str:
    """The security archive beside `uri`: the host's own when its sources name one."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:"):
                for candidate in line.split()[1:]:
                    if candidate.rstrip("/").endswith("/debian-security"):
                        return candidate
    return uri.rstrip("/") + "-security"


def _apt_update(env: dict[str, str], progress: Progress) -> None:
    if shutil.which("apt-get") is None:
        raise FetchError("apt-get not found: the root's packages come from Debian bookworm")
    with _step(progress, f"apt-get update (private state, {'+'.join(ARCHES)} {SUITE})") as info:
        proc = _run(["apt-get", "-q", "update"], "apt-get update", env=env)
        fetched = re.search(r"Fetched (\S+ \S*B)", proc.stdout)
        info["detail"] = f"fetched {fetched[1]}" if fetched else "lists up to date"


def _index_records(specs: Iterable[str], env: dict[str, str]) -> list[dict[str, str]]:
    """The package index's records for `specs` (pkg[:arch][=version]); absent ones are left
    out (apt-cache says nothing about them and exits 0)."""
    specs = list(specs)
    if not specs:
        return []
    try:
        proc = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", *specs],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"apt-cache show: {exc}") from exc
    records: list[dict[str, str]] = []
    for block in proc.stdout.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(": ")
            if sep and not line[0].isspace():
                fields[key] = value.strip()
        if {"Package", "Architecture", "Version", "SHA256"} <= fields.keys():
            records.append(fields)
    return records


def _resolve(pins: list[DebPin], env: dict[str, str], progress: Progress) -> list[DebPin]:
    """The pins as the archive has them; a pin no longer there is replaced by the current
    candidate, with a warning. A pinned version whose sha256 changed is an error."""
    index = {
        (r["Package"], r["Architecture"], r["Version"]): r["SHA256"]
        for r in _index_records((f"{p.name}={p.version}" for p in pins), env)
    }
    gone = [p for p in pins if (p.package, p.arch, p.version) not in index]
    current = {
        (r["Package"], r["Architecture"]): r for r in _index_records((p.name for p in gone), env)
    }
    resolved: list[DebPin] = []
    for pin in pins:
        sha = index.get((pin.package, pin.arch, pin.version))
        if sha is not None:
            if sha != pin.sha256:
                raise FetchError(
                    f"{pin.name} {pin.version}: the archive's sha256 {sha} does not match "
                    f"the pinned {pin.sha256} ({DEBS_LOCK.name})"
                )
            resolved.append(pin)
            continue
        record = current.get((pin.package, pin.arch))
        if record is None:
            raise FetchError(f"{pin.name} is not in Debian {SUITE}'s package index")
        now = DebPin(pin.role, pin.package, pin.arch, record["Version"], record["SHA256"])
        progress(
            f"WARNING: pinned {pin.name} {pin.version} is no longer in Debian {SUITE}; taking "
            f"the current candidate {now.version} (sha256 {now.sha256}, checked by apt against "
            f"the signed Release file). Refresh {DEBS_LOCK.name}: "
            "python scripts/arm64_root.py --update-locks"
        )
        resolved.append(now)
    return resolved


def _cached(path: Path, sha: str) -> bool:
    """True when `path` holds `sha`; a file with other contents is removed."""
    if not path.exists():
        return False
    if sha256_file(path) == sha:
        return True
    path.unlink()
    return False


def _download_debs(pins: list[DebPin], env: dict[str, str], debs: Path) -> int:
    """Every pin's .deb in `debs`, sha256-checked. Returns the bytes downloaded."""
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in pins if not _cached(debs / p.filename, p.sha256)]
    if missing:
        specs = [f"{p.name}={p.version}" for p in missing]
        _run(["apt-get", "-q", "download", *specs], "apt-get download", env=env, cwd=debs)
    for pin in missing:
        path = debs / pin.filename
        if not path.exists():
            raise FetchError(f"apt-get download {pin.name}={pin.version} wrote no {path.name}")
        check_sha(path, pin.sha256)
    return sum((debs / p.filename).stat().st_size for p in missing)


def _member(name: str) -> str | None:
    """A tar member's path relative to the tree it is unpacked into, None for the tree itself;
    an absolute path or one with '..' is refused."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        raise FetchError(f"refusing tar member {name!r}: outside the tree")
    return "/".join(parts) or None


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()


def unpack(tar: tarfile.TarFile, dest: Path, origin: str) -> int:
    """Unpack `tar` into `dest` as dpkg would place it, without following a link out of `dest`
    (a parent that resolves outside is refused) and without setuid/setgid bits. Returns the
    number of files."""
    top = dest.resolve()
    files = 0
    for info in tar:
        rel = _member(info.name)
        if rel is None:
            continue
        out = dest / rel
        parent = out.parent
        parent.mkdir(parents=True, exist_ok=True)
        real = parent.resolve()
        if real != top and top not in real.parents:
            raise FetchError(f"{origin}: {info.name} would be written outside {dest} ({real})")
        if info.isdir():
            if out.is_symlink() or not out.is_dir():
                _remove(out)
                out.mkdir(exist_ok=True)
            out.chmod((info.mode & 0o777) | 0o700)
        elif info.issym():
            _remove(out)
            os.symlink(info.linkname, out)
        elif info.islnk():
            target_rel = _member(info.linkname)
            if target_rel is None:
                raise FetchError(f"{origin}: hard link {info.name} to the tree itself")
            _remove(out)
            os.link(dest / target_rel, out)
            files += 1
        elif info.isfile():
            _remove(out)
            extracted = tar.extractfile(info)
            if extracted is None:
                raise FetchError(f"{origin}: {info.name} cannot be read")
            with extracted, out.open("xb") as f:
                shutil.copyfileobj(extracted, f, 1 << 20)
            out.chmod((info.mode & 0o777) | 0o200)
            os.utime(out, (info.mtime, info.mtime))
            files += 1
        # device nodes and FIFOs (none in these packages) are left out
    return files


def _unpack_debs(pins: list[DebPin], debs: Path, dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    files = 0
    for pin in pins:
        with _deb_data_tar(debs / pin.filename) as tar:
            files += unpack(tar, dest, pin.filename)
    return files


# --- wheels and hdrhistogram ---------------------------------------------------------------------


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]


def _wheel_shas(wheels: Path) -> dict[str, Path]:
    return {sha256_file(p): p for p in sorted(wheels.glob("*.whl"))}


def _download_wheels(pins: list[WheelPin], wheels: Path) -> int:
    """Every pinned wheel in `wheels` (pip checks the hashes). Returns the bytes downloaded."""
    wheels.mkdir(parents=True, exist_ok=True)
    have = _wheel_shas(wheels)
    if all(pin.sha256 in have for pin in pins):
        return 0
    before = {p.name for p in wheels.glob("*.whl")}
    _run(
        _pip(
            "download",
            "--no-deps",
            "--require-hashes",
            *PLATFORM_ARGS,
            "-d",
            str(wheels),
            "-r",
            str(WHEELS_LOCK),
        ),
        f"pip download -r {WHEELS_LOCK.name}",
    )
    have = _wheel_shas(wheels)
    absent = [f"{p.name}=={p.version}" for p in pins if p.sha256 not in have]
    if absent:
        raise FetchError(f"pip download left out {', '.join(absent)} (no file with its sha256)")
    return sum(p.stat().st_size for p in wheels.glob("*.whl") if p.name not in before)


def _install_wheels(wheels: Path, site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    _run(
        _pip(
            "install",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(wheels),
            "--require-hashes",
            "--no-compile",
            "--target",
            str(site),
            *PLATFORM_ARGS,
            "-r",
            str(WHEELS_LOCK),
        ),
        f"pip install --target (from {WHEELS_LOCK.name})",
    )
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts with the host's shebang


def _download_sdist(sdist: Sdist, folder: Path) -> tuple[Path, int]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{sdist.name}-{sdist.version}.tar.gz"
    if _cached(path, sdist.sha256):
        return path, 0
    _run(
        _pip("download", "--no-deps", "--no-binary=:all:", "-d", str(folder), sdist.requirement),
        f"pip download {sdist.requirement} (sdist)",
    )
    if not path.exists():
        raise FetchError(f"pip download {sdist.requirement} wrote no {path.name}")
    check_sha(path, sdist.sha256)
    return path, path.stat().st_size


def _build_hdrh(cross: list[DebPin], debs: Path, sdist_path: Path, work: Path, site: Path) -> None:
    """hdrh/ from the sdist and its C module cross-compiled for aarch64 into `site`."""
    xroot = work / "xgcc"
    _unpack_debs(cross, debs, xroot)
    src = work / "sdist"
    with tarfile.open(sdist_path) as tar:
        unpack(tar, src, sdist_path.name)
    tree = src / f"{HDRH.name}-{HDRH.version}"
    gcc = xroot / "usr/bin/aarch64-linux-gnu-gcc-12"
    if not gcc.exists():
        raise FetchError(f"no {gcc.relative_to(xroot)} in the cross packages ({DEBS_LOCK.name})")
    libs = [xroot / "usr/lib/x86_64-linux-gnu", xroot / "lib/x86_64-linux-gnu"]
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": ":".join(str(p) for p in libs),
        "PATH": f"{xroot / 'usr/bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    module = site / f"{HDRH.module}.cpython-311-aarch64-linux-gnu.so"
    _run(
        [
            str(gcc),
            f"--sysroot={xroot}",
            "-O2",
            "-fPIC",
            "-shared",
            f"-I{xroot / 'usr/include'}",
            f"-I{xroot / 'usr/include/python3.11'}",
            str(tree / HDRH.c_source),
            "-o",
            str(module),
        ],
        f"aarch64-linux-gnu-gcc-12 {HDRH.c_source} ({HDRH.requirement})",
        env=env,
    )
    shutil.copytree(tree / "hdrh", site / "hdrh")
    info = site / f"{HDRH.name}-{HDRH.version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {HDRH.name}\nVersion: {HDRH.version}\n"
    )
    (info / "INSTALLER").write_text("scripts/arm64_root.py\n")
    (info / "top_level.txt").write_text(f"hdrh\n{HDRH.module}\n")


# --- the venv, the wrappers, midr_el1 ------------------------------------------------------------


def python_wrapper(qemu: Path) -> str:
    """ROOT/opt/edged/bin/python3: the host-side stand-in for the root's python."""
    return f"""#!/bin/sh
# Written by scripts/arm64_root.py. The root's aarch64 python3.11 under qemu-user; -0 makes
# sys.executable this file, so a child started as [sys.executable, ...] is emulated too.
here=$(dirname "$(readlink -f "$0")")
root=${{here%/{VENV}/bin}}
exec "${{EDGED_ARM64_QEMU:-{qemu}}}" \\
    -L "$root" -cpu "${{EDGED_ARM64_CPU:-{DEFAULT_CPU}}}" \\
    -0 "$here/python3" "$root/usr/bin/python3.11" "$@"
"""


def entry_wrapper(prog: str, module: str) -> str:
    """ROOT/opt/edged/bin/edgectl and edged, like pip's console scripts."""
    code = f'import sys; from {module} import main; sys.argv[0] = "{prog}"; sys.exit(main())'
    return f"""#!/bin/sh
# Written by scripts/arm64_root.py: {prog} in the root, under the emulated python beside it.
exec "$(dirname "$(readlink -f "$0")")/python3" -P -c '{code}' "$@"
"""


def _write_programs(root: Path, qemu: Path) -> bool:
    bin_dir = root / VENV / "bin"
    changed = _write_if_changed(bin_dir / "python3", python_wrapper(qemu), 0o755)
    for prog, module in (("edgectl", "edged.cli.main"), ("edged", "edged.daemon")):
        changed |= _write_if_changed(bin_dir / prog, entry_wrapper(prog, module), 0o755)
    for alias in ("python", "python3.11"):
        link = bin_dir / alias
        if not link.is_symlink():
            link.symlink_to("python3")
    return changed


def _write_pyvenv(root: Path, final: Path) -> None:
    (root / VENV / "pyvenv.cfg").write_text(
        f"home = {final}/usr/bin\ninclude-system-site-packages = false\nversion = 3.11\n"
        f"executable = {final}/usr/bin/python3.11\n"
    )


def _write_pth(root: Path, src: Path) -> bool:
    return _write_if_changed(root / SITE / PTH, f"{src}\n")


def midr_from_cpuinfo(text: str) -> str:
    """MIDR_EL1 of the first processor in /proc/cpuinfo, as the kernel's sysfs file shows it:
    implementer[31:24] variant[23:20] architecture[19:16]=0xf part[15:4] revision[3:0]."""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    try:
        midr = (
            int(fields["CPU implementer"], 0) << 24
            | int(fields["CPU variant"], 0) << 20
            | 0xF << 16
            | int(fields["CPU part"], 0) << 4
            | int(fields["CPU revision"], 0)
        )
    except (KeyError, ValueError) as exc:
        raise FetchError(f"no CPU id in the emulated /proc/cpuinfo: {exc}") from exc
    return f"0x{midr:016x}"


def host_cpus() -> list[str]:
    """This host's cpuN names in /sys (the root's CPU folder must list the same ones: qemu -L
    lists a folder from ROOT when it exists there)."""
    try:
        names = os.listdir(f"/{CPU_DIR}")
    except OSError:
        return [f"cpu{n}" for n in range(os.cpu_count() or 1)]
    return sorted((n for n in names if re.fullmatch(r"cpu\d+", n)), key=lambda n: int(n[3:]))


def _emulated_midr(root: Path, qemu: Path, cpu: str) -> str:
    proc = _run(
        [
            str(qemu),
            "-L",
            str(root),
            "-cpu",
            cpu,
            str(root / "usr/bin/python3.11"),
            "-S",
            "-I",
            "-c",
            "import sys; sys.stdout.write(open('/proc/cpuinfo').read())",
        ],
        f"qemu-aarch64 -cpu {cpu} (reading the emulated /proc/cpuinfo)",
    )
    return midr_from_cpuinfo(proc.stdout)


def _write_midr(folder: Path, root: Path, qemu: Path, cpu: str) -> bool:
    """ROOT/sys/devices/system/cpu/cpuN/regs/identification/midr_el1 for the emulated `cpu`,
    one per host CPU; `folder`/midr.json remembers each model's value and what is written."""
    state_file = folder / "midr.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {}
    values = state.get("values", {})
    cpus = host_cpus()
    if state.get("written") == {"cpu": cpu, "cpus": cpus}:
        return False
    if cpu not in values:
        values[cpu] = _emulated_midr(root, qemu, cpu)
    base = root / CPU_DIR
    if base.exists():
        for old in base.iterdir():
            if old.name not in cpus:
                shutil.rmtree(old)
    for name in cpus:
        _write_if_changed(base / name / "regs/identification/midr_el1", values[cpu] + "\n", 0o444)
    _write_if_changed(
        state_file, json.dumps({"values": values, "written": {"cpu": cpu, "cpus": cpus}}) + "\n"
    )
    return True


# --- byte-compiling and the smoke test -----------------------------------------------------------


def _host_python311() -> str | None:
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    return shutil.which("python3.11")


def _compile(root: Path, final: Path, wrapper: Path) -> str:
    """Byte-compile the stdlib and site-packages (paths in the .pyc files name `final`)."""
    dirs = [str(root / "usr/lib/python3.11"), str(root / SITE)]
    python = _host_python311()
    # Without a host 3.11 the root's own python does it, emulated: minutes instead of seconds.
    cmd = [python] if python else [str(wrapper)]
    cmd += ["-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "timestamp"]
    cmd += ["-s", str(root), "-p", str(final), *dirs]
    # SOURCE_DATE_EPOCH would make them checked-hash .pyc files: every import rehashes.
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"compileall: {exc}") from exc
    # A few test files of the stdlib and of the wheels are not valid Python 3.11: skipped.
    failed = proc.stdout.count("***")
    how = "host python 3.11" if python else "emulated, no host python3.11"
    return f"{how}, {failed} files skipped" if failed else how


def _smoke(root: Path, qemu: Path, cpu: str) -> dict[str, str]:
    python = paths(root)["python"]
    env = {**os.environ, "EDGED_ARM64_QEMU": str(qemu), "EDGED_ARM64_CPU": cpu}
    env.pop("PYTHONPATH", None)
    proc = _run([str(python), "-c", SMOKE], "the smoke import under emulation", env=env)
    try:
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise FetchError(f"smoke import printed {proc.stdout[-300:]!r}") from exc
    if seen.get("machine") != "aarch64" or seen.get("executable") != os.path.realpath(python):
        raise FetchError(f"smoke import: not the root's aarch64 python: {seen}")
    if proc.stderr.strip():
        raise FetchError(f"smoke import wrote to stderr: {proc.stderr.strip()[-600:]}")
    return seen


# --- ensure --------------------------------------------------------------------------------------


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits, then finds the stamp
        yield


def _stamp(folder: Path, key: str) -> dict | None:
    """build.json of a complete root for `key`, else None."""
    try:
        build = json.loads((folder / "build.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(build, dict) or build.get("key") != key:
        return None
    if not os.access(folder / "root/usr/bin/python3.11", os.F_OK):
        return None
    return build


def _fallback_warnings(build: dict, progress: Progress) -> None:
    for pin in build.get("fallbacks", []):
        progress(
            f"WARNING: built with {pin['name']} {pin['version']} (sha256 {pin['sha256']}), "
            f"not the pinned {pin['pinned']} (no longer in Debian {SUITE}): refresh "
            f"{DEBS_LOCK.name} with python scripts/arm64_root.py --update-locks"
        )


def _fetch_debs(
    pins: list[DebPin], base: Path, progress: Progress
) -> tuple[list[DebPin], list[dict[str, str]], int]:
    """The .debs of `pins` in base/debs, sha256-checked: (the pins as fetched, the fallbacks,
    bytes downloaded). When all are cached, apt is not asked at all."""
    debs = base / "debs"
    with _step(progress, "check the cached .debs") as info:
        cached = sum(_cached(debs / p.filename, p.sha256) for p in pins)
        info["detail"] = f"{cached} of {len(pins)} cached"
    if cached == len(pins):
        return pins, [], 0
    env = _apt_state(base / "apt-state")
    _apt_update(env, progress)
    with _step(progress, "resolve the pinned packages") as info:
        resolved = _resolve(pins, env, progress)
        fallbacks = [
            {"name": now.name, "version": now.version, "sha256": now.sha256, "pinned": old.version}
            for old, now in zip(pins, resolved, strict=True)
            if now != old
        ]
        info["detail"] = f"{len(resolved)} packages, {len(fallbacks)} not as pinned"
    with _step(progress, "download and check the .debs") as info:
        got = _download_debs(resolved, env, debs)
        info["detail"] = f"{_mib(got)} downloaded"
    return resolved, fallbacks, got


def _build(key: str, base: Path, qemu: Path, cpu: str, src: Path, progress: Progress) -> dict:
    debs_pins = parse_debs_lock(DEBS_LOCK.read_text())
    wheel_pins = parse_wheels_lock(WHEELS_LOCK.read_text())
    final_folder = base / key
    final = final_folder / "root"
    started = time.monotonic()
    downloaded = 0
    progress(f"building {key} in {final_folder}")
    resolved, fallbacks, got = _fetch_debs(debs_pins, base, progress)
    downloaded += got
    with _step(progress, "download and check the wheels and the sdist") as info:
        got = _download_wheels(wheel_pins, base / "wheels")
        sdist, got_sdist = _download_sdist(HDRH, base / "sdist")
        downloaded += got + got_sdist
        info["detail"] = f"{len(wheel_pins)} wheels + {HDRH.name} sdist, {_mib(got + got_sdist)}"
    part_folder = Path(tempfile.mkdtemp(prefix=f".part-{key}-", dir=base))
    part_folder.chmod(0o755)  # mkdtemp makes it 0700: the root is read by other users too
    try:
        root = part_folder / "root"
        root_pins = [p for p in resolved if p.role == "root"]
        with _step(progress, "unpack the root") as info:
            files = _unpack_debs(root_pins, base / "debs", root)
            info["detail"] = f"{len(root_pins)} packages, {files} files"
        site = root / SITE
        with _step(progress, "pip install --target (aarch64 wheels)"):
            _install_wheels(base / "wheels", site)
        cross = [p for p in resolved if p.role == "cross"]
        with (
            _step(progress, f"cross-compile {HDRH.module} ({HDRH.requirement})"),
            tempfile.TemporaryDirectory(prefix="xgcc.", dir=base) as work,
        ):
            _build_hdrh(cross, base / "debs", sdist, Path(work), site)
        _write_pyvenv(root, root)
        _write_programs(root, qemu)
        _write_pth(root, src)
        with _step(progress, "byte-compile stdlib and site-packages") as info:
            info["detail"] = _compile(root, final, paths(root)["python"])
        with _step(progress, f"midr_el1 for {cpu}"):
            _write_midr(part_folder, root, qemu, cpu)
        with _step(progress, "smoke import (emulated)") as info:
            seen = _smoke(root, qemu, cpu)
            info["detail"] = ", ".join(
                f"{k} {seen[k]}" for k in ("numpy", "onnxruntime", "openvino")
            )
        _write_pyvenv(root, final)
        build = {
            "key": key,
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1),
            "downloaded_bytes": downloaded,
            "root_bytes": _tree_size(root),
            "versions": {k: v for k, v in seen.items() if k not in ("executable", "machine")},
            "fallbacks": fallbacks,
            "debs": [asdict(p) for p in resolved],
        }
        (part_folder / "build.json").write_text(json.dumps(build, indent=2) + "\n")
        _replace(part_folder, final_folder)
    except BaseException:
        shutil.rmtree(part_folder, ignore_errors=True)
        raise
    return build


def _replace(new: Path, dest: Path) -> None:
    """Rename `new` to `dest`; an older `dest` is moved aside first and then removed."""
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{dest.name}-", dir=dest.parent))
        dest.rename(old / dest.name)
        new.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(dest)


def _prune(base: Path, key: str, progress: Progress) -> None:
    """Keep the KEEP newest complete roots, and only the current locks' downloads."""
    builds = []
    for folder in base.iterdir():
        if folder.name.startswith((".part-", ".old-", "xgcc.")) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)  # left by a build that was killed
        elif re.fullmatch(r"[0-9a-f]{16}", folder.name) and folder.name != key:
            stamp = folder / "build.json"
            builds.append((stamp.stat().st_mtime if stamp.exists() else 0.0, folder))
    for _mtime, folder in sorted(builds, reverse=True)[KEEP - 1 :]:
        progress(f"removing the old root {folder.name}")
        shutil.rmtree(folder, ignore_errors=True)
    debs = {p.filename for p in parse_debs_lock(DEBS_LOCK.read_text())}
    try:
        build = json.loads((base / key / "build.json").read_text())
        debs |= {DebPin(**d).filename for d in build.get("debs", [])}
    except (OSError, ValueError, TypeError):
        pass
    for path in (base / "debs").glob("*.deb"):
        if path.name not in debs:
            path.unlink()
    shas = {p.sha256 for p in parse_wheels_lock(WHEELS_LOCK.read_text())}
    for sha, path in _wheel_shas(base / "wheels").items():
        if sha not in shas:
            path.unlink()
    for path in (base / "sdist").glob("*.tar.gz"):
        if path.name != f"{HDRH.name}-{HDRH.version}.tar.gz":
            path.unlink()


def ensure(
    progress: Progress = log, *, rebuild: bool = False, cpu: str | None = None, src: Path = REPO
) -> Path:
    """The root, built first when no complete one matches the locks (or `rebuild`). Its
    wrappers, site-packages/edged-src.pth (naming `src`) and midr_el1 files (for `cpu`, by
    default EDGED_ARM64_CPU or DEFAULT_CPU) are rewritten when they differ.
    Raises FetchError (what and why) when it cannot be had."""
    if platform.machine() != "x86_64":
        raise FetchError(
            f"the aarch64 root runs under amd64 qemu-user; this is {platform.machine()}"
        )
    key = cache_key(DEBS_LOCK.read_bytes(), WHEELS_LOCK.read_bytes())
    cpu = _chosen_cpu(cpu)
    base = cache_root()
    qemu = _qemu()
    with _locked(base):
        folder = base / key
        build = None if rebuild else _stamp(folder, key)
        if build is None:
            # built and smoke-tested on DEFAULT_CPU, whatever the caller runs it on later
            build = _build(key, base, qemu, DEFAULT_CPU, src, progress)
            progress(
                f"built in {build['seconds']} s: downloaded {_mib(build['downloaded_bytes'])}, "
                f"root {_mib(build['root_bytes'])}"
            )
            _prune(base, key, progress)
        else:
            _fallback_warnings(build, progress)
        root = folder / "root"
        changed = []
        if _write_programs(root, qemu):
            changed.append("wrappers")
        if _write_pth(root, src):
            changed.append(f"{PTH} -> {src}")
        if _write_midr(folder, root, qemu, cpu):
            changed.append(f"midr_el1 for {cpu}")
        if changed:
            progress(f"updated {', '.join(changed)}")
    return root


# --- refreshing the locks ------------------------------------------------------------------------


def _closure(env: dict[str, str]) -> list[tuple[str, str, str]]:
    """(package, arch, version) of ROOT_PACKAGES and everything they depend on."""
    proc = _run(
        ["apt-get", "-s", "-o", "APT::Install-Recommends=false", "install", *ROOT_PACKAGES],
        "apt-get -s install (the root's closure)",
        env=env,
    )
    found = []
    for line in proc.stdout.splitlines():
        match = re.match(r"Inst (\S+) \((\S+) .*\[(\S+)\]\)", line)
        if match:
            name, version, arch = match.groups()
            found.append((name.split(":", 1)[0], arch, version))
    if not found:
        raise FetchError(f"apt-get -s install printed no packages: {proc.stdout[-300:]!r}")
    return found


def _debs_lock_text(env: dict[str, str]) -> str:
    wanted = [("root", *entry) for entry in _closure(env)]
    specs = [package if arch == "all" else f"{package}:{arch}" for package, arch in CROSS_PACKAGES]
    candidates = {(r["Package"], r["Architecture"]): r for r in _index_records(specs, env)}
    for (package, arch), spec in zip(CROSS_PACKAGES, specs, strict=True):
        record = candidates.get((package, arch))
        if record is None:
            raise FetchError(f"{spec} is not in Debian {SUITE}'s package index")
        wanted.append(("cross", package, arch, record["Version"]))
    specs = [(p if a == "all" else f"{p}:{a}") + f"={v}" for _r, p, a, v in wanted]
    index = {
        (r["Package"], r["Architecture"], r["Version"]): r["SHA256"]
        for r in _index_records(specs, env)
    }
    lines = [
        f"# Debian {SUITE} packages of the aarch64 lane's root ('root', arm64/all, unpacked into",
        "# it) and of the cross compiler that builds hdrhistogram's C module ('cross').",
        "# Written by: python scripts/arm64_root.py --update-locks (see its docstring).",
        "# role  package  arch  version  sha256",
    ]
    for role, package, arch, version in wanted:
        sha = index.get((package, arch, version))
        if sha is None:
            raise FetchError(f"no sha256 for {package}:{arch} {version} in the index")
        lines.append(f"{role} {package} {arch} {version} {sha}")
    return "\n".join(lines) + "\n"


def _wheels_lock_text(work: Path) -> str:
    import importlib.metadata

    skip = {"edged", "pip", "setuptools", "wheel"}
    constraints = sorted(
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"] and dist.metadata["Name"].lower() not in skip
    )
    (work / "constraints.txt").write_text("\n".join(constraints) + "\n")
    _run(
        _pip(
            "download",
            *PLATFORM_ARGS,
            "-c",
            str(work / "constraints.txt"),
            "-d",
            str(work / "wheels"),
            *WHEEL_REQUIREMENTS,
        ),
        "pip download (cp311 aarch64) of WHEEL_REQUIREMENTS",
    )
    lines = [
        "# cp311 manylinux aarch64 wheels of the aarch64 lane's root, in pip's --require-hashes",
        "# format: WHEEL_REQUIREMENTS and their dependencies at the x86 venv's versions.",
        "# Written by: python scripts/arm64_root.py --update-locks (see its docstring).",
    ]
    entries = []
    for wheel in sorted((work / "wheels").glob("*")):
        if wheel.suffix != ".whl":
            raise FetchError(f"pip download fetched {wheel.name}, not a wheel")
        name, version = wheel.name.split("-")[:2]
        name = re.sub(r"[-_.]+", "-", name).lower()
        entries.append(f"{name}=={version} --hash=sha256:{sha256_file(wheel)}")
    return "\n".join(lines + sorted(entries)) + "\n"


def update_locks(progress: Progress = log) -> None:
    base = cache_root()
    with _locked(base):
        env = _apt_state(base / "apt-state")
        _apt_update(env, progress)
        with _step(progress, f"resolve {DEBS_LOCK.name}"):
            debs = _debs_lock_text(env)
            parse_debs_lock(debs)
        with (
            tempfile.TemporaryDirectory(prefix="lock.", dir=base) as work,
            _step(progress, f"resolve {WHEELS_LOCK.name}"),
        ):
            wheels = _wheels_lock_text(Path(work))
            parse_wheels_lock(wheels)
    for path, text in ((DEBS_LOCK, debs), (WHEELS_LOCK, wheels)):
        progress(f"{path.name}: {'rewritten' if _write_if_changed(path, text) else 'unchanged'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print-path", action="store_true", help="print the root's path")
    parser.add_argument("--json", action="store_true", help="print paths and versions as JSON")
    parser.add_argument("--rebuild", action="store_true", help="build even when cached")
    parser.add_argument(
        "--update-locks", action="store_true", help="re-resolve and rewrite both lock files"
    )
    args = parser.parse_args(argv)
    if args.update_locks and (args.print_path or args.json or args.rebuild):
        parser.error("--update-locks takes no other option")
    start = time.monotonic()
    try:
        if args.update_locks:
            update_locks()
            return 0
        root = ensure(rebuild=args.rebuild)
        build = json.loads((root.parent / "build.json").read_text())
    except (FetchError, OSError) as exc:
        log(f"error: {exc}")
        return 1
    log(f"ready in {time.monotonic() - start:.1f} s: {root}")
    if args.print_path:
        print(root)
    if args.json:
        out = {k: str(v) for k, v in paths(root).items()}
        out.update(
            key=build["key"],
            cpu=_chosen_cpu(None),
            qemu=os.environ.get("EDGED_ARM64_QEMU") or str(qemu_binary("aarch64")),
            versions=build.get("versions", {}),
            fallbacks=build.get("fallbacks", []),
            downloaded_bytes=build.get("downloaded_bytes"),
            root_bytes=build.get("root_bytes"),
        )
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
