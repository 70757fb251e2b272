#!/usr/bin/env python3
"""Fetch the real models and device trees that the tests and the demo use.

Everything comes from package registries, pinned by sha256 and cached, never committed:

* PP-OCRv4 text detection and the PP-OCR text-direction classifier (ONNX) from the
  rapidocr-onnxruntime 1.4.4 wheel on PyPI (Apache-2.0);
* face_detection_short_range.tflite from the mediapipe 0.10.21 wheel on PyPI (Apache-2.0);
* the arm64 board device trees (.dtb) of Debian bookworm's linux-image-6.1.0-50-arm64
  (6.1.176-1), fetched with apt-get under a private apt state folder so the host's apt
  configuration is not touched;
* opt-in (`--with-armhf`, ~43 MB, not part of the default run): the 32-bit arm board device
  trees of linux-image-6.1.0-50-armmp (6.1.176-1, armhf), the same way, for the device-tree
  benchmark (scripts/bench_dtcheck.py);
* INT8 QDQ versions of det and cls, made here with onnxruntime.quantization.quantize_static
  (U8S8 with 7-bit weights, `reduce_range`: plain U8S8 saturates in onnxruntime's x86 kernels
  on CPUs without VNNI, e.g. AVX2-only EPYC and many Intel edge PCs, and these models must
  give the same answers on every machine the tests run on).

Cache: $EDGED_TEST_DATA, default ~/.cache/edged/test-data. Re-running only checks hashes.
Exit codes: 0 ok, 1 a download or check failed (the message names the file and the hash).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    requirement: str
    filename: str
    sha256: str
    platform: str | None  # pip download --platform, so any host fetches the same file


@dataclass(frozen=True)
class Member:
    wheel: Wheel
    path_in_wheel: str
    sha256: str
    dest: str  # relative to the cache's models/


RAPIDOCR = Wheel(
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
    "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf",
    None,
)
MEDIAPIPE = Wheel(
    "mediapipe==0.10.21",
    "mediapipe-0.10.21-cp311-cp311-manylinux_2_28_x86_64.whl",
    "05dc4a9e593655a79558d05d6227d31018c2537a4bd3362b51e230cf22aecfe3",
    "manylinux_2_28_x86_64",
)
MODELS = [
    Member(
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        "ppocrv4_det.onnx",
    ),
    Member(
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
        "ppocr_cls.onnx",
    ),
    Member(
        MEDIAPIPE,
        "mediapipe/modules/face_detection/face_detection_short_range.tflite",
        "bbff11cebd1eb27a1e004cae0b0e63ec8c551cbf34a4451148b4908b8db3eca8",
        "face_detection_short_range.tflite",
    ),
]

KERNEL_DEB = {
    "package": "linux-image-6.1.0-50-arm64",
    "version": "6.1.176-1",
    "arch": "arm64",
    "suite": "bookworm",
    "filename": "linux-image-6.1.0-50-arm64_6.1.176-1_arm64.deb",
    "sha256": "914f75b57a8e165d85fb910c3e2dcc7000a05a9fea3f42f90b26e8dd590d5f06",
    "dtb_prefix": "./usr/lib/linux-image-6.1.0-50-arm64/",
    "dest": "linux-6.1.176-arm64",
}
# Opt-in (--with-armhf): the 32-bit arm boards of the same kernel release.
KERNEL_DEB_ARMHF = {
    "package": "linux-image-6.1.0-50-armmp",
    "version": "6.1.176-1",
    "arch": "armhf",
    "suite": "bookworm",
    "filename": "linux-image-6.1.0-50-armmp_6.1.176-1_armhf.deb",
    "sha256": "ddd1d8dd0c6beabb9eb96bcfab26549eb30c63331bae31de481ffae4af0e982a",
    "dtb_prefix": "./usr/lib/linux-image-6.1.0-50-armmp/",
    "dest": "linux-6.1.176-armhf",
}

# INT8 QDQ variants: (source model, output, calibration input shape, preprocessing).
# The stamp beside each holds the source's sha256 and this recipe name: a changed recipe
# makes them again.
QUANTIZE_RECIPE = "qdq-u8s8-reduce-range-per-channel"
QUANTIZED = [
    ("ppocrv4_det.onnx", "ppocrv4_det_int8.onnx", (1, 3, 320, 320), "imagenet"),
    ("ppocr_cls.onnx", "ppocr_cls_int8.onnx", (1, 3, 48, 192), "half"),
]


class FetchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"fetch-test-data: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    env = os.environ.get("EDGED_TEST_DATA")
    return Path(env) if env else Path.home() / ".cache" / "edged" / "test-data"


def models_dir(required: Iterable[str] = ()) -> Path:
    """The fetched models folder, for the benchmark scripts; the models are fetched first when
    any of `required` is missing."""
    models = cache_dir() / "models"
    if any(not (models / name).exists() for name in required):
        subprocess.run([sys.executable, __file__, "--only", "models"], check=True)
    return models


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise FetchError(f"{path}: sha256 {got} does not match the pinned {expected}")


def fetch_wheel(wheel: Wheel, wheels_dir: Path) -> Path:
    path = wheels_dir / wheel.filename
    if path.exists() and sha256_file(path) == wheel.sha256:
        return path
    wheels_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading {wheel.requirement} from PyPI")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(wheels_dir),
        wheel.requirement,
    ]
    if wheel.platform:
        cmd += ["--platform", wheel.platform, "--python-version", "3.11", "--implementation", "cp"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not path.exists():
        raise FetchError(f"pip download {wheel.requirement} failed: {proc.stderr.strip()[-400:]}")
    check_sha(path, wheel.sha256)
    return path


def fetch_models(root: Path) -> None:
    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    for member in MODELS:
        dest = models / member.dest
        if dest.exists() and sha256_file(dest) == member.sha256:
            continue
        wheel_path = fetch_wheel(member.wheel, root / "wheels")
        with zipfile.ZipFile(wheel_path) as zf:
            data = zf.read(member.path_in_wheel)
        if hashlib.sha256(data).hexdigest() != member.sha256:
            raise FetchError(f"{member.path_in_wheel} in {wheel_path.name}: sha256 mismatch")
        tmp = dest.with_suffix(dest.suffix + ".part")
        tmp.write_bytes(data)
        tmp.replace(dest)
        log(f"extracted {dest.name}")


def _apt_env(
    state: Path, arches: tuple[str, ...] = ("arm64",), suite: str = KERNEL_DEB["suite"]
) -> dict[str, str]:
    """A private apt configuration: `suite`'s `arches` lists in `state` (the first is the
    native one), the host's apt left alone."""
    uri = _debian_archive_uri()
    for sub in ("lists/partial", "cache/archives/partial", "none.d", "prefs.d"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "status").touch()
    (state / "sources.list").write_text(
        f"deb [arch={','.join(arches)} signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
        f"{uri} {suite} main\n"
    )
    (state / "apt.conf").write_text(
        "\n".join(
            [
                f'Dir::Etc::SourceList "{state}/sources.list";',
                f'Dir::Etc::SourceParts "{state}/none.d";',
                f'Dir::Etc::PreferencesParts "{state}/prefs.d";',
                f'Dir::State::Lists "{state}/lists";',
                f'Dir::State::status "{state}/status";',
                f'Dir::Cache "{state}/cache";',
                f'APT::Architecture "{arches[0]}";',
                f'Dir::Etc::Preferences "{state}/prefs";',
                "APT::Architectures { " + " ".join(f'"{a}";' for a in arches) + " };",
                'APT::Sandbox::User "root";',
            ]
        )
        + "\n"
    )
    return {**os.environ, "APT_CONFIG": str(state / "apt.conf")}


