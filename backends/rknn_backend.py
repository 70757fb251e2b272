"""Rockchip RKNN: .rknn models on the NPU of the RK3562, RK3566/RK3568, RK3576 and RK3588,
through rknn-toolkit-lite2's `RKNNLite` (PyPI `rknn-toolkit-lite2`: aarch64 wheels only) and
Rockchip's runtime library librknnrt.so (not on any package registry: the board's image ships
it, or it is copied to /usr/lib from Rockchip's rknn-toolkit2 repository).

What has to line up, and where edged reads it without opening the device:
- the SoC: the device tree's root `compatible` ("rockchip,rk3588", "rockchip,rk3588s", ...).
  Which NPU each SoC has is the table rknn-toolkit-lite2 carries (rknnlite/config/
  cpu_npu_mapper.yml in the 2.5.0 wheel): RK3566 and RK3568 share one (RKNPU2-LITE), so a
  model built for either runs on both; every other SoC runs only models built for it.
- the driver: Rockchip's vendor kernels (drivers/rknpu) register a platform driver named
  "RKNPU" that makes either a DRM render node (CONFIG_ROCKCHIP_RKNPU_DRM_GEM: DRM driver name
  "rknpu", /dev/dri/renderD*) or a misc device /dev/rknpu (CONFIG_ROCKCHIP_RKNPU_DMA_HEAP).
  Its version: `MODULE_VERSION` gives /sys/module/rknpu/version ("0.9.8", built in or a
  module); with debugfs or procfs on, /sys/kernel/debug/rknpu/version and /proc/rknpu/version
  say "RKNPU driver: v0.9.8". (The DRM version ioctl says the same, but needs the device
  opened; the kernel log's "[drm] Initialized rknpu 0.9.8 ..." line may have rotated away.)
- mainline Linux's `rocket` accel driver (drivers/accel/rocket, 6.18) drives the same NPU but
  only powers it, maps buffers and submits jobs; the rest is Mesa's Gallium driver of the same
  name, used through Mesa's Teflon TFLite delegate. librknnrt speaks only the vendor driver's
  ioctls ("failed to open rknpu module, need to insmod rknpu driver"), so a board on rocket
  has no RKNN candidate: the reason says so.
- librknnrt.so: looked for in the library folders under the root; its version is the
  "librknnrt version: 2.5.0 (...)" string in its bytes, read without loading it (Rockchip's
  own rknn_server reads it the same way: `strings | grep "librknnrt version"`).
- driver against library: Rockchip publishes no table of which librknnrt needs which rknpu
  driver (asked in airockchip/rknn-toolkit2 issues #295, #405 and #465, unanswered by
  Rockchip). What is on record: librknnrt 1.6.0 fails to submit jobs on driver 0.9.3 and
  works on 0.8.2 and 0.9.6 (airockchip/rknn-toolkit2#38); a 2.3.2 runtime needs a newer driver
  than 0.9.2 (#465); rknn-toolkit-lite2 2.5.0 itself asks 0.9.4 and 0.9.7 for its memory
  report and pre-compiled models (EVAL_MEMORY_MIN_DRV_VER, PRECOMPILE_MIN_DRV_VER in
  rknnlite/api/rknn_runtime); RKLLM asks 0.9.7. So MIN_DRIVER below holds librknnrt 2.x to
  driver 0.9.6, the oldest release with no failure reported against 2.x, and the reason names
  both versions.
- the model: the .rknn file says which SoC it is built for (`target_platform`), read below.

Inputs: the session takes what the ONNX original takes (NCHW float32 for a model from ONNX)
and returns float32 outputs, so it is checked against the original like any other variant.
RKNNLite.inference(inputs, data_type, data_format) converts: float32 inputs are quantized (or
cast to float16) by librknnrt with the model's own parameters, and data_format="nchw" tells it
a 4-D input is NCHW (rknn-toolkit-lite2 1.6.0 added that, CHANGELOG; it transposes to the
NPU's NHWC itself); without it a 4-D input is taken as NHWC. Outputs come back as float32
arrays (dequantized by the runtime).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import json
import math
import re
import struct
import sys
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import Candidate, LoadOptions, check_feeds, dist_version, unavailable
from backends.errors import BackendError, ModelError
from backends.formats import FormatFacts, ModelFormat, Signature
from backends.model_info import ModelInfo
from backends.tensors import TensorSpec
from sysconf.hardware import DeviceNode, HardwareFacts
from sysconf.sysroot import SysRoot

NAME = "rknn"
ALIASES = ("rockchip", "rknpu")  # other names config and --backend accept
ORDER = 40  # place among the candidates (backends.REGISTRY)
DEVICE = "NPU"

# -- the .rknn file -----------------------------------------------------------------------------
# The container, as rknn-toolkit2 2.5.0 writes it (checked against the models it made here;
# Netron's reader, source/rknn.js, reads the same layout), little-endian:
#   0 "RKNN"  4 four zero bytes  8 file version u64 (6 from rknn-toolkit2 2.x)  16 size u64
#   24 forty zero bytes (versions 2-6; version 1 has no padding: a 24-byte header)
#   header: the model, `size` bytes: a flatbuffer whose file identifier (bytes 4-8) is "RKNN"
#     for RKNPU2 models ("VPMN" would be an RKNPU1 OpenVX graph, from the older rknn-toolkit)
#   then a JSON length u64 and the JSON: target_platform, norm_tensor (every input and output:
#     name as "url", shape as "size", dtype with qnt_type for a quantized one) and graph
#     (which norm_tensor each input and output is), version (the toolkit's), ori_network_platform.
# An encrypted model starts with "CYPTRKNN" instead; only librknnrt with its key reads it.
MAGIC = b"RKNN"
ENCRYPTED_MAGIC = b"CYPTRKNN"
FLATBUFFER_ID = b"RKNN"
_KNOWN_VERSIONS = range(1, 7)  # the low 12 bits; 0x1001-0x1004 are the same layouts
# Tensor data types in the flatbuffer's Tensor table (field 0): only the two that tell the
# precision, checked against the builds made here: the input's code is 10 in the fp16 build
# and 3 in the int8 one, as the same file's input_json says ("float16" / "int8").
FB_INT8, FB_FLOAT16 = 3, 10
# Original frameworks whose 4-D tensors are NCHW (the others, TFLite and TensorFlow, NHWC).
_NCHW_SOURCES = ("onnx", "pytorch", "caffe", "darknet", "mxnet")


@dataclass(frozen=True)
class RknnTensor:
    spec: TensorSpec  # as the original takes or gives it (the session's interface)
    layout: str  # "nchw" or "nhwc": how a 4-D original tensor is laid out


@dataclass(frozen=True)
class RknnFile:
    version: int  # the container's file version
    target: str | None  # target_platform: "rk3588"
    toolkit: str | None  # the rknn-toolkit2 that built it: "2.5.0"
    npu: str | None  # the flatbuffer's NPU generation: "RKNPU v2", "RKNPU lite"
    inputs: tuple[RknnTensor, ...]
    outputs: tuple[RknnTensor, ...]
    precision: str  # "int8", "fp16", "mixed"
    detail: str


def recognise(data: bytes) -> bool:
    return data[:4] == MAGIC or data[:8] == ENCRYPTED_MAGIC


def read_rknn(path: Path, data: bytes) -> RknnFile:
    """What a .rknn file says about itself; ModelError names the path for a file that is not
    one, is cut short, or is corrupt."""
    if data[:8] == ENCRYPTED_MAGIC:
        raise ModelError(
            f"{path}: an encrypted RKNN model (CYPTRKNN): its target and tensors cannot be read "
            "without its key; give the model unencrypted"
        )
    if data[:4] != MAGIC:
        raise ModelError(f"{path}: not an RKNN model (no RKNN magic at byte 0)")
    if len(data) < 24:
        raise ModelError(f"{path}: truncated RKNN model ({len(data)} bytes; the header is 24+)")
    version, size = struct.unpack_from("<QQ", data, 8)
    if version & 0xFFF not in _KNOWN_VERSIONS or version >> 12 not in (0, 1):
        raise ModelError(
            f"{path}: RKNN file version {version:#x} is not one edged reads (1-6, from "
            "rknn-toolkit2 up to 2.5.0)"
        )
    header = 64 if version & 0xFFF >= 2 and size > 0 else 24
    json_at = header + size
    if len(data) < json_at + 8:
        raise ModelError(
            f"{path}: truncated RKNN model: its header says the model is {size} bytes after "
            f"byte {header}, the file has {len(data)} bytes"
        )
    (json_size,) = struct.unpack_from("<Q", data, json_at)
    end = json_at + 8 + json_size
    if len(data) < end:
        raise ModelError(
            f"{path}: truncated RKNN model: its JSON section ends at byte {end}, the file "
            f"has {len(data)} bytes"
        )
    try:
        meta = json.loads(data[json_at + 8 : end])
    except RecursionError:
        raise _corrupt(path, "its JSON section is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(path, f"its JSON section does not parse ({exc})") from None
    if not isinstance(meta, dict):
        raise ModelError(f"{path}: corrupt RKNN model: its JSON section is not an object")
    body = data[header:json_at]
    fb = _read_flatbuffer(path, body) if body[4:8] == FLATBUFFER_ID else None
    attrs = fb.attrs if fb else {}
    source = str(meta.get("ori_network_platform") or meta.get("network_platform") or "")
    default_layout = "nchw" if source.lower() in _NCHW_SOURCES else "nhwc"
    inputs, outputs = _json_tensors(path, meta, attrs, default_layout)
    targets = meta.get("target_platform")
    # rknn-toolkit2 builds for one target_platform (config() takes one); the JSON lists it.
    target = targets[0] if isinstance(targets, list) and targets else (fb and fb.runtime)
    target = str(target).lower() if target else None
    toolkit = meta.get("version")
    precision, counts = _precision(meta, fb)
    built = f"for {target}" if target else "target not stated"
    by = f" by rknn-toolkit2 {toolkit}" if toolkit else ""
    return RknnFile(
        int(version),
        target,
        str(toolkit) if toolkit else None,
        fb.npu if fb else None,
        inputs,
        outputs,
        precision,
        f"RKNN {precision} ({counts}), built {built}{by}",
    )


def read(path: Path, data: bytes) -> FormatFacts:
    model = read_rknn(path, data)
    return FormatFacts(model.precision, model.detail, target=model.target)


def signature(path: Path, data: bytes) -> Signature:
    model = read_rknn(path, data)
    return [t.spec for t in model.inputs], [t.spec for t in model.outputs]


def _corrupt(path: Path, what: str) -> ModelError:
    return ModelError(f"{path}: corrupt RKNN model: {what}")


def _json_tensors(
    path: Path, meta: dict, attrs: Mapping[str, Any], default_layout: str
) -> tuple[tuple[RknnTensor, ...], tuple[RknnTensor, ...]]:
    """Inputs and outputs in order: the JSON's `graph` says which `norm_tensor` each is; the
    flatbuffer's attrs (when there) say the original's dtype and layout."""
    try:
        tensors = {t["tensor_id"]: t for t in meta.get("norm_tensor") or []}
        found: dict[str, list[tuple[int, dict]]] = {"input": [], "output": []}
        for entry in meta.get("graph") or []:
            if entry.get("left") in found and entry.get("right") == "norm_tensor":
                norm = tensors[entry["right_tensor_id"]]
                found[entry["left"]].append((int(entry["left_tensor_id"]), norm))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _corrupt(path, f"its JSON's graph and norm_tensor do not match ({exc!r})") from None
    if not found["input"] or not found["output"]:
        raise _corrupt(path, "its JSON names no input or no output tensor")

    def described(entry: dict) -> RknnTensor:
        name, size = entry.get("url"), entry.get("size")
        if not isinstance(name, str) or not isinstance(size, list):
            raise _corrupt(path, f"a norm_tensor without a name or shape: {entry!r:.200}")
        if not all(isinstance(d, int) for d in size):
            raise _corrupt(path, f"tensor {name!r} has shape {size!r}")
        raw = attrs.get(name)
        attr: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
        dtype, layout = attr.get("dtype"), attr.get("layout")
        return RknnTensor(
            TensorSpec(
                name,
                dtype if isinstance(dtype, str) else "float32",
                tuple(d if d >= 0 else None for d in size),
            ),
            layout if layout in ("nchw", "nhwc") else default_layout,
        )

    inputs, outputs = (
        tuple(described(t) for _, t in sorted(found[kind], key=lambda pair: pair[0]))
        for kind in ("input", "output")
    )
    return inputs, outputs


def _precision(meta: dict, fb: _Flatbuffer | None) -> tuple[str, str]:
    """int8, fp16 or mixed, from the compiled graph's tensor types; without a flatbuffer,
    from the JSON's inputs (a quantized model takes int8 in: its norm_tensor's qnt_type)."""
    if fb is not None and fb.types:
        ints, halves = fb.types[FB_INT8], fb.types[FB_FLOAT16]
        counts = f"{ints} int8 and {halves} float16 tensors"
        if ints and ints >= 4 * halves:
            return "int8", counts
        if halves and halves >= 4 * ints:
            return "fp16", counts
        return ("mixed" if ints and halves else "fp16"), counts
    quantized = any(
        isinstance(t, dict)
        and isinstance(t.get("dtype"), dict)
        and t["dtype"].get("qnt_type") in ("int8", "uint8", "int16", "int4")
        for t in meta.get("norm_tensor") or []
    )
    return ("int8" if quantized else "fp16"), "from its inputs' quantization"


@dataclass(frozen=True)
class _Flatbuffer:
    npu: str | None
    runtime: str | None
    attrs: Mapping[str, Any]
    types: Counter


def _read_flatbuffer(path: Path, body: bytes) -> _Flatbuffer:
    """The fields of the compiled model that edged uses. Field numbers as Netron names them
    (source/rknn-schema.js), checked against the real files: Model 1 the NPU generation
    ("RKNPU v2"), 2 the graphs, 3 a Python literal with each input's and output's original
    dtype, shape and layout ("attrs"), 8 the target ("rk3588"); Graph 0 its tensors; Tensor 0
    the data type. Any offset outside the section is a corrupt (or cut) file."""
    fb = _Tables(body)
    try:
        model = fb.root()
        npu = fb.string(model, 1)
        runtime = fb.string(model, 8)
        literal = fb.string(model, 3)
        types: Counter = Counter()
        for graph in fb.tables(model, 2):
            for tensor in fb.tables(graph, 0):
                types[fb.int8(tensor, 0)] += 1
    except IndexError:
        raise _corrupt(path, "an offset in its compiled model lies outside the file") from None
    except ValueError as exc:
        raise _corrupt(path, str(exc)) from None
    return _Flatbuffer(npu, runtime, _attrs(literal), types)


def _attrs(literal: str | None) -> Mapping[str, Any]:
    """The original's tensors from the metadata literal; {} when it is absent or unreadable
    (dtype and layout then default: it only refines what the JSON says)."""
    if not literal or len(literal) > 1 << 20:
        return {}
    try:
        value = ast.literal_eval(literal)  # a Python literal (True, single quotes), not JSON
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return {}
    attrs = value.get("attrs") if isinstance(value, dict) else None
    return attrs if isinstance(attrs, dict) else {}


class _Tables:
    """A flatbuffer read by hand (its tables, vtables, vectors and strings), every read
    bounds-checked: there is no published schema to generate code from."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        # Vector entries visited, at most one per 4 bytes of the section: a crafted file
        # whose entries all point at one table would be walked count x count times.
        self.budget = len(buf) // 4

    def _u(self, pos: int, width: int, signed: bool = False) -> int:
        if not 0 <= pos <= len(self.buf) - width:
            raise IndexError(pos)
        return int.from_bytes(self.buf[pos : pos + width], "little", signed=signed)

    def root(self) -> int:
        return self._u(0, 4)

    def _field(self, table: int, index: int) -> int:
        vtable = table - self._u(table, 4, signed=True)
        size = self._u(vtable, 2)
        slot = 4 + 2 * index
        return self._u(vtable + slot, 2) if slot + 2 <= size else 0

    def _target(self, table: int, index: int) -> int | None:
        off = self._field(table, index)
        if not off:
            return None
        ref = table + off
        return ref + self._u(ref, 4)

    def int8(self, table: int, index: int) -> int:
        off = self._field(table, index)
        return self._u(table + off, 1, signed=True) if off else 0

    def string(self, table: int, index: int) -> str | None:
        at = self._target(table, index)
        if at is None:
            return None
        length = self._u(at, 4)
        if at + 4 + length > len(self.buf):
            raise IndexError(at)
        return self.buf[at + 4 : at + 4 + length].decode("utf-8", "replace")

    def tables(self, table: int, index: int) -> list[int]:
        at = self._target(table, index)
        if at is None:
            return []
        count = self._u(at, 4)
        if at + 4 + 4 * count > len(self.buf):
            raise IndexError(at)
        self.budget -= count
        if self.budget < 0:
            raise ValueError("more vector entries than its compiled model holds (shared tables)")
        return [at + 4 + 4 * i + self._u(at + 4 + 4 * i, 4) for i in range(count)]


