"""A .rknn model on a Rockchip NPU through rknn-toolkit-lite2's RKNNLite (the backend and its
candidates: `backends.rknn`)."""

from __future__ import annotations

import contextlib
import math
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from backends.base import Candidate, check_feeds
from backends.errors import BackendError
from backends.model_info import ModelInfo
from backends.rknn.rknn_file import read_rknn
from backends.rknn.soc import Soc
from backends.rknn.stack import LOAD_FILES
from backends.tensors import TensorSpec
from sysconf.sysroot import SysRoot


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

    def __init__(self, model: ModelInfo, candidate: Candidate, soc: Soc, mask: str) -> None:
        """`mask`: the name of RKNNLite's core_mask constant (`soc.core_mask`)."""
        self.model = model
        self.candidate = candidate
        self._mask = mask
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