def _debian_archive_uri() -> str:
    """The Debian archive this machine already uses (read from its own apt sources)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:"):
                for uri in line.split()[1:]:
                    if uri.rstrip("/").endswith("/debian"):
                        return uri
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        for line in sources.read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[0] == "deb" and parts[1].rstrip("/").endswith("/debian"):
                return parts[1]
    raise FetchError(
        "no Debian archive found in /etc/apt sources (the packages the tests fetch come from it)"
    )


def fetch_kernel_deb(root: Path, deb: dict[str, str] = KERNEL_DEB) -> Path:
    debs = root / "debs"
    path = debs / deb["filename"]
    if path.exists() and sha256_file(path) == deb["sha256"]:
        return path
    if shutil.which("apt-get") is None:
        raise FetchError("apt-get not found: the .dtb files come from Debian's kernel package")
    debs.mkdir(parents=True, exist_ok=True)
    arches = ("arm64",) if deb["arch"] == "arm64" else ("arm64", deb["arch"])
    env = _apt_env(root / "apt-state", arches)
    log(f"apt-get update (private state, {'+'.join(arches)} {deb['suite']})")
    proc = subprocess.run(["apt-get", "-q", "update"], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"apt-get update failed: {proc.stderr.strip()[-400:]}")
    spec = f"{deb['package']}:{deb['arch']}={deb['version']}"
    log(f"apt-get download {spec}")
    proc = subprocess.run(
        ["apt-get", "-q", "download", spec], env=env, cwd=debs, capture_output=True, text=True
    )
    if proc.returncode != 0 or not path.exists():
        raise FetchError(f"apt-get download {spec} failed: {proc.stderr.strip()[-400:]}")
    check_sha(path, deb["sha256"])
    return path


def _deb_data_tar(deb: Path) -> tarfile.TarFile:
    """Open data.tar.* of a .deb (an `ar` archive) without dpkg, so any host can unpack it."""
    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise FetchError(f"{deb}: not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(raw):
        header = raw[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = raw[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            if name.endswith(".xz"):
                body = lzma.decompress(body)
            elif name.endswith(".zst"):
                raise FetchError(f"{deb}: zstd-compressed data is not supported")
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
        pos += 60 + size + (size & 1)
    raise FetchError(f"{deb}: no data.tar member")


def fetch_dtbs(root: Path, kernel: dict[str, str] = KERNEL_DEB) -> None:
    dest = root / "dtb" / kernel["dest"]
    stamp = dest / ".complete"
    if stamp.exists() and stamp.read_text().strip() == kernel["sha256"]:
        return
    deb = fetch_kernel_deb(root, kernel)
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    count = 0
    with _deb_data_tar(deb) as tar:
        for info in tar.getmembers():
            if not (info.isfile() and info.name.endswith(".dtb")):
                continue
            if not info.name.startswith(kernel["dtb_prefix"]):
                continue
            rel = info.name[len(kernel["dtb_prefix"]) :]
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            extracted = tar.extractfile(info)
            assert extracted is not None
            out.write_bytes(extracted.read())
            count += 1
    if count == 0:
        raise FetchError(f"{deb}: no .dtb files under {kernel['dtb_prefix']}")
    (tmp / ".complete").write_text(kernel["sha256"] + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    log(f"extracted {count} .dtb files into {dest}")


def _calibration_images(shape: tuple[int, ...], count: int, seed: int):
    """Text-like calibration images (the OCR models were trained on text; noise would
    calibrate ranges they never see), as float32 NCHW batches of one in [0, 1]."""
    import numpy as np

    from edged.selection.inputs import text_like_images

    _, channels, height, width = shape
    for grey in text_like_images(height, width, count, seed):
        yield np.repeat(grey[None, None], channels, axis=1).astype(np.float32)


def _normalize(batch, mode: str):
    import numpy as np

    if mode == "imagenet":
        mean = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(1, 3, 1, 1)
        std = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(1, 3, 1, 1)
        return (batch - mean) / std
    return (batch - 0.5) / 0.5


def quantize_models(root: Path) -> None:
    models = root / "models"
    for src_name, out_name, shape, norm in QUANTIZED:
        src = models / src_name
        out = models / out_name
        stamp = out.with_suffix(".onnx.source-sha256")
        want = f"{sha256_file(src)} {QUANTIZE_RECIPE}"
        if out.exists() and stamp.exists() and stamp.read_text().strip() == want:
            continue
        log(f"quantizing {src_name} to INT8 QDQ (static, per-channel)")
        quantize_qdq(src, out, shape, norm)
        stamp.write_text(want + "\n")


def quantize_qdq(
    src: Path, out: Path, shape: tuple[int, ...], norm: str, reduce_range: bool = True
) -> None:
    """`src` as static per-channel U8S8 QDQ calibrated on text-like images; with
    `reduce_range` False, plain 8-bit weights (the tests' example of a model that saturates
    on x86 without VNNI)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    from edged.quantize.recipes import prepare

    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        # Opset 13 (per-channel QDQ needs it) and shape inference, as edgectl quantize does.
        prepped = prepare(src, Path(tmp))
        input_name = onnx.load(str(prepped), load_external_data=False).graph.input[0].name

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                images = _calibration_images(shape, 24, seed=20261130)
                self._it = ({input_name: _normalize(img, norm)} for img in images)

            def get_next(self):
                return next(self._it, None)

        partial = out.with_suffix(".onnx.part")
        quantize_static(
            str(prepped),
            str(partial),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            reduce_range=reduce_range,
        )
        partial.replace(out)