FORMATS = (
    ModelFormat(
        "rknn",
        "RKNN",
        (".rknn",),
        "rknn",
        read,
        recognise=recognise,
        not_it="no RKNN magic at byte 0",
        signature=signature,
    ),
)
DEVICES = (DeviceNode("npu", "/dev/rknpu", "Rockchip NPU (rknpu)", "misc"),)

# -- the SoC, its NPU cores and the core mask ---------------------------------------------------


@dataclass(frozen=True)
class Soc:
    name: str  # as target_platform spells it: "rk3588"
    npu: str  # the NPU (rknnlite's cpu_npu_mapper.yml): a model runs where this matches
    cores: int


SOCS = {
    "rockchip,rk3562": Soc("rk3562", "RKNPU2-T4", 1),
    "rockchip,rk3566": Soc("rk3566", "RKNPU2-LITE", 1),
    "rockchip,rk3568": Soc("rk3568", "RKNPU2-LITE", 1),
    "rockchip,rk3576": Soc("rk3576", "RKNPU2-F2", 2),
    "rockchip,rk3588": Soc("rk3588", "RKNPU2-V2", 3),
    "rockchip,rk3588s": Soc("rk3588", "RKNPU2-V2", 3),  # the same die, fewer I/Os
}
NPU_OF = {soc.name: soc.npu for soc in SOCS.values()}
# Rockchip SoCs whose NPU is the first generation (RKNPU1, VeriSilicon-based): Rockchip's
# older rknn-toolkit and librknn_api run those, not librknnrt.
RKNPU1 = ("rockchip,rk3399pro", "rockchip,rk1808", "rockchip,rv1109", "rockchip,rv1126")
# RKNNLite's core_mask constants (rknnlite/api/rknn_lite.py) by the cores they name. Only
# these combinations exist: one core, cores 0+1, or all three.
CORE_MASKS = {
    (0,): "NPU_CORE_0",
    (1,): "NPU_CORE_1",
    (2,): "NPU_CORE_2",
    (0, 1): "NPU_CORE_0_1",
    (0, 1, 2): "NPU_CORE_0_1_2",
}
AUTO = "NPU_CORE_AUTO"


