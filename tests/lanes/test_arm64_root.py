"""scripts/arm64_root.py without the network: the lock files, the cache key, refusing a sha256
that does not match, the build folder renamed only when complete, unpacking .debs safely, the
host-side wrappers and the emulated CPU's midr_el1 files. (Building a real root is the aarch64
lane's job: `make arm64-root`.)"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from scripts import arm64_root as ar
from scripts.fetch_test_data import FetchError

SHA_A = "a" * 64
SHA_B = "b" * 64
A76_CPUINFO = """processor\t: 0
model name\t: ARMv8 Processor rev 1 (v8l)
Features\t: fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x4
CPU part\t: 0xd0b
CPU revision\t: 1

processor\t: 1
CPU implementer\t: 0x41
"""


# --- the lock files ------------------------------------------------------------------------------


def test_committed_debs_lock_pins_the_root_and_the_cross_compiler() -> None:
    pins = ar.parse_debs_lock(ar.DEBS_LOCK.read_text())
    root = {p.package: p for p in pins if p.role == "root"}
    cross = {p.package for p in pins if p.role == "cross"}
    assert set(ar.ROOT_PACKAGES) <= root.keys()
    assert {"libc6", "libpython3.11-stdlib", "libssl3"} <= root.keys()
    assert all(p.arch in ("arm64", "all") for p in root.values())
    assert root["python3.11"].version.startswith("3.11.")
    assert {package for package, _arch in ar.CROSS_PACKAGES} == cross
    # The headers the C module is built against are those of the root's own python.
    headers = next(p for p in pins if p.package == "libpython3.11-dev")
    assert headers.version == root["python3.11"].version


def test_committed_wheels_lock_has_every_requirement_for_aarch64() -> None:
    pins = {p.name: p for p in ar.parse_wheels_lock(ar.WHEELS_LOCK.read_text())}
    assert set(ar.WHEEL_REQUIREMENTS) <= pins.keys()
    # Only with every manylinux tag up to 2_36 does pip find the current aarch64 releases.
    assert int(pins["openvino"].version.split(".")[0]) >= 2026
    assert int(pins["ai-edge-litert"].version.split(".")[0]) >= 2
    assert "hdrhistogram" not in pins  # no aarch64 wheel: cross-compiled from HDRH's sdist
    assert "--platform=manylinux_2_36_aarch64" in ar.PLATFORM_ARGS
    assert "--platform=manylinux_2_17_aarch64" in ar.PLATFORM_ARGS


def test_debs_lock_lines() -> None:
    text = f"""# comment
root python3.11 arm64 3.11.2-6+deb12u9 {SHA_A}  # trailing comment

