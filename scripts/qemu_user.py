#!/usr/bin/env python3
"""Fetch QEMU's user-mode emulators (qemu-x86_64, qemu-aarch64) for the isa lanes.

`make test-isa-avx2` runs the tests marked `isa` a second time under
`qemu-x86_64 -cpu Haswell,-hle,-rtm` (AVX2 and FMA, no AVX-512, no VNNI), so the INT8 paths of
AVX2-only x86 CPUs are checked whatever CPU the tests land on. Under emulation CPUID shows the
emulated CPU while /proc/cpuinfo still shows the host's flags.

The binaries are the static-pie builds of Debian trixie's `qemu-user` package (amd64), pinned
to 1:10.0.13+ds-0+deb13u1 and its sha256 (bookworm's qemu-user-static 7.2 is too old: it
crashes on onnxruntime's aarch64 module). The .deb is fetched with apt-get under a private apt
state folder in the cache, so the host's apt configuration, dpkg architectures and /etc/apt are
left alone; the archive is the one this machine's own apt sources name. Nothing is installed:
the two binaries are unpacked from the .deb (dpkg-deb when present, else a pure-Python
ar/tar reader) and the .deb is deleted.

When a Debian point release has replaced the pinned version in the archive, the current trixie
candidate is taken instead (apt checks it against the signed Release file): a warning names
its version and sha256, and the pin here should be moved to it.

Cache: $EDGED_TEST_DATA/qemu-user/<version>/ (default ~/.cache/edged/test-data), with a stamp;
a warm run only reads the stamp.

Usage: qemu_user.py [--print-path x86_64|aarch64]  (prints that binary's path on stdout)
Exit codes: 0 ok, 1 the fetch failed (the message names what and why), 2 bad arguments.
Progress and warnings go to stderr, as `qemu-user: ...` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from scripts.fetch_test_data import (
    FetchError,
    _apt_env,
    _deb_data_tar,
    cache_dir,
    check_sha,
)


@dataclass(frozen=True)
class QemuDeb:
    package: str
    version: str
    arch: str
    suite: str
    sha256: str


QEMU_DEB = QemuDeb(
    package="qemu-user",
    version="1:10.0.13+ds-0+deb13u1",  # pool/main/q/qemu/qemu-user_10.0.13+ds-0+deb13u1_amd64.deb
    arch="amd64",
    suite="trixie",
    sha256="ca6ede739327a20ae5a3498230c8a3a9a072c586e131bc6bcc1201eb1725e336",
)
ARCHES = ("x86_64", "aarch64")
# The isa-avx2 lane's CPU (the Makefile's ISA_AVX2_CPU): Haswell without TSX, which TCG cannot
# emulate (plain Haswell warns "TCG doesn't support requested feature: CPUID.07H:EBX.hle/rtm").
AVX2_CPU = "Haswell,-hle,-rtm"
MEMBER = "./usr/bin/qemu-{}"
APT_TIMEOUT_S = 900  # a stuck mirror fails the fetch instead of the CI run's whole budget


def log(msg: str) -> None:
    print(f"qemu-user: {msg}", file=sys.stderr, flush=True)


def qemu_root() -> Path:
    return cache_dir() / "qemu-user"


def _version_dir(version: str) -> Path:
    """The version without its epoch, as Debian names .deb files (no ':' in the path)."""
    return qemu_root() / version.split(":", 1)[-1]


def _ready() -> Path | None:
    """The unpacked folder when the stamp says it is complete for the current pin, else None."""
    try:
        resolved = json.loads((qemu_root() / "resolved.json").read_text())
        folder = _version_dir(resolved["version"])
        stamp = (folder / ".complete").read_text().strip()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if resolved.get("pinned") != QEMU_DEB.version or stamp != resolved.get("sha256"):
        return None
    if not all(os.access(folder / f"qemu-{arch}", os.X_OK) for arch in ARCHES):
        return None
    if resolved["version"] != QEMU_DEB.version:
        log(
            f"using {QEMU_DEB.package} {resolved['version']}, not the pinned {QEMU_DEB.version} "
            "(no longer in the archive): move QEMU_DEB in scripts/qemu_user.py to it"
        )
    return folder


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None = None):
    try:
        return subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise FetchError(f"{' '.join(cmd)}: no answer in {APT_TIMEOUT_S} s") from exc


def _record(spec: str, env: dict[str, str]) -> dict[str, str] | None:
    """The package index's fields for `spec` (pkg:arch or pkg:arch=version), None if absent."""
    proc = _run(["apt-cache", "show", "--no-all-versions", spec], env)
    if proc.returncode != 0:
        return None
    fields: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if line == "":
            break
        key, sep, value = line.partition(": ")
        if sep and not line[0].isspace():
            fields[key] = value.strip()
    return fields if "Version" in fields and "SHA256" in fields else None


