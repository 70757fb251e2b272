#!/usr/bin/env python3
"""Fetch the real models, photos and device trees that the tests and the demo use.

Everything comes from package registries, pinned by sha256 and cached, never committed:

* PP-OCRv4 text detection and the PP-OCR text-direction classifier (ONNX) from the
  rapidocr-onnxruntime 1.4.4 wheel on PyPI (Apache-2.0);
* face_detection_short_range.tflite, palm_detection_lite.tflite and palm_detection_full.tflite
  from the mediapipe 0.10.21 wheel on PyPI (Apache-2.0);
* a YOLOv8n object detector (320x320, 18 classes, FACE_FEMALE and FACE_MALE among them) from
  the nudenet 3.4.2 wheel on PyPI (package MIT; its weights' metadata says AGPL-3.0), as
  models/nudenet_320n.onnx;
* eight photos of scikit-image's data folder (astronaut, camera, coffee, chelsea, rocket,
  motorcycle_left, motorcycle_right, hubble_deep_field) from the scikit-image 0.24.0 wheel on
  PyPI (BSD-3-Clause), into images/photos/;
* made here from those photos with Pillow, deterministically (seeded random square crops, some
  flipped, RGB, 192x192): 48 calibration images for the MediaPipe face and palm detectors
  (images/detector-calibration/; about half the crops of astronaut and camera centred on the
  face) and 16 held-out evaluation images made the same way with another seed
  (images/detector-eval/);
* the arm64 board device trees (.dtb) of Debian bookworm's linux-image-6.1.0-50-arm64
  (6.1.176-1), fetched with apt-get under a private apt state folder so the host's apt
  configuration is not touched;
* opt-in (`--with-armhf`, ~43 MB, not part of the default run): the 32-bit arm board device
  trees of linux-image-6.1.0-50-armmp (6.1.176-1, armhf), the same way, for the device-tree
  benchmark (scripts/bench_dtcheck.py);
* INT8 QDQ versions of det and cls, made here with onnxruntime.quantization.quantize_static
  (U8S8 with 7-bit weights, `reduce_range`: plain U8S8 saturates in onnxruntime's x86 kernels
  on CPUs without VNNI, e.g. AVX2-only EPYC and many Intel edge PCs, and these models must
  give the same answers on every machine the tests run on);
* .rknn versions of the cls model for the RKNN backend (RK3588 and RK3566, fp16 and INT8),
  made here with Rockchip's converter, rknn-toolkit2 2.5.0 from PyPI (x86-64 only), in a
  private venv of pinned wheels made for the step and removed after it (about 30 s; 164 MB
  of wheels, cached). Its outputs are not byte-reproducible (see RKNN_RECIPE), so they are
  checked with edged's own reader instead of pinned by sha256.

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
import platform
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
    dest: str  # relative to the cache folder


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
# NudeNet's detector: a YOLOv8n (Ultralytics 8.2.46, 320x320, 18 classes, the two face classes
# among them) in Frigate's "yologeneric" output layout, the one trained YOLO detector that the
# package registries carry. The package is MIT; the weights' own metadata says AGPL-3.0
# (Ultralytics). Used for its face classes on the photos; never committed.
NUDENET = Wheel(
    "nudenet==3.4.2",
    "nudenet-3.4.2-py3-none-any.whl",
    "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331",
    None,
)
SKIMAGE = Wheel(
    "scikit-image==0.24.0",
    "scikit_image-0.24.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "fa27b3a0dbad807b966b8db2d78da734cb812ca4787f7fbb143764800ce2fa9c",
    "manylinux_2_17_x86_64",
)
MODELS = [
    Member(
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        "models/ppocrv4_det.onnx",
    ),
    Member(
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
        "models/ppocr_cls.onnx",
    ),
    Member(
        MEDIAPIPE,
        "mediapipe/modules/face_detection/face_detection_short_range.tflite",
        "bbff11cebd1eb27a1e004cae0b0e63ec8c551cbf34a4451148b4908b8db3eca8",
        "models/face_detection_short_range.tflite",
    ),
    Member(
        MEDIAPIPE,
        "mediapipe/modules/palm_detection/palm_detection_lite.tflite",
        "e9a4aaddf90dda56a87235303cf00e4c2d3fb28725f68fd88772997dac905c18",
        "models/palm_detection_lite.tflite",
    ),
    Member(
        MEDIAPIPE,
        "mediapipe/modules/palm_detection/palm_detection_full.tflite",
        "1b14e9422c6ad006cde6581a46c8b90dd573c07ab7f3934b5589e7cea3f89a54",
        "models/palm_detection_full.tflite",
    ),
    Member(
        NUDENET,
        "nudenet/320n.onnx",
        "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
        "models/nudenet_320n.onnx",
    ),
]
PHOTO_SHA256 = {  # skimage/data/ in the scikit-image wheel
    "astronaut.png": "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
    "camera.png": "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a",
    "coffee.png": "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7",
    "chelsea.png": "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb",
    "rocket.jpg": "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
    "motorcycle_left.png": "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179",
    "motorcycle_right.png": "5fc913ae870e42a4b662314bc904d1786bcad8e2f0b9b67dba5a229406357797",
    "hubble_deep_field.jpg": "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4",
}
PHOTOS = [
    Member(SKIMAGE, f"skimage/data/{name}", sha256, f"images/photos/{name}")
    for name, sha256 in PHOTO_SHA256.items()
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

# Programs the tests run that Debian packages but that must not be installed as services
# (apt-get install would enable a Prometheus server and a journal-remote socket on the
# machine): downloaded under the private apt state, sha256-pinned, and their files unpacked
# into <cache>/tools/<dest>/. amd64 only (on other hosts the tests that need them skip and
# say so). Prometheus and promtool: the dashboards' queries against a real server;
# systemd-journal-remote (with its libmicrohttpd): the journal test writes a real journal
# file, which journalctl then filters.
TOOL_DEBS = [
    {
        "package": "prometheus",
        "version": "2.42.0+ds-5+deb12u1",
        "arch": "amd64",
        "suite": "bookworm",
        "filename": "prometheus_2.42.0+ds-5+deb12u1_amd64.deb",
        "sha256": "81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55",
        "files": "./usr/bin/prometheus ./usr/bin/promtool",
        "dest": "prometheus",
    },
    {
        "package": "systemd-journal-remote",
        "version": "252.39-1~deb12u2",
        "arch": "amd64",
        "suite": "bookworm",
        "filename": "systemd-journal-remote_252.39-1~deb12u2_amd64.deb",
        "sha256": "803ed931f664d6985eec286699ff415c6b867fe27b7ed7de15097d1358155baa",
        "files": "./lib/systemd/systemd-journal-remote",
        "dest": "journal-remote",
    },
    {
        "package": "libmicrohttpd12",
        "version": "0.9.75-6",
        "arch": "amd64",
        "suite": "bookworm",
        "filename": "libmicrohttpd12_0.9.75-6_amd64.deb",
        "sha256": "bc48c3d32cfb9b188e3bdd080554143ec6253ea68dc2d7f239aa32d27a6aa792",
        "files": "./usr/lib/x86_64-linux-gnu/libmicrohttpd.so.12.60.0=libmicrohttpd.so.12",
        "dest": "journal-remote",
    },
]

# INT8 QDQ variants: (source model, output, calibration input shape, preprocessing,
# reduce_range). The stamp beside each holds the source's sha256 and its recipe name: a
# changed recipe makes them again. The U8S8 cls without reduce_range is the tests' example
# of a model that saturates on x86 without VNNI (made here, natively, so the emulated
# isa-avx2 lane does not spend two minutes quantizing it).
QUANTIZED = [
    ("ppocrv4_det.onnx", "ppocrv4_det_int8.onnx", (1, 3, 320, 320), "imagenet", True),
    ("ppocr_cls.onnx", "ppocr_cls_int8.onnx", (1, 3, 48, 192), "half", True),
    ("ppocr_cls.onnx", "ppocr_cls_u8s8.onnx", (1, 3, 48, 192), "half", False),
]


def quantize_recipe(reduce_range: bool) -> str:
    return "qdq-u8s8-reduce-range-per-channel" if reduce_range else "qdq-u8s8-per-channel"


# .rknn models, made with rknn-toolkit2 (Rockchip's converter; x86-64 Linux wheels only). Its
# pins (numpy<=1.26.4, onnx<=1.18, protobuf<=4.25.4, torch<=2.4) do not fit the project's venv,
# so it gets a venv of its own with these wheels (--no-deps: exactly these), made for the step
# in the cache folder and removed after. torch is left out: rknn.api imports it when it loads
# (an @torch.no_grad() decorator, a torch.nn.Module subclass, a version compare), but uses it
# only to load PyTorch models and in its GDQ quantizer, and PyPI's torch 2.4.0 (the newest it
# allows) is a 797 MB CUDA build that does not even import without NVIDIA's CUDA wheels. The
# venv gets TORCH_STANDIN instead, which raises on any other use; an ONNX conversion with it
# was checked to write the same file as with a real torch (2.13 CPU), but for the bytes that
# differ between any two runs (below).
RKNN_TOOLKIT = Wheel(
    "rknn-toolkit2==2.5.0",
    "rknn_toolkit2-2.5.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "21922dd3037503a2934fea24cbbf6eccda586158178636ae28a2ac658e710055",
    "manylinux_2_17_x86_64",
)
RKNN_TOOLKIT_DEPS = [
    Wheel(
        "numpy==1.26.4",
        "numpy-1.26.4-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "666dbfb6ec68962c033a450943ded891bed2d54e6755e35e5835d63f4f6931d5",
        "manylinux_2_17_x86_64",
    ),
    Wheel(
        "protobuf==4.25.4",
        "protobuf-4.25.4-cp37-abi3-manylinux2014_x86_64.whl",
        "3319e073562e2515c6ddc643eb92ce20809f5d8f10fead3332f71c63be6a7040",
        "manylinux2014_x86_64",
    ),
    Wheel(
        "onnx==1.17.0",
        "onnx-1.17.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "4a183c6178be001bf398260e5ac2c927dc43e7746e8638d6c05c20e321f8c949",
        "manylinux_2_17_x86_64",
    ),
    Wheel(
        "onnxruntime==1.19.2",  # load_onnx runs the graph with it
        "onnxruntime-1.19.2-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "a36511dc07c5c964b916697e42e366fa43c48cdb3d3503578d78cef30417cb84",
        "manylinux_2_28_x86_64",
    ),
    Wheel(
        "scipy==1.17.1",
        "scipy-1.17.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "43af8d1f3bea642559019edfe64e9b11192a8978efbd1539d7bc2aaa23d92de4",
        "manylinux_2_28_x86_64",
    ),
    Wheel(
        "opencv-python-headless==4.10.0.84",  # rknn.api imports cv2; the headless build does
        "opencv_python_headless-4.10.0.84-cp37-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "377d08a7e48a1405b5e84afcbe4798464ce7ee17081c1c23619c8b398ff18295",
        "manylinux_2_17_x86_64",
    ),
    Wheel(
        "psutil==7.2.2",
        "psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.manylinux_2_28_x86_64.whl",
        "076a2d2f923fd4821644f5ba89f059523da90dc9014e85f8e45a5774ca5bc6f9",
        "manylinux_2_28_x86_64",
    ),
    Wheel(
        "ruamel.yaml==0.19.1",
        "ruamel_yaml-0.19.1-py3-none-any.whl",
        "27592957fedf6e0b62f281e96effd28043345e0e66001f97683aa9a40c667c93",
        None,
    ),
    Wheel(
        "tqdm==4.70.1",
        "tqdm-4.70.1-py3-none-any.whl",
        "c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73",
        None,
    ),
    Wheel(
        "typing_extensions==4.16.0",
        "typing_extensions-4.16.0-py3-none-any.whl",
        "481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8",
        None,
    ),
]
TORCH_STANDIN = {
    "__init__.py": '''"""A stand-in for torch, written by edged's scripts/fetch_test_data.py:
rknn-toolkit2 imports torch when it loads but converts ONNX models without it. Any use raises.
"""

import contextlib

__version__ = "2.4.0"


class no_grad(contextlib.ContextDecorator):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def __getattr__(name):
    raise RuntimeError(f"torch.{name}: not installed (a stand-in: see its docstring)")
''',
    "nn.py": """class Module:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torch.nn.Module: not installed (a stand-in: see torch/__init__.py)")


def __getattr__(name):
    raise RuntimeError(f"torch.nn.{name}: not installed (a stand-in: see torch/__init__.py)")
""",
}
# What the converter runs in that venv: each job's config, load_onnx (the input fixed to its
# shape: the ONNX model's height and width are dynamic), build (INT8 calibrated on the
# dataset's .npy files, in the model's NCHW layout as rknn-toolkit2 wants them) and export.
RKNN_CONVERT = """import json, sys
from rknn.api import RKNN

for job in json.loads(sys.argv[1]):
    rknn = RKNN(verbose=False)
    try:
        steps = (
            ("config", lambda: rknn.config(
                mean_values=[[0, 0, 0]], std_values=[[1, 1, 1]], target_platform=job["target"])),
            ("load_onnx", lambda: rknn.load_onnx(
                model=job["onnx"], inputs=[job["input"]], input_size_list=[job["shape"]])),
            ("build", lambda: rknn.build(do_quantization=job["int8"], dataset=job["dataset"])),
            ("export_rknn", lambda: rknn.export_rknn(job["out"])),
        )
        for name, step in steps:
            if step() != 0:
                sys.exit(f"rknn-toolkit2 {name} failed for {job['out']}")
    finally:
        rknn.release()