cross zlib1g amd64 1:1.2.13.dfsg-1+deb12u1 {SHA_B}
root ca-certificates all 20250419~deb12u2 {SHA_A}
"""
    python, zlib, certs = ar.parse_debs_lock(text)
    assert python == ar.DebPin("root", "python3.11", "arm64", "3.11.2-6+deb12u9", SHA_A)
    assert python.name == "python3.11:arm64"
    assert zlib.filename == "zlib1g_1%3a1.2.13.dfsg-1+deb12u1_amd64.deb"  # as apt names it
    assert certs.name == "ca-certificates"  # arch all: no qualifier


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (f"root python3.11 arm64 {SHA_A}", "expected 'role package arch version sha256'"),
        (f"host python3.11 arm64 1 {SHA_A}", "role 'host'"),
        (f"root python3.11 armhf 1 {SHA_A}", "architecture 'armhf'"),
        ("root python3.11 arm64 1 " + "A" * 64, "is not a sha256"),
        ("root python3.11 arm64 1 abc", "is not a sha256"),
        (f"root libc6 arm64 1 {SHA_B}", "libc6:arm64 is pinned twice"),
    ],
)
def test_debs_lock_errors_name_the_line(line: str, says: str) -> None:
    text = f"root libc6 arm64 2.36 {SHA_A}\n{line}\n"
    with pytest.raises(ar.LockError, match=r"x\.lock:2: ") as err:
        ar.parse_debs_lock(text, "x.lock")
    assert says in str(err.value)


def test_debs_lock_needs_a_root_package() -> None:
    with pytest.raises(ar.LockError, match="no 'root' package"):
        ar.parse_debs_lock(f"cross zlib1g amd64 1 {SHA_A}\n")


def test_wheels_lock_lines() -> None:
    text = (
        f"# header\nNumPy==2.4.6 --hash=sha256:{SHA_A}\nruamel.yaml==0.19.1 --hash=sha256:{SHA_B}\n"
    )
    assert ar.parse_wheels_lock(text) == [
        ar.WheelPin("numpy", "2.4.6", SHA_A),
        ar.WheelPin("ruamel-yaml", "0.19.1", SHA_B),
    ]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("numpy>=2 --hash=sha256:" + SHA_A, "expected 'name==version --hash=sha256:HEX'"),
        ("numpy==2.4.6", "expected"),
        ("numpy==2.4.6 --hash=md5:abc", "expected"),
        ("numpy==2.4.6 --hash=sha256:xyz", "is not a sha256"),
        (f"onnx==1.0 --hash=sha256:{SHA_B}", "onnx is pinned twice"),
    ],
)
def test_wheels_lock_errors_name_the_line(line: str, says: str) -> None:
    with pytest.raises(ar.LockError, match=r"w\.lock:2: ") as err:
        ar.parse_wheels_lock(f"onnx==1.23.2 --hash=sha256:{SHA_A}\n{line}\n", "w.lock")
    assert says in str(err.value)


# --- the cache key -------------------------------------------------------------------------------


def test_cache_key_follows_both_locks_and_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    debs = ar.DEBS_LOCK.read_bytes()
    wheels = ar.WHEELS_LOCK.read_bytes()
    key = ar.cache_key(debs, wheels)
    assert len(key) == 16 and int(key, 16) >= 0
    assert ar.cache_key(debs, wheels) == key
    assert ar.cache_key(debs.replace(b"deb12u9", b"deb12u10", 1), wheels) != key
    assert ar.cache_key(debs, wheels + b"tqdm==1 --hash=sha256:" + SHA_A.encode()) != key
    assert ar.cache_key(wheels, debs) != key  # which file says what matters
    monkeypatch.setattr(ar, "LAYOUT", ar.LAYOUT + 1)
    assert ar.cache_key(debs, wheels) != key


# --- refusing what does not match ----------------------------------------------------------------


def _pin(sha: str = SHA_A, version: str = "1.0-1") -> ar.DebPin:
    return ar.DebPin("root", "libfoo", "arm64", version, sha)


def test_a_cached_deb_with_other_contents_is_removed(tmp_path: Path) -> None:
    deb = tmp_path / "x.deb"
    deb.write_bytes(b"good")
    good = hashlib.sha256(b"good").hexdigest()
    assert ar._cached(deb, good)
    assert not ar._cached(deb, SHA_A) and not deb.exists()
    assert not ar._cached(deb, good)  # gone: downloaded again


def test_a_downloaded_deb_with_the_wrong_sha256_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pin = _pin()

    def fake_apt_get(cmd, what, **kwargs):  # apt-get download, writing other bytes
        assert cmd[:3] == ["apt-get", "-q", "download"] and cmd[3] == "libfoo:arm64=1.0-1"
        (kwargs["cwd"] / pin.filename).write_bytes(b"not the pinned package")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ar, "_run", fake_apt_get)
    with pytest.raises(FetchError, match=f"libfoo_1.0-1_arm64.deb: sha256 .* the pinned {SHA_A}"):
        ar._download_debs([pin], {}, tmp_path)


def test_a_pinned_version_whose_index_sha256_changed_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = {"Package": "libfoo", "Architecture": "arm64", "Version": "1.0-1", "SHA256": SHA_B}
    monkeypatch.setattr(ar, "_index_records", lambda specs, env: [record] if specs else [])
    with pytest.raises(FetchError, match=f"archive's sha256 {SHA_B} does not match"):
        ar._resolve([_pin()], {}, print)


def test_a_pin_gone_from_the_archive_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    current = {"Package": "libfoo", "Architecture": "arm64", "Version": "1.0-2", "SHA256": SHA_B}

    def index(specs, env):
        specs = list(specs)
        return [current] if specs == ["libfoo:arm64"] else []  # the pinned 1.0-1 is gone

    monkeypatch.setattr(ar, "_index_records", index)
    said: list[str] = []
    (now,) = ar._resolve([_pin()], {}, said.append)
    assert now == ar.DebPin("root", "libfoo", "arm64", "1.0-2", SHA_B)
    (warning,) = said
    assert warning.startswith("WARNING: pinned libfoo:arm64 1.0-1 is no longer in Debian")
    assert f"1.0-2 (sha256 {SHA_B}" in warning and "--update-locks" in warning


def test_a_package_gone_for_good_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ar, "_index_records", lambda specs, env: [])
    with pytest.raises(FetchError, match="libfoo:arm64 is not in Debian bookworm"):
        ar._resolve([_pin()], {}, print)


# --- unpacking -----------------------------------------------------------------------------------


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> tarfile.TarFile:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return tarfile.open(fileobj=buf, mode="r")


def _member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = ""):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.mtime = kind, mode, link, 1_700_000_000
    return info


def test_unpack_places_files_links_and_modes(tmp_path: Path) -> None:
    tar = _tar(
        (_member("./", tarfile.DIRTYPE, 0o755), None),
        (_member("./usr/bin/", tarfile.DIRTYPE, 0o555), None),
        (_member("./usr/bin/python3.11", mode=0o4755), b"ELF"),
        (_member("./usr/bin/python3", tarfile.SYMTYPE, link="python3.11"), None),
        (_member("./usr/bin/py-hard", tarfile.LNKTYPE, link="./usr/bin/python3.11"), None),
        (_member("./lib/ld.so", tarfile.SYMTYPE, link="/lib/aarch64-linux-gnu/ld.so"), None),
    )
    assert ar.unpack(tar, tmp_path, "t.deb") == 2
    python = tmp_path / "usr/bin/python3.11"
    assert python.read_bytes() == b"ELF"
    assert python.stat().st_mode & 0o7777 == 0o755  # no setuid
    assert python.stat().st_mtime == 1_700_000_000
    assert os.readlink(tmp_path / "usr/bin/python3") == "python3.11"
    assert (tmp_path / "usr/bin/py-hard").stat().st_ino == python.stat().st_ino
    # An absolute link is data (qemu -L resolves it in the root), not followed here.
    assert os.readlink(tmp_path / "lib/ld.so") == "/lib/aarch64-linux-gnu/ld.so"
    assert (tmp_path / "usr/bin").stat().st_mode & 0o700 == 0o700  # removable later


@pytest.mark.parametrize("name", ["../evil", "./usr/../../evil", "/etc/evil"])
def test_unpack_refuses_a_path_out_of_the_tree(tmp_path: Path, name: str) -> None:
    dest = tmp_path / "root"
    dest.mkdir()
    with pytest.raises(FetchError, match="outside the tree"):
        ar.unpack(_tar((_member(name), b"x")), dest, "t.deb")
    assert not (tmp_path / "evil").exists()


def test_unpack_does_not_write_through_a_link_out_of_the_tree(tmp_path: Path) -> None:
    dest, outside = tmp_path / "root", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    tar = _tar(
        (_member("./etc/alt", tarfile.SYMTYPE, link=str(outside)), None),
        (_member("./etc/alt/file"), b"x"),
    )
    with pytest.raises(FetchError, match="would be written outside"):
        ar.unpack(tar, dest, "t.deb")
    assert list(outside.iterdir()) == []


def test_a_file_replaces_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep")
    dest = tmp_path / "root"
    dest.mkdir()
    (dest / "f").symlink_to(target)
    ar.unpack(_tar((_member("./f"), b"new")), dest, "t.deb")
    assert target.read_text() == "keep" and (dest / "f").read_text() == "new"


# --- wrappers and midr_el1 -----------------------------------------------------------------------


def _fake(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_python_wrapper_runs_the_root_python_under_qemu_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    qemu = _fake(tmp_path / "qemu-aarch64", 'for a in "$@"; do echo "$a"; done\n')
    root = Path(os.path.realpath(tmp_path)) / "cache" / "root"  # the wrapper resolves links
    ar._write_programs(root, qemu)
    python = ar.paths(root)["python"]
    monkeypatch.delenv("EDGED_ARM64_CPU", raising=False)
    monkeypatch.delenv("EDGED_ARM64_QEMU", raising=False)
    out = subprocess.run([python, "-c", "pass"], capture_output=True, text=True, check=True)
    expected = ["-L", str(root), "-cpu", ar.DEFAULT_CPU, "-0", str(python)]
    assert out.stdout.splitlines() == [*expected, f"{root}/usr/bin/python3.11", "-c", "pass"]
    # Through its aliases too, and with the CPU and the emulator from the environment.
    other = _fake(tmp_path / "other-qemu", 'echo other "$@"\n')
    env = {**os.environ, "EDGED_ARM64_CPU": "cortex-a53", "EDGED_ARM64_QEMU": str(other)}
    alias = python.with_name("python3.11")
    out = subprocess.run([alias, "x"], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == [
        "other",
        "-L",
        str(root),
        "-cpu",
        "cortex-a53",
        "-0",
        str(python),
        f"{root}/usr/bin/python3.11",
        "x",
    ]
    assert not ar._write_programs(root, qemu)  # unchanged: nothing written
    assert ar._write_programs(root, other)  # another emulator path: rewritten


def test_edgectl_wrapper_calls_main_like_a_console_script(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ar._write_programs(root, tmp_path / "qemu")
    bin_dir = ar.paths(root)["python"].parent
    _fake(bin_dir / "python3", 'for a in "$@"; do echo "$a"; done\n')  # stands in for qemu
    out = subprocess.run(
        [ar.paths(root)["edgectl"], "status", "--json"], capture_output=True, text=True, check=True
    )
    flag, dash_c, code, *args = out.stdout.splitlines()
    assert (flag, dash_c, args) == ("-P", "-c", ["status", "--json"])
    assert "from edged.cli.main import main" in code and 'sys.argv[0] = "edgectl"' in code


def test_the_pth_names_the_checkout(tmp_path: Path) -> None:
    assert ar._write_pth(tmp_path, Path("/work/tree"))
    assert (tmp_path / ar.SITE / ar.PTH).read_text() == "/work/tree\n"
    assert not ar._write_pth(tmp_path, Path("/work/tree"))


def test_midr_from_the_emulated_cpuinfo() -> None:
    assert ar.midr_from_cpuinfo(A76_CPUINFO) == "0x00000000414fd0b1"
    a53 = "CPU implementer\t: 0x41\nCPU variant\t: 0x0\nCPU part\t: 0xd03\nCPU revision\t: 4\n"
    assert ar.midr_from_cpuinfo(a53) == "0x00000000410fd034"
    with pytest.raises(FetchError, match="no CPU id"):
        ar.midr_from_cpuinfo("processor\t: 0\n")


def test_midr_files_follow_the_cpu_and_the_hosts_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def emulated(root, qemu, cpu):
        asked.append(cpu)
        return {"cortex-a76": "0x00000000414fd0b1", "cortex-a53": "0x00000000410fd034"}[cpu]

    monkeypatch.setattr(ar, "_emulated_midr", emulated)
    monkeypatch.setattr(ar, "host_cpus", lambda: ["cpu0", "cpu1", "cpu2"])
    root = tmp_path / "root"
    (root / ar.CPU_DIR / "cpu7").mkdir(parents=True)  # from a bigger machine: not listed here

    def midr(n: int) -> str:
        return (root / ar.CPU_DIR / f"cpu{n}/regs/identification/midr_el1").read_text()

    assert ar._write_midr(tmp_path, root, Path("qemu"), "cortex-a76")
    assert sorted(p.name for p in (root / ar.CPU_DIR).iterdir()) == ["cpu0", "cpu1", "cpu2"]
    assert midr(2) == "0x00000000414fd0b1\n"
    assert not ar._write_midr(tmp_path, root, Path("qemu"), "cortex-a76")
    assert ar._write_midr(tmp_path, root, Path("qemu"), "cortex-a53")
    assert midr(0) == "0x00000000410fd034\n"
    assert ar._write_midr(tmp_path, root, Path("qemu"), "cortex-a76")
    assert asked == ["cortex-a76", "cortex-a53"]  # each model's value asked for once
    assert json.loads((tmp_path / "midr.json").read_text())["written"]["cpu"] == "cortex-a76"


# --- the build folder ----------------------------------------------------------------------------


@pytest.fixture
def offline_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """ensure() with every download and emulated step replaced: what ran, by name."""
    monkeypatch.setenv("EDGED_TEST_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("EDGED_ARM64_QEMU", raising=False)
    monkeypatch.delenv("EDGED_ARM64_CPU", raising=False)
    monkeypatch.setattr(ar.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(ar, "qemu_binary", lambda arch: tmp_path / f"qemu-{arch}")
    calls: dict[str, list] = {"built": [], "smoke": []}

    def fetch_debs(pins, base, progress):
        calls["built"].append(base)
        return pins, [], 0

    def unpack_debs(pins, debs, dest):
        calls["unpacked_into"] = [dest]
        _fake(dest / "usr/bin/python3.11", "")
        return 1

    monkeypatch.setattr(ar, "_fetch_debs", fetch_debs)
    monkeypatch.setattr(ar, "_download_wheels", lambda pins, wheels: 0)
    monkeypatch.setattr(ar, "_download_sdist", lambda sdist, folder: (folder / "s.tar.gz", 0))
    monkeypatch.setattr(ar, "_unpack_debs", unpack_debs)
    monkeypatch.setattr(ar, "_install_wheels", lambda wheels, site: site.mkdir(parents=True))
    monkeypatch.setattr(ar, "_build_hdrh", lambda *args: None)
    monkeypatch.setattr(ar, "_compile", lambda root, final, wrapper: "skipped")
    monkeypatch.setattr(ar, "_emulated_midr", lambda root, qemu, cpu: "0x00000000414fd0b1")
    versions = {"numpy": "2", "onnxruntime": "1", "openvino": "2026"}
    monkeypatch.setattr(
        ar, "_smoke", lambda root, qemu, cpu: calls["smoke"].append(root) or versions
    )
    return calls


def test_a_failed_build_leaves_nothing_behind(
    offline_build: dict[str, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    def smoke_fails(root, qemu, cpu):
        raise FetchError("smoke import: boom")

    monkeypatch.setattr(ar, "_smoke", smoke_fails)
    with pytest.raises(FetchError, match="boom"):
        ar.ensure(print)
    base = ar.cache_root()
    key = ar.cache_key(ar.DEBS_LOCK.read_bytes(), ar.WHEELS_LOCK.read_bytes())
    assert not (base / key).exists()
    assert not [p for p in base.iterdir() if p.name.startswith(".part-")]


def test_the_root_is_built_aside_and_renamed_when_complete(
    offline_build: dict[str, list], tmp_path: Path
) -> None:
    said: list[str] = []
    root = ar.ensure(said.append, src=tmp_path / "checkout")
    key = ar.cache_key(ar.DEBS_LOCK.read_bytes(), ar.WHEELS_LOCK.read_bytes())
    assert root == ar.cache_root() / key / "root"
    (built_in,) = offline_build["unpacked_into"]
    assert built_in.parent.name.startswith(f".part-{key}-") and not built_in.exists()
    assert offline_build["smoke"] == [built_in]  # smoke-tested before the rename
    assert json.loads((root.parent / "build.json").read_text())["key"] == key
    cfg = (root / ar.VENV / "pyvenv.cfg").read_text()
    assert f"home = {root}/usr/bin\n" in cfg  # the final path, not the temporary one
    assert (root / ar.SITE / ar.PTH).read_text() == f"{tmp_path / 'checkout'}\n"
    assert os.access(ar.paths(root)["python"], os.X_OK)
    assert any(line.startswith("built in") for line in said)
    # Warm: no build, only the checks; another checkout only rewrites the .pth.
    offline_build["built"].clear()
    said.clear()
    assert ar.ensure(said.append, src=tmp_path / "other") == root
    assert offline_build["built"] == []
    assert said == [f"updated {ar.PTH} -> {tmp_path / 'other'}"]
    assert ar.ensure(said.append, src=tmp_path / "other") == root and len(said) == 1


def test_a_root_without_its_stamp_is_built_again(offline_build: dict[str, list]) -> None:
    root = ar.ensure(print)
    (root.parent / "build.json").unlink()  # as if the build had stopped before its end
    offline_build["built"].clear()
    assert ar.ensure(print) == root
    assert len(offline_build["built"]) == 1
    assert (root.parent / "build.json").exists()


def test_old_roots_are_pruned_but_the_previous_one_is_kept(
    offline_build: dict[str, list],
) -> None:
    base = ar.cache_root()
    for n, name in enumerate(["1111111111111111", "2222222222222222", ".part-dead-x"]):
        (base / name).mkdir(parents=True)
        (base / name / "build.json").write_text("{}")
        os.utime(base / name / "build.json", (1_000_000 + n, 1_000_000 + n))
    ar.ensure(print)
    names = {p.name for p in base.iterdir()}
    assert "2222222222222222" in names  # the newest older root stays
    assert "1111111111111111" not in names and ".part-dead-x" not in names