def soc_of(hw: HardwareFacts) -> Soc | None:
    return next((SOCS[c] for c in hw.soc_compatible if c in SOCS), None)


def core_mask(soc: Soc, cores: Sequence[int] | None) -> str:
    """The name of RKNNLite's core_mask constant for `cores` (the per-model `npu_cores`) on
    `soc`; NPU_CORE_AUTO when none are given. ValueError says why a set cannot be run."""
    if not cores:
        return AUTO
    wanted = tuple(sorted(set(cores)))
    outside = [c for c in wanted if not 0 <= c < soc.cores]
    if outside:
        have = "one NPU core (0)" if soc.cores == 1 else f"NPU cores 0-{soc.cores - 1}"
        raise ValueError(f"{soc.name.upper()} has {have}; there is no core {outside[0]}")
    if soc.cores == 1:
        # librknnrt takes a core mask on the multi-core NPUs only ("The core_mask is only
        # supported by ... Please do not set this parameter on other platforms").
        return AUTO
    if wanted not in CORE_MASKS:
        raise ValueError(
            f"cores {list(wanted)} cannot be run together: RKNNLite runs one core, cores "
            "[0, 1] or cores [0, 1, 2]"
        )
    return CORE_MASKS[wanted]


# -- the driver, the library and rknn-toolkit-lite2 ---------------------------------------------