"""
# (source, output, target_platform, INT8). The stamp beside each holds the source's sha256,
# the converter wheel's and this recipe. The converter's output is not byte-reproducible: a
# file holds a few heap and stack addresses and, in padding, uninitialised memory of the
# converting process (two builds of the fp16 RK3588 model here differed in 1,247 of its
# 994,945 bytes), so the files are checked with edged's reader (target, precision, the ONNX
# original's inputs and outputs) instead of pinned by sha256; manifest.json records their
# sha256.
RKNN_RECIPE = "rknn-toolkit2-2.5.0 nchw-1x3x48x192 int8-8-text-like-half v1"
RKNN_INPUT = ("x", [1, 3, 48, 192])
RKNN_CALIBRATION = (8, 20261130)  # images, seed (the seed of the ONNX INT8 models)
RKNN_MODELS = [
    ("ppocr_cls.onnx", "ppocr_cls_rk3588_fp16.rknn", "rk3588", False),
    ("ppocr_cls.onnx", "ppocr_cls_rk3588_int8.rknn", "rk3588", True),
    ("ppocr_cls.onnx", "ppocr_cls_rk3566_fp16.rknn", "rk3566", False),
    ("ppocr_cls.onnx", "ppocr_cls_rk3566_int8.rknn", "rk3566", True),
]

# Calibration and held-out evaluation images for the MediaPipe face and palm detectors, made
# from PHOTOS: (folder under images/, number of images, seed). The stamp in each folder holds
# this recipe name and the photos' sha256: a changed recipe or photo makes the set again.
DETECTOR_IMAGES_RECIPE = "square-crop-30-100-hflip-rgb-192-bilinear-v1"
DETECTOR_IMAGE_SIZE = 192  # the palm model's input; the face model's 128 is resized on load
DETECTOR_SETS = [
    ("detector-calibration", 48, 20261201),
    ("detector-eval", 16, 20261202),
]
# Face centres (x, y as fractions of the image) of the photos with a face: every other crop
# of these is centred there (with a little jitter and at most 75 % of the short side, so the
# face stays in view and large enough for the short-range face model).
FACE_CENTRES = {"astronaut.png": (0.45, 0.25), "camera.png": (0.43, 0.26)}


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


def images_dir(required: Iterable[str] = ()) -> Path:
    """The photos and detector image sets folder; they are fetched and made first when any of
    `required` (paths relative to it, e.g. "detector-calibration") is missing."""
    images = cache_dir() / "images"
    if any(not (images / name).exists() for name in required):
        subprocess.run([sys.executable, __file__, "--only", "images"], check=True)
    return images


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
    extract_members(root, MODELS)


def fetch_photos(root: Path) -> None:
    extract_members(root, PHOTOS)


def extract_members(root: Path, members: Iterable[Member]) -> None:
    for member in members:
        dest = root / member.dest
        if dest.exists() and sha256_file(dest) == member.sha256:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
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


def tools_dir() -> Path:
    return cache_dir() / "tools"


def fetch_tools(root: Path, debs: list[dict[str, str]] = TOOL_DEBS) -> None:
    """TOOL_DEBS' files unpacked into <root>/tools/<dest>/ (each deb once: a stamp holds
    its sha256)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        log(f"tools: pinned for amd64; skipped on {platform.machine()} (their tests skip)")
        return
    for deb in debs:
        dest = root / "tools" / deb["dest"]
        stamp = dest / f".{deb['package']}.sha256"
        if stamp.exists() and stamp.read_text().strip() == deb["sha256"]:
            continue
        path = fetch_kernel_deb(root, deb)
        dest.mkdir(parents=True, exist_ok=True)
        wanted = {}  # member -> file name ("member=name" renames it)
        for item in deb["files"].split():
            member, _, name = item.partition("=")
            wanted[member] = name or Path(member).name
        with _deb_data_tar(path) as tar:
            for info in tar.getmembers():
                if info.name in wanted and info.isfile():
                    out = dest / wanted.pop(info.name)
                    extracted = tar.extractfile(info)
                    assert extracted is not None
                    out.write_bytes(extracted.read())
                    out.chmod(0o755)
        if wanted:
            raise FetchError(f"{path}: missing {', '.join(sorted(wanted))}")
        stamp.write_text(deb["sha256"] + "\n")
        log(f"tools: {deb['package']} {deb['version']} unpacked into {dest}")


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
    for src_name, out_name, shape, norm, reduce_range in QUANTIZED:
        src = models / src_name
        out = models / out_name
        stamp = out.with_suffix(".onnx.source-sha256")
        want = f"{sha256_file(src)} {quantize_recipe(reduce_range)}"
        if out.exists() and stamp.exists() and stamp.read_text().strip() == want:
            continue
        log(f"quantizing {src_name} to INT8 QDQ (static, per-channel) as {out_name}")
        quantize_qdq(src, out, shape, norm, reduce_range=reduce_range)
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


