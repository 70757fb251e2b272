"""A stand-in for the driver boundary of the RKNN backend: the `rknnlite.api` module of
rknn-toolkit-lite2, whose RKNNLite talks to librknnrt.so and the rknpu driver (neither exists
on an x86 test machine, and rknn-toolkit-lite2 has aarch64 wheels only).

It is not Rockchip's code and runs no NPU. It has RKNNLite's names, signatures, constants and
return conventions as rknnlite/api/rknn_lite.py of the 2.5.0 wheel has them: load_rknn and
init_runtime return 0 or -1 (init_runtime: what setting the core mask returned), inference
returns a list of numpy arrays, or None after logging what failed (it never raises), release
returns None. It computes each model with onnxruntime on the model's ONNX original, the way
librknnrt takes its inputs: a 4-D input is NHWC unless data_format says "nchw" (so a caller
that forgets to say so gets wrong numbers, as on a board); an fp16 model's inputs and outputs
pass through float16. An INT8 model is computed in float (its quantization is not emulated).

`RKNNLite.unplug()` makes the NPU go away: init_runtime fails and inference returns None, as
librknnrt does when a job cannot be submitted; `RKNNLite.raises` makes inference raise instead,
and `RKNNLite.hold` (an unset Event) makes it hang until the Event is set.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import types
from pathlib import Path
from typing import Any, ClassVar

import numpy as np


def _rknn_json(path: Path) -> dict:
    """The JSON section of a .rknn file (the layout the backend module describes), read here
    on its own so that the stand-in does not lean on the code under test."""
    data = path.read_bytes()
    version, size = struct.unpack_from("<QQ", data, 8)
    at = (64 if version & 0xFFF >= 2 else 24) + size
    (length,) = struct.unpack_from("<Q", data, at)
    return json.loads(data[at + 8 : at + 8 + length])


class RKNNLite:
    NPU_CORE_AUTO = 0
    NPU_CORE_0 = 1
    NPU_CORE_1 = 2
    NPU_CORE_2 = 4
    NPU_CORE_0_1 = 3
    NPU_CORE_0_1_2 = 7
    NPU_CORE_ALL = 0xFFFF

    originals: ClassVar[dict[str, Path]] = {}  # .rknn path -> its ONNX original
    cores: ClassVar[int] = 3  # the board's NPU cores (RK3588)
    unplugged: ClassVar[bool] = False
    raises: ClassVar[BaseException | None] = None
    # While set to an Event that is not set, inference blocks on it (a hung NPU job).
    hold: ClassVar[threading.Event | None] = None
    made: ClassVar[list[RKNNLite]] = []

    def __init__(self, verbose: bool = False, verbose_file: str | None = None) -> None:
        self.verbose = verbose
        self.rknn_data: bytes | None = None
        self.path: Path | None = None
        self.core_mask: int | None = None
        self.released = False
        self.calls = 0
        self._session: Any = None
        RKNNLite.made.append(self)

    @classmethod
    def unplug(cls) -> None:
        cls.unplugged = True

    @staticmethod
    def _log(message: str) -> None:
        print(f"E {message}", file=sys.stderr)

    def load_rknn(self, path: str, key_path: str | None = None) -> int:
        try:
            self.rknn_data = Path(path).read_bytes()
        except OSError:
            self._log(f"Invalid RKNN model path: {path}")
            return -1
        self.path = Path(path)
        return 0

    def init_runtime(
        self,
        target: str | None = None,
        device_id: str | None = None,
        async_mode: bool = False,
        core_mask: int = NPU_CORE_AUTO,
    ) -> int:
        if self.rknn_data is None or self.path is None:
            self._log("Model is not loaded yet, this interface should be called after load_rknn!")
            return -1
        if RKNNLite.unplugged:
            self._log("RKNN: failed to open rknn device!")
            return -1
        valid = {v for k, v in vars(RKNNLite).items() if k.startswith("NPU_CORE_")}
        if core_mask not in valid or (core_mask not in (0, 0xFFFF) and core_mask >> self.cores):
            self._log(f"RKNN set core mask failed. error code: {core_mask}")
            return -1
        original = RKNNLite.originals.get(str(self.path))
        if original is None:
            self._log(f"Catch exception when init runtime! (no ONNX original for {self.path})")
            return -1
        import onnxruntime as ort

        self.core_mask = core_mask
        self._meta = _rknn_json(self.path)
        self._session = ort.InferenceSession(str(original), providers=["CPUExecutionProvider"])
        return 0

    def _fp16(self) -> bool:
        return not any(
            t["dtype"].get("qnt_type") for t in self._meta["norm_tensor"] if t.get("dtype")
        )

    def _native_shapes(self) -> list[list[int]]:
        tensors = {t["tensor_id"]: t for t in self._meta["norm_tensor"]}
        inputs = sorted(
            (g["left_tensor_id"], tensors[g["right_tensor_id"]]["size"])
            for g in self._meta["graph"]
            if g["left"] == "input"
        )
        return [shape for _, shape in inputs]

    def inference(
        self,
        inputs: list[np.ndarray],
        data_type: Any = None,
        data_format: str | list[str] | None = None,
        inputs_pass_through: Any = None,
        get_frame_id: bool = False,
        reuse_outputs: bool = False,
    ) -> list[np.ndarray] | None:
        if self._session is None:
            self._log("Runtime environment is not inited, please call init_runtime first!")
            return None
        if RKNNLite.raises is not None:
            raise RKNNLite.raises
        hold = RKNNLite.hold
        if hold is not None:
            hold.wait()
        if RKNNLite.unplugged:
            self._log("RKNN: failed to submit!, op id: 0 (the NPU is gone)")
            return None
        if not isinstance(inputs, list):
            self._log("Inputs should be placed in a list, like [img1, img2].")
            return None
        formats = data_format if isinstance(data_format, list) else [data_format] * len(inputs)
        if len(formats) != len(inputs):
            self._log("The lengths of data_format and inputs are not equal.")
            return None
        self.calls += 1
        feeds = {}
        fp16 = self._fp16()
        for spec, array, fmt, native in zip(
            self._session.get_inputs(), inputs, formats, self._native_shapes(), strict=True
        ):
            value = np.asarray(array, dtype=np.float32)
            if value.ndim == 4 and fmt != "nchw":
                # The buffer is taken as NHWC of the model's own NCHW shape and transposed.
                n, c, h, w = native
                value = value.reshape(n, h, w, c).transpose(0, 3, 1, 2)
            if fp16:
                value = value.astype(np.float16).astype(np.float32)
            feeds[spec.name] = np.ascontiguousarray(value)
        outputs = self._session.run(None, feeds)
        if fp16:
            outputs = [o.astype(np.float16) for o in outputs]
        return [np.asarray(o, dtype=np.float32) for o in outputs]

    def get_sdk_version(self) -> str | None:
        if self._session is None:
            return None
        return "librknnrt version: 2.5.0 (stand-in)\ndriver version: 0.9.8"

    def release(self) -> None:
        self._session = None
        self.released = True


def modules() -> dict[str, types.ModuleType]:
    """`rknnlite` and `rknnlite.api` as this stand-in, for sys.modules."""
    package = types.ModuleType("rknnlite")
    api = types.ModuleType("rknnlite.api")
    api.RKNNLite = RKNNLite  # type: ignore[attr-defined]
    package.api = api  # type: ignore[attr-defined]
    return {"rknnlite": package, "rknnlite.api": api}


def install(monkeypatch, originals: dict[Path, Path], cores: int = 3) -> type[RKNNLite]:
    """`rknnlite` and `rknnlite.api` in sys.modules as this stand-in (undone by monkeypatch
    at the test's end), computing each .rknn in `originals` with its ONNX original."""
    monkeypatch.setattr(RKNNLite, "originals", {str(k): v for k, v in originals.items()})
    monkeypatch.setattr(RKNNLite, "cores", cores)
    monkeypatch.setattr(RKNNLite, "unplugged", False)
    monkeypatch.setattr(RKNNLite, "raises", None)
    monkeypatch.setattr(RKNNLite, "hold", None)
    monkeypatch.setattr(RKNNLite, "made", [])
    for name, module in modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    return RKNNLite


def board_root(
    tmp_path: Path,
    *,
    driver: str | None = "drm",
    driver_version: str | None = "0.9.8",
    library: str | None = "2.5.0",
    toolkit: bool = True,
    running: bool = True,
    compatible: tuple[str, ...] = (),
) -> Path:
    """A root as a running board shows it: the vendor rknpu driver's DRM render node
    ("drm"), its misc device ("misc"), mainline's rocket accel node ("rocket") or none; the
    driver's version where MODULE_VERSION puts it; librknnrt.so with its version string; the
    image's Python with rknn-toolkit-lite2. `running` False: an image (no /sys)."""
    root = tmp_path / "root"
    root.mkdir()
    if running:
        (root / "sys" / "devices" / "platform").mkdir(parents=True)
    if driver == "drm":
        device_entry(root, "drm", "renderD129", "RKNPU", "dev/dri/renderD129")
    elif driver == "misc":
        (root / "dev").mkdir()
        (root / "dev" / "rknpu").touch()
    elif driver == "rocket":
        device_entry(root, "accel", "accel0", "rocket", "dev/accel/accel0")
    if driver in ("drm", "misc") and driver_version:
        (root / "sys" / "module" / "rknpu").mkdir(parents=True)
        (root / "sys" / "module" / "rknpu" / "version").write_text(driver_version + "\n")
    if library:
        lib = root / "usr" / "lib" / "librknnrt.so"
        lib.parent.mkdir(parents=True)
        tag = f"librknnrt version: {library} (0ff3f2b7f@2025-09-16T14:46:08)" if library else ""
        lib.write_bytes(b"\x7fELF not a library, a test file\x00" * 1000 + tag.encode() + b"\x00")
    if toolkit:
        (root / "opt/edged/lib/python3.11/site-packages/rknnlite/api").mkdir(parents=True)
    if compatible:
        dt = root / "proc" / "device-tree"
        dt.mkdir(parents=True)
        (dt / "compatible").write_bytes(b"".join(c.encode() + b"\0" for c in compatible))
    return root


def device_entry(root: Path, subsystem: str, name: str, driver: str, node: str) -> None:
    folder = root / "sys" / "class" / subsystem / name / "device"
    folder.mkdir(parents=True)
    os.symlink(f"../../../../bus/platform/drivers/{driver}", folder / "driver")
    (root / node).parent.mkdir(parents=True, exist_ok=True)
    (root / node).touch()