LIBRARY = "librknnrt.so"
# Where librknnrt.so is looked for (Rockchip's instructions put it in /usr/lib).
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/lib", "/usr/local/lib")
_LIBRARY_VERSION = re.compile(rb"librknnrt version: ([0-9]+\.[0-9]+\.[0-9]+[0-9A-Za-z.+-]*)")
DRIVER_VERSION_FILES = (
    "/sys/module/rknpu/version",  # MODULE_VERSION: "0.9.8"
    "/sys/kernel/debug/rknpu/version",  # "RKNPU driver: v0.9.8" (debugfs, root only)
    "/proc/rknpu/version",  # the same, with CONFIG_ROCKCHIP_RKNPU_PROC_FS
)
_DRIVER_VERSION = re.compile(r"v?([0-9]+)\.([0-9]+)\.([0-9]+)")
LOAD_FILES = ("/sys/kernel/debug/rknpu/load", "/proc/rknpu/load")
# librknnrt major version -> the oldest rknpu driver it is held to (see the module docstring).
MIN_DRIVER = {2: (0, 9, 6)}
# Where the image's Python keeps its packages (an image root: rknn-toolkit-lite2 in it).
SITE_DIRS = (
    "/usr/lib/python3*/*-packages",
    "/usr/local/lib/python3*/*-packages",
    "/opt/*/lib/python3*/site-packages",
    "/home/*/.local/lib/python3*/site-packages",
    "/root/.local/lib/python3*/site-packages",
)