def make_rknn_models(root: Path) -> None:
    """RKNN_MODELS, made again only where a stamp does not match (the converter's venv is
    made only then), each checked with edged's own .rknn reader."""
    models = root / "models"
    toolkit = RKNN_TOOLKIT.sha256
    todo = []
    for src_name, out_name, target, int8 in RKNN_MODELS:
        out = models / out_name
        stamp = out.with_name(out.name + ".source-sha256")
        want = f"{sha256_file(models / src_name)} {toolkit} {RKNN_RECIPE}"
        if not (out.exists() and stamp.exists() and stamp.read_text().strip() == want):
            todo.append((models / src_name, out, target, int8, stamp, want))
    if not todo:
        return
    wheels = [fetch_wheel(w, root / "wheels") for w in (RKNN_TOOLKIT, *RKNN_TOOLKIT_DEPS)]
    with tempfile.TemporaryDirectory(prefix="rknn-toolkit2.", dir=root) as tmp:
        work = Path(tmp)
        python = _rknn_venv(work / "venv", wheels)
        dataset = _rknn_calibration(work / "calibration")
        jobs = [
            {
                "onnx": str(src),
                "out": str(work / out.name),
                "target": target,
                "int8": int8,
                "dataset": str(dataset) if int8 else None,
                "input": RKNN_INPUT[0],
                "shape": RKNN_INPUT[1],
            }
            for src, out, target, int8, _, _ in todo
        ]
        log(f"converting {len(jobs)} .rknn models with rknn-toolkit2 2.5.0")
        script = work / "convert.py"
        script.write_text(RKNN_CONVERT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        proc = subprocess.run(
            [str(python), str(script), json.dumps(jobs)],
            capture_output=True,
            text=True,
            cwd=work,
            env=env,
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip())[-600:]
            raise FetchError(f"rknn-toolkit2 conversion failed (exit {proc.returncode}): {tail}")
        for (src, out, target, int8, stamp, want), job in zip(todo, jobs, strict=True):
            made = Path(job["out"])
            check_rknn(made, src, target, "int8" if int8 else "fp16")
            made.replace(out)
            stamp.write_text(want + "\n")
            log(f"made {out.name}")


def _rknn_venv(venv: Path, wheels: list[Path]) -> Path:
    """A venv with exactly `wheels` (no dependency resolution, no index) and TORCH_STANDIN."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    cmd = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "-q"]
    cmd += ["--disable-pip-version-check", *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"installing rknn-toolkit2's wheels failed: {proc.stderr.strip()[-400:]}")
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "torch").mkdir()
    for name, text in TORCH_STANDIN.items():
        (Path(site) / "torch" / name).write_text(text)
    return python


def _rknn_calibration(folder: Path) -> Path:
    """RKNN_CALIBRATION's text-like images as NCHW float32 .npy files, normalised as the cls
    model takes them, and the dataset list rknn-toolkit2's build() reads."""
    import numpy as np

    folder.mkdir()
    count, seed = RKNN_CALIBRATION
    paths = []
    for i, image in enumerate(_calibration_images(tuple(RKNN_INPUT[1]), count, seed)):
        path = folder / f"{i:02d}.npy"
        np.save(path, _normalize(image, "half").astype(np.float32))
        paths.append(str(path))
    dataset = folder / "dataset.txt"
    dataset.write_text("\n".join(paths) + "\n")
    return dataset


def check_rknn(path: Path, original: Path, target: str, precision: str) -> None:
    """FetchError unless edged reads `path` as an RKNN model for `target` in `precision`
    with `original`'s inputs and outputs."""
    from backends.errors import ModelError
    from backends.model_info import signature, signature_mismatch
    from backends.rknn.rknn_file import read_rknn

    try:
        made = read_rknn(path, path.read_bytes())
        mismatch = signature_mismatch(
            signature(original), ([t.spec for t in made.inputs], [t.spec for t in made.outputs])
        )
    except ModelError as exc:
        raise FetchError(f"rknn-toolkit2 wrote a model edged cannot read: {exc}") from None
    if (made.target, made.precision) != (target, precision) or mismatch:
        raise FetchError(
            f"{path.name}: edged reads it as {made.precision} for {made.target} "
            f"({mismatch or 'same inputs and outputs'}), expected {precision} for {target}"
        )


def make_detector_images(root: Path) -> None:
    for name, count, seed in DETECTOR_SETS:
        make_detector_set(root, name, count, seed)


def make_detector_set(root: Path, name: str, count: int, seed: int) -> None:
    """images/`name`: `count` PNGs cropped from the photos (see `detector_crops`), with a
    `.source-sha256` stamp of the recipe, count, seed and the photos' sha256; a set whose
    stamp matches is only checked, not made again."""
    images = root / "images"
    photos = [root / member.dest for member in PHOTOS]
    dest = images / name
    stamp = dest / ".source-sha256"
    want = f"{DETECTOR_IMAGES_RECIPE} count={count} seed={seed}\n" + "".join(
        f"{sha256_file(photo)}  {photo.relative_to(images)}\n" for photo in photos
    )
    if stamp.exists() and stamp.read_text() == want and len(list(dest.glob("*.png"))) == count:
        return
    log(f"making {count} detector images in images/{name} (seed {seed})")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for filename, image in detector_crops(photos, count, seed):
        image.save(tmp / filename, format="PNG")
    (tmp / stamp.name).write_text(want)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def detector_crops(photos: list[Path], count: int, seed: int):
    """`count` (file name, 192x192 RGB image) pairs, spread evenly over `photos`: square crops
    of 30-100 % of the short side anywhere in the photo, about half flipped left-right; every
    other crop of a photo in FACE_CENTRES is centred on its face instead."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    per_photo, extra = divmod(count, len(photos))
    for k, path in enumerate(photos):
        with Image.open(path) as opened:
            photo = opened.convert("RGB")
        width, height = photo.size
        short = min(width, height)
        face = FACE_CENTRES.get(path.name)
        for i in range(per_photo + (k < extra)):
            centre = face if i % 2 == 0 else None
            side = round(rng.uniform(0.3, 0.75 if centre else 1.0) * short)
            if centre:
                x = centre[0] * width - side / 2 + rng.uniform(-0.1, 0.1) * side
                y = centre[1] * height - side / 2 + rng.uniform(-0.1, 0.1) * side
            else:
                x = rng.uniform(0, width - side)
                y = rng.uniform(0, height - side)
            left = min(max(round(x), 0), width - side)
            top = min(max(round(y), 0), height - side)
            crop = photo.crop((left, top, left + side, top + side))
            if rng.random() < 0.5:
                crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            size = (DETECTOR_IMAGE_SIZE, DETECTOR_IMAGE_SIZE)
            yield f"{path.stem}_{i:02d}.png", crop.resize(size, Image.Resampling.BILINEAR)


def write_manifest(root: Path) -> None:
    images = root / "images"
    image_files = sorted((images / "photos").glob("*.*")) + [
        p for name, _, _ in DETECTOR_SETS for p in sorted((images / name).glob("*.png"))
    ]
    manifest = {
        "models": {
            p.name: sha256_file(p)
            for p in sorted((root / "models").glob("*.*"))
            if p.suffix in (".onnx", ".tflite", ".rknn")
        },
        "images": {str(p.relative_to(images)): sha256_file(p) for p in image_files},
        "dtb": KERNEL_DEB["dest"],
    }
    armhf = root / "dtb" / KERNEL_DEB_ARMHF["dest"] / ".complete"
    if armhf.exists():
        manifest["dtb_armhf"] = KERNEL_DEB_ARMHF["dest"]
    text = json.dumps(manifest, indent=2) + "\n"
    path = root / "manifest.json"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", choices=["models", "images", "dtb", "tools"], help="fetch just one kind"
    )
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
            make_rknn_models(root)
        if args.only in (None, "images"):
            fetch_photos(root)
            make_detector_images(root)
        if args.only in (None, "dtb"):
            fetch_dtbs(root)
            if args.with_armhf:
                fetch_dtbs(root, KERNEL_DEB_ARMHF)
        if args.only in (None, "tools"):
            fetch_tools(root)
        write_manifest(root)
    except (FetchError, OSError) as exc:
        log(f"error: {exc}")
        return 1
    log(f"ready in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