def write_manifest(root: Path) -> None:
    manifest = {
        "models": {
            p.name: sha256_file(p)
            for p in sorted((root / "models").glob("*.*"))
            if p.suffix in (".onnx", ".tflite")
        },
        "dtb": KERNEL_DEB["dest"],
    }
    armhf = root / "dtb" / KERNEL_DEB_ARMHF["dest"] / ".complete"
    if armhf.exists():
        manifest["dtb_armhf"] = KERNEL_DEB_ARMHF["dest"]
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["models", "dtb"], help="fetch just one kind")
    parser.add_argument("--print-dir", action="store_true", help="print the cache folder")
    parser.add_argument(
        "--with-armhf",
        action="store_true",
        help="also fetch the armhf board .dtb files (~43 MB download; opt-in)",
    )
    args = parser.parse_args(argv)
    root = cache_dir()
    if args.print_dir:
        print(root)
        return 0
    root.mkdir(parents=True, exist_ok=True)
    try:
        if args.only in (None, "models"):
            fetch_models(root)
            quantize_models(root)
        if args.only in (None, "dtb"):
            fetch_dtbs(root)
            if args.with_armhf:
                fetch_dtbs(root, KERNEL_DEB_ARMHF)
        write_manifest(root)
    except (FetchError, OSError) as exc:
        log(f"error: {exc}")
        return 1
    log(f"ready in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