@dataclass(frozen=True)
class Stack:
    """What the board has of the RKNN stack; None where it was not looked at (a .dtb alone,
    or a driver in an image, which only the running board shows)."""

    driver: str | None  # "rknpu", "rocket", "" (none), None (not checked)
    node: str | None
    driver_version: str | None
    library: str | None  # its path; "" when looked for and not found
    library_version: str | None
    toolkit: bool | None  # rknn-toolkit-lite2 importable (live) or in the image


def stack_facts(hw: HardwareFacts) -> Stack:
    if hw.offline and hw.root == "/":  # a .dtb alone: this machine is not the board
        return Stack(None, None, None, None, None, None)
    root = SysRoot.at(hw.root)
    # A root with a populated /sys is a running board (or a copy of one): its devices and
    # modules count. An image's /sys is empty: its kernel's driver shows only when it runs.
    running = not hw.offline or root.exists("/sys/devices")
    driver, node, version = _driver(hw, root) if running else (None, None, None)
    library, library_version = _library(root)
    toolkit = _toolkit_here() if not hw.offline else _toolkit_in(root)
    return Stack(driver, node, version, library, library_version, toolkit)


def _driver(hw: HardwareFacts, root: SysRoot) -> tuple[str, str | None, str | None]:
    rknpu = [a for a in hw.accelerators if (a.driver or "").lower() == "rknpu"]
    rknpu += [a for a in hw.accelerators if a.node == "/dev/rknpu" and a not in rknpu]
    version = next(
        (
            ".".join(match.groups())
            for path in DRIVER_VERSION_FILES
            if (match := _DRIVER_VERSION.search(root.read_line(path) or ""))
        ),
        None,
    )
    if rknpu:
        return "rknpu", rknpu[0].node, version
    rocket = [a for a in hw.accelerators if a.driver == "rocket"]
    if rocket:
        return "rocket", rocket[0].node, None
    return "", None, version