def _download(deb: QemuDeb, debs: Path) -> tuple[Path, str, str]:
    """Download the pinned .deb, or the suite's current candidate when the pin is gone.
    Returns (path, version, sha256), the .deb's sha256 checked."""
    if shutil.which("apt-get") is None:
        raise FetchError(f"apt-get not found: {deb.package} comes from Debian {deb.suite}")
    pkg = f"{deb.package}:{deb.arch}"
    try:
        env = _apt_env(qemu_root() / "apt-state", (deb.arch,), deb.suite)
    except FetchError as exc:
        raise FetchError(f"{pkg} {deb.version}: {exc}") from exc
    log(f"apt-get update (private state, {deb.arch} {deb.suite})")
    proc = _run(["apt-get", "-q", "update"], env)
    if proc.returncode != 0:
        raise FetchError(f"apt-get update ({deb.suite}) failed: {proc.stderr.strip()[-400:]}")
    version, sha = deb.version, deb.sha256
    record = _record(f"{pkg}={deb.version}", env)
    if record is None:
        record = _record(pkg, env)
        if record is None:
            raise FetchError(f"{pkg} is not in Debian {deb.suite}'s package index")
        version, sha = record["Version"], record["SHA256"]
        log(
            f"WARNING: pinned {pkg} {deb.version} is no longer in Debian {deb.suite}; "
            f"taking the current candidate {version} (sha256 {sha}, checked by apt against "
            "the signed Release file). Move QEMU_DEB in scripts/qemu_user.py to it."
        )
    elif record["SHA256"] != sha:
        raise FetchError(
            f"{pkg} {version}: the archive's sha256 {record['SHA256']} does not "
            f"match the pinned {sha}"
        )
    size = int(record.get("Size", "0")) >> 20
    log(f"apt-get download {pkg}={version} ({size} MiB)")
    proc = _run(["apt-get", "-q", "download", f"{pkg}={version}"], env, cwd=debs)
    found = sorted(debs.glob(f"{deb.package}_*_{deb.arch}.deb"))
    if proc.returncode != 0 or len(found) != 1:
        raise FetchError(
            f"apt-get download {pkg}={version} failed: "
            f"{proc.stderr.strip()[-400:] or [p.name for p in found]}"
        )
    check_sha(found[0], sha)
    return found[0], version, sha


@contextlib.contextmanager
def _data_tar(deb: Path) -> Iterator[tarfile.TarFile]:
    """The .deb's data tar: streamed from dpkg-deb when present, else read in Python."""
    if shutil.which("dpkg-deb") is None:
        with _deb_data_tar(deb) as tar:
            yield tar
        return
    proc = subprocess.Popen(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    done = False
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            yield tar
        while proc.stdout.read(1 << 16):  # the tar's padding, so dpkg-deb ends without SIGPIPE
            pass
        done = True
    finally:
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        rc = proc.wait()
    if done and rc != 0:
        raise FetchError(f"dpkg-deb --fsys-tarfile {deb.name} failed: {err.strip()[-400:]}")


def _unpack(deb: Path, dest: Path) -> None:
    """Write the emulators of `deb` into `dest` (made anew)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    wanted = {MEMBER.format(arch): dest / f"qemu-{arch}" for arch in ARCHES}
    with _data_tar(deb) as tar:
        for info in tar:
            out = wanted.get(info.name)
            if out is None:
                continue
            extracted = tar.extractfile(info) if info.isfile() else None
            if extracted is None:
                raise FetchError(f"{deb.name}: {info.name} is not a regular file")
            with out.open("wb") as f:
                shutil.copyfileobj(extracted, f)
            out.chmod(0o755)
    missing = [name for name, out in wanted.items() if not out.exists()]
    if missing:
        raise FetchError(f"{deb.name}: no {', '.join(missing)} in the package")


def _fetch() -> Path:
    deb, root = QEMU_DEB, qemu_root()
    with tempfile.TemporaryDirectory(prefix="debs.", dir=root) as tmp:
        path, version, sha = _download(deb, Path(tmp))
        folder = _version_dir(version)
        part = folder.with_name(folder.name + ".part")
        log(f"unpacking {', '.join(f'qemu-{a}' for a in ARCHES)} from {path.name}")
        _unpack(path, part)
    probe = subprocess.run([str(part / "qemu-x86_64"), "--version"], capture_output=True, text=True)
    upstream = version.split(":", 1)[-1].split("+", 1)[0]
    if probe.returncode != 0 or upstream not in probe.stdout:
        raise FetchError(
            f"{part}/qemu-x86_64 --version: {(probe.stdout + probe.stderr)[:200]!r}"
            f" (expected version {upstream})"
        )
    (part / ".complete").write_text(sha + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    part.rename(folder)
    resolved = {"pinned": deb.version, "version": version, "sha256": sha}
    tmp_json = root / "resolved.json.part"
    tmp_json.write_text(json.dumps(resolved, indent=2) + "\n")
    tmp_json.replace(root / "resolved.json")
    log(f"{deb.package} {version} (sha256 {sha}) ready in {folder}")
    return folder


def qemu_dir() -> Path:
    """The folder holding qemu-x86_64 and qemu-aarch64, fetched first when needed.
    Raises FetchError (what and why) when they cannot be had."""
    folder = _ready()
    if folder is not None:
        return folder
    if platform.machine() != "x86_64":
        raise FetchError(
            f"the pinned {QEMU_DEB.package} is the amd64 build; this host is {platform.machine()}"
        )
    root = qemu_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second make waits, then finds the stamp
        folder = _ready()
        if folder is not None:
            return folder
        try:
            return _fetch()
        except OSError as exc:
            raise FetchError(f"{QEMU_DEB.package}: {exc}") from exc


def qemu_binary(arch: str) -> Path:
    """The path of qemu-`arch` (x86_64 or aarch64), fetched first when needed."""
    if arch not in ARCHES:
        raise ValueError(f"no qemu-user emulator for {arch!r} here (have: {', '.join(ARCHES)})")
    return qemu_dir() / f"qemu-{arch}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--print-path",
        choices=ARCHES,
        metavar="|".join(ARCHES),
        help="print the path of that emulator on stdout",
    )
    args = parser.parse_args(argv)
    try:
        folder = qemu_dir()
    except FetchError as exc:
        log(f"error: {exc}")
        return 1
    if args.print_path:
        print(folder / f"qemu-{args.print_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