def _library(root: SysRoot) -> tuple[str, str | None]:
    for folder in LIBRARY_DIRS:
        path = root.path(f"{folder}/{LIBRARY}")
        try:
            stat = path.stat()
        except OSError:
            continue
        return f"{folder}/{LIBRARY}", _library_version(str(path), stat.st_mtime_ns, stat.st_size)
    return "", None


@functools.lru_cache(maxsize=8)
def _library_version(path: str, mtime_ns: int, size: int) -> str | None:
    """The version string librknnrt embeds (about 7 MB read once per file state: candidates
    are listed on every hot-plug and `edgectl backends`)."""
    try:
        match = _LIBRARY_VERSION.search(Path(path).read_bytes())
    except OSError:
        return None
    return match.group(1).decode() if match else None


def _toolkit_here() -> bool:
    # find_spec of a top-level name locates it without importing it.
    return importlib.util.find_spec("rknnlite") is not None


def _toolkit_in(root: SysRoot) -> bool:
    return any(True for pattern in SITE_DIRS for _ in root.glob(f"{pattern}/rknnlite/api"))


def _version(text: str | None) -> tuple[int, ...] | None:
    match = _DRIVER_VERSION.match(text or "")
    return tuple(int(g) for g in match.groups()) if match else None


def stack_problems(stack: Stack, offline: bool) -> list[str]:
    """Why the stack cannot run RKNN models, each with what was looked for; [] when it can
    (or was not looked at)."""
    problems = []
    if stack.driver == "rocket":
        problems.append(
            f"the NPU is driven by mainline Linux's rocket driver ({stack.node}), which "
            "librknnrt cannot use: it needs Rockchip's vendor rknpu driver (a vendor kernel); "
            "rocket is used through Mesa's Teflon TFLite delegate instead"
        )
    elif stack.driver == "":
        problems.append(
            "no rknpu driver: neither /dev/rknpu nor a DRM render node of the RKNPU driver "
            "(/dev/dri/renderD*) is there (Rockchip's vendor kernel has it: "
            "CONFIG_ROCKCHIP_RKNPU)"
        )
    if stack.library == "":
        where = "the image" if offline else "this system"
        problems.append(
            f"{LIBRARY} is not in {where}, looked for in {', '.join(LIBRARY_DIRS)} (it is not "
            "on PyPI: Rockchip's rknn-toolkit2 repository has it, under rknpu2/runtime/Linux/"
            "librknn_api/aarch64)"
        )
    if stack.toolkit is False:
        problems.append(
            "rknn-toolkit-lite2 is not in the image's Python"
            if offline
            else "rknn-toolkit-lite2 is not installed (pip install rknn-toolkit-lite2; "
            "aarch64 only)"
        )
    library, driver = _version(stack.library_version), _version(stack.driver_version)
    if library and driver and stack.driver == "rknpu":
        needed = MIN_DRIVER.get(library[0])
        if needed and driver < needed:
            want = ".".join(map(str, needed))
            problems.append(
                f"rknpu driver {stack.driver_version} is older than librknnrt "
                f"{stack.library_version} is known to work with (driver {want} or later; "
                f"librknnrt {library[0]}.x is reported failing on older ones)"
            )
    return problems


def model_problems(soc: Soc, model: ModelInfo | None) -> list[str]:
    if model is None:
        return []
    if model.format != "rknn":
        return [f"RKNN runs only .rknn models (made with rknn-toolkit2), not {model.format}"]
    if model.target is None:
        return []  # the file does not say; librknnrt checks at load
    npu = NPU_OF.get(model.target)
    if npu == soc.npu:
        return []
    theirs = f" ({npu})" if npu else ""
    return [
        f"the model is built for {model.target}{theirs}, this board is {soc.name} ({soc.npu}): "
        f"build it again with rknn-toolkit2, config(target_platform='{soc.name}')"
    ]


def _not_rockchip(hw: HardwareFacts) -> str:
    old = next((c for c in hw.soc_compatible if c in RKNPU1), None)
    if old:
        return (
            f"{old.split(',')[1].upper()} has a first-generation Rockchip NPU (RKNPU1): "
            "Rockchip's older rknn-toolkit and librknn_api run it, not librknnrt"
        )
    said = ", ".join(hw.soc_compatible[:3]) if hw.soc_compatible else "no device tree"
    wanted = ", ".join(dict.fromkeys(SOCS))
    return f"not a Rockchip NPU SoC (looked for {wanted} in the device tree; it says: {said})"


class RknnBackend:
    name = NAME
    formats = ("rknn",)

    def version(self) -> str | None:
        return dist_version("rknn-toolkit-lite2")

    def candidates(self, hw: HardwareFacts, model: ModelInfo | None) -> list[Candidate]:
        soc = soc_of(hw)
        if soc is None:
            return [unavailable(NAME, DEVICE, _not_rockchip(hw))]
        stack = stack_facts(hw)
        image = hw.offline and hw.root != "/"
        problems = stack_problems(stack, image) + model_problems(soc, model)
        label = f"Rockchip {soc.name.upper()} NPU"
        if problems:
            return [unavailable(NAME, DEVICE, f"{label}: {'; '.join(problems)}")]
        cores = "1 core" if soc.cores == 1 else f"{soc.cores} cores"
        note = f"{label} ({soc.npu}, {cores})"
        if stack.driver is None and stack.library is None:
            note += " (driver, librknnrt and rknn-toolkit-lite2 not checked: no --root image)"
        elif stack.driver is None:
            note += f" (librknnrt {stack.library_version or '?'} in the image; driver not checked)"
        else:
            note += (
                f", rknpu {stack.driver_version or '?'}, librknnrt {stack.library_version or '?'}"
            )
        options = {"soc": soc.name, "cores": soc.cores, "npu": soc.npu, "root": hw.root}
        return [Candidate(NAME, DEVICE, "model", True, "", options, note=note)]

    def load(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> RknnSession:
        return RknnSession(model, candidate, options)

    def reference(self, model: ModelInfo) -> Candidate | None:
        return None  # NPU only: the family's original (ONNX) is the reference

    def board_devices(self, hw: HardwareFacts) -> list[str]:
        """The board's RKNPU2, from its device tree (offline plans ask this)."""
        return [DEVICE] if soc_of(hw) is not None else []


# -- the session --------------------------------------------------------------------------------


def _import():
    from rknnlite.api import RKNNLite  # type: ignore[import-not-found]

    return RKNNLite


def _message(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


class RknnSession:
    """One model on the NPU. RKNNLite runs an inference as set_inputs, run and get_outputs on
    one context, so concurrent run() calls of one session take turns (a lock of this session
    only, held for one inference)."""

    def __init__(self, model: ModelInfo, candidate: Candidate, options: LoadOptions) -> None:
        self.model = model
        self.candidate = candidate
        soc = next((s for s in SOCS.values() if s.name == candidate.options.get("soc")), None)
        if soc is None:
            raise BackendError(f"{model.name}: candidate {candidate.key} names no Rockchip SoC")
        cores = getattr(options, "npu_cores", None)
        try:
            self._mask = core_mask(soc, cores)
        except ValueError as exc:
            raise BackendError(f"{model.name}: npu_cores {list(cores or ())}: {exc}") from None
        described = read_rknn(model.path, model.path.read_bytes())
        self.inputs = [t.spec for t in described.inputs]
        self.outputs = [t.spec for t in described.outputs]
        # "nchw" when the original takes a 4-D NCHW input; the runtime transposes it.
        nchw = any(t.layout == "nchw" and len(t.spec.shape) == 4 for t in described.inputs)
        self._format = "nchw" if nchw else None
        self._soc = soc
        self._root = SysRoot.at(candidate.options.get("root") or "/")
        self._lock = threading.Lock()
        try:
            rknnlite = _import()
        except ImportError as exc:
            raise BackendError(f"{model.name}: rknn-toolkit-lite2 does not import: {exc}") from None
        # rknn-toolkit-lite2 prints some of its loading messages (a missing device or
        # library, "It is detected that some necessary files are missing") on stdout, which
        # is edgectl's --json output: they go to stderr with its other messages.
        try:
            with contextlib.redirect_stdout(sys.stderr):
                self._rk = rknnlite(verbose=False)
                if self._rk.load_rknn(str(model.path)) != 0:
                    raise BackendError(f"{model.name}: RKNNLite.load_rknn({model.path}) failed")
                ret = self._rk.init_runtime(core_mask=getattr(rknnlite, self._mask))
                if ret != 0:
                    raise BackendError(
                        f"{model.name}: RKNNLite.init_runtime failed on {soc.name} "
                        f"({self._mask}): returned {ret} (librknnrt says why on stderr)"
                    )
                self._sdk = self._rk.get_sdk_version()
        except BackendError:
            self._release()
            raise
        except Exception as exc:  # the runtime's own errors, from its Cython modules
            self._release()
            raise BackendError(
                f"{model.name}: RKNNLite failed to load it: {_message(exc)}"
            ) from None
        self._load_file, self._temperature_file = self._sensor_files()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.inputs, feeds, self.model.name)
        arrays = [np.ascontiguousarray(feeds[s.name]) for s in self.inputs]
        with self._lock:
            if self._rk is None:
                raise BackendError(f"{self.model.name}: the RKNN session is closed")
            try:
                values = self._rk.inference(inputs=arrays, data_format=self._format)
            except Exception as exc:
                raise BackendError(
                    f"{self.model.name}: RKNNLite.inference failed: {_message(exc)}"
                ) from None
        if values is None:
            raise BackendError(
                f"{self.model.name}: RKNNLite.inference failed (it returned None: the NPU is "
                "gone or hung, or librknnrt refused the inputs; it says why on stderr)"
            )
        if len(values) != len(self.outputs):
            raise BackendError(
                f"{self.model.name}: RKNNLite returned {len(values)} outputs, the model has "
                f"{len(self.outputs)}"
            )
        return {
            spec.name: self._output(spec, v) for spec, v in zip(self.outputs, values, strict=True)
        }

    def _output(self, spec: TensorSpec, value: Any) -> np.ndarray:
        array = np.asarray(value)
        if array.dtype.name != spec.dtype:
            array = array.astype(spec.dtype)
        if None not in spec.shape and array.shape != spec.shape:
            if array.size != math.prod(d for d in spec.shape if d is not None):
                raise BackendError(
                    f"{self.model.name}: output {spec.name!r} came back with shape "
                    f"{array.shape}, the model says {spec.shape}"
                )
            array = array.reshape(tuple(d for d in spec.shape if d is not None))
        return array

    def info(self) -> dict[str, Any]:
        return {
            "precision": self.model.precision,  # what the compiled graph computes in
            "device": f"{self._soc.name} NPU",
            "core_mask": self._mask,
            "runtime": self._sdk,
        }

    def sensors(self) -> dict[str, float]:
        """The NPU's load (its driver's last one-second sample, as a 0-1 ratio: the mean over
        its cores, and each core's) and the NPU thermal zone's temperature, where readable."""
        readings: dict[str, float] = {}
        try:
            if self._load_file:
                loads = _loads(self._root.read_line(self._load_file) or "")
                if loads:
                    readings["load_ratio"] = sum(loads) / len(loads)
                    if len(loads) > 1:
                        readings.update({f"core{i}_load_ratio": v for i, v in enumerate(loads)})
            if self._temperature_file:
                millis = self._root.read_line(self._temperature_file)
                if millis and millis.lstrip("-").isdigit():
                    readings["temperature_celsius"] = int(millis) / 1000  # sysfs: millidegrees
        except Exception:  # telemetry must never break on a sensor
            return readings
        return readings

    def _sensor_files(self) -> tuple[str | None, str | None]:
        load = next((p for p in LOAD_FILES if self._root.read_line(p)), None)
        temperature = next(
            (
                zone.removesuffix("/type") + "/temp"
                for zone in self._root.glob("/sys/class/thermal/thermal_zone*/type")
                if self._root.read_line(zone) in ("npu-thermal", "npu_thermal")
            ),
            None,
        )
        return load, temperature

    def _release(self) -> None:
        rk, self._rk = getattr(self, "_rk", None), None
        if rk is not None:
            with contextlib.suppress(Exception):  # releasing a context whose device is gone
                rk.release()

    def close(self) -> None:
        with self._lock:
            self._release()


def _loads(text: str) -> list[float]:
    """Per-core loads from the driver's "NPU load:  Core0: 12%, Core1:  0%," (one core:
    "NPU load:  5%"). It prints with "%2.d", so a zero load is blank before the "%"."""
    if not text.startswith("NPU load:"):
        return []
    cores = re.findall(r"Core\d+:\s*(\d*)%", text)
    if not cores:
        cores = re.findall(r"(\d*)%", text)
    return [int(c or 0) / 100 for c in cores]  # percent -> ratio, the base unit


BACKEND = RknnBackend()
