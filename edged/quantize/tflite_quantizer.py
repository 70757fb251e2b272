"""Full-integer TFLite from a float .tflite: LiteRT's own post-training quantizer.

Which library, measured on MediaPipe's face and palm detectors (ai-edge-litert 2.3.0,
ai-edge-quantizer 0.10.0, this project's calibration images):

* LiteRT's calibration wrapper (the module TensorFlow's converter calibrates with, shipped
  inside ai-edge-litert) made full-integer models that load and run on XNNPACK and on the
  built-in kernels, int8 or uint8 at the inputs and outputs, per-channel weights, and
  Ethos-U's Vela put every operator on the NPU. It is a private module: `check_wrapper`
  checks it is the one tested (pyproject pins ai-edge-litert for the quantize extra), and the
  tests run it on both models.
* ai-edge-quantizer 0.10.0 refuses a model without a signature def (MediaPipe's have none);
  with one added, its static int8 recipe gave conv weights non-zero zero points, and the
  model failed to load ("conv.cc: zero_point != 0"). Not used.

Both need MediaPipe's float16 weights widened first (`tflite_graph.fold_float16`), and
standalone RELUs are folded into the op before them (`tflite_graph.fuse_activations`). The
wrapper calibrates min/max ranges once (`Calibrate` returns the model with the ranges
recorded, cached in the work folder); each recipe is then quantized from that by a fresh
wrapper, which gives the same bytes as quantizing straight after calibration (checked).
Mixed precision puts the named compute ops back in float afterwards
(`tflite_graph.keep_float`); a sensitivity probe quantizes one op alone (the wrapper's
single-op mode, float inputs and outputs).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from backends import ModelError
from backends.model_info import inspect_model, read_model_file, signature, write_model_file
from edged.quantize import tflite_graph
from edged.quantize.calibration import Samples
from edged.quantize.defaults import IO_TYPES as IO_NAMES
from edged.quantize.recipes import Progress, QuantizeError, Recipe
from edged.selection.accuracy import ScoreMap

TESTED_LITERT = "2.3.0"  # the ai-edge-litert whose private calibration wrapper is tested
IO_TYPES = dict(zip(IO_NAMES, (np.int8, np.uint8, np.float32), strict=True))
# A score logit's calibrated range is clipped to +-this (sigmoid(-10) < 5e-5).
LOGIT_CLIP = 10.0
RECIPES = (Recipe("full", None, scheme="s8s8"),)  # int8 weights per channel, int8 activations


def _wrapper():
    """LiteRT's calibration wrapper, or a QuantizeError saying what is missing."""
    try:
        from ai_edge_litert import _pywrap_tensorflow_lite_calibration_wrapper as wrapper
    except ImportError as exc:
        raise QuantizeError(
            f"quantizing a .tflite needs ai-edge-litert=={TESTED_LITERT} and its calibration "
            f"wrapper ({exc}); pip install 'edged[quantize]'"
        ) from None
    check_wrapper(wrapper)
    return wrapper


def check_wrapper(wrapper) -> None:
    """The private API this module calls, as ai-edge-litert 2.3.0 has it: a changed one is
    a clear error, not a crash in native code."""
    from importlib.metadata import PackageNotFoundError, version

    cls = getattr(wrapper, "CalibrationWrapper", None)
    needed = ("Prepare", "FeedTensor", "Calibrate", "QuantizeModel")
    if cls is None or not all(hasattr(cls, name) for name in needed):
        raise QuantizeError(
            "this ai-edge-litert's calibration wrapper lacks "
            f"{', '.join(n for n in needed if cls is None or not hasattr(cls, n))}; "
            f"edged is tested with ai-edge-litert=={TESTED_LITERT}"
        )
    doc = cls.QuantizeModel.__doc__ or ""
    if "arg6: bool" not in doc:
        try:
            have = version("ai-edge-litert")
        except PackageNotFoundError:
            have = "unknown"
        raise QuantizeError(
            f"ai-edge-litert {have}: its calibration wrapper's QuantizeModel is not the one "
            f"edged calls (tested with {TESTED_LITERT})"
        )


@contextlib.contextmanager
def _native_output_to_stderr() -> Iterator[None]:
    """The wrapper prints from native code ("fully_quantize: 0, inference_type: 6 ...")
    straight to fd 1; stdout stays for --json."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class TfliteQuantizer:
    """Quantizes one float .tflite with any recipe, calibrating once."""

    reference_target = "litert:CPU"  # the float model on the built-in kernels

    def __init__(
        self,
        model_path: Path,
        workdir: Path,
        calibration: Samples,
        method: str,
        io: str = "int8",
        progress: Progress | None = None,
        scores: ScoreMap | None = None,
    ) -> None:
        if method != "minmax":
            raise QuantizeError(
                f"calibration method {method!r}: LiteRT's quantizer calibrates min/max ranges "
                "only; use --method minmax for a .tflite"
            )
        if io not in IO_TYPES:
            raise QuantizeError(f"--io {io!r}: use one of {', '.join(IO_TYPES)}")
        info = inspect_model(model_path)
        if info.precision == "int8":
            raise ModelError(f"{model_path}: already a full-integer model; give its float original")
        self.model_path = Path(model_path)
        self.workdir = workdir
        self.calibration = calibration
        self.io = io
        self.progress = progress
        self.scores = scores
        self.clipped: list[str] = []  # tensors whose calibrated range was clipped
        self._wrapper = _wrapper()
        folded, self.folded = tflite_graph.fold_float16(read_model_file(model_path))
        prepared, self.fused = tflite_graph.fuse_activations(folded)
        self.prepared = workdir / "prepared.tflite"
        self.prepared.write_bytes(prepared)
        self._calibrated: bytes | None = None

    def compute_nodes(self) -> list[str]:
        return tflite_graph.compute_ops(self.prepared.read_bytes())

    def data_producers(self, nodes) -> list[str]:
        return []  # keep_float dequantizes a kept op's inputs itself

    def calibrated(self) -> bytes:
        """The prepared model with the calibration set's min/max ranges recorded."""
        if self._calibrated is not None:
            return self._calibrated
        data = self.prepared.read_bytes()
        inputs, _ = signature(self.prepared) or ([], [])
        names = [spec.name for spec in inputs]
        with _native_output_to_stderr():
            try:
                wrapper = self._wrapper.CalibrationWrapper(data, [], [])
            except (ValueError, RuntimeError) as exc:
                raise QuantizeError(
                    f"{self.model_path}: LiteRT's calibrator cannot load it: "
                    f"{str(exc).splitlines()[0]}"
                ) from None
            shapes = None
            for index, feed in enumerate(self.calibration.feeds):
                if self.progress:
                    self.progress("calibrate", index, len(self.calibration.feeds))
                arrays = [np.ascontiguousarray(feed[name], dtype=np.float32) for name in names]
                if [list(a.shape) for a in arrays] != shapes:
                    # Prepare again for another input shape (images of several sizes).
                    shapes = [list(a.shape) for a in arrays]
                    wrapper.Prepare(shapes)
                try:
                    wrapper.FeedTensor(arrays)
                except (ValueError, RuntimeError) as exc:
                    raise QuantizeError(
                        f"calibration sample {self.calibration.sources[index]} does not fit "
                        f"the model: {str(exc).splitlines()[0]}"
                    ) from None
            calibrated = bytes(wrapper.Calibrate())
        if self.scores is not None and self.scores.logits:
            try:
                calibrated, self.clipped = tflite_graph.clip_ranges(
                    calibrated, self.scores.output, -LOGIT_CLIP, LOGIT_CLIP
                )
            except tflite_graph.GraphError as exc:
                raise QuantizeError(f"--scores: {exc}") from None
        self._calibrated = calibrated
        return self._calibrated

    def quantize(self, recipe: Recipe, keep: bool = True) -> Path:
        out = self.workdir / f"{recipe.label}.tflite"
        if keep and out.exists():
            return out
        calibrated = self.calibrated()
        io = np.dtype(IO_TYPES[self.io]).num
        int8, int32, float32 = (np.dtype(t).num for t in (np.int8, np.int32, np.float32))
        with _native_output_to_stderr():
            try:
                wrapper = self._wrapper.CalibrationWrapper(calibrated, [], [])
                if recipe.only:
                    # A probe: this op alone in int8, float at the inputs and outputs.
                    data = wrapper.QuantizeModel(float32, float32, True, recipe.only[0])
                else:
                    data = wrapper.QuantizeModel(io, io, False, int8, int32, False, False)
            except (ValueError, RuntimeError) as exc:
                raise QuantizeError(
                    f"quantizing with recipe {recipe.label} failed: {str(exc).splitlines()[0]}"
                ) from None
        data = bytes(data)
        if recipe.fp32_nodes:
            try:
                data, missing = tflite_graph.keep_float(
                    data, self.prepared.read_bytes(), recipe.fp32_nodes
                )
            except tflite_graph.GraphError as exc:
                raise QuantizeError(f"recipe {recipe.label}: {exc}") from None
            if missing:
                raise QuantizeError(
                    f"recipe {recipe.label}: no op makes {', '.join(missing)} in both graphs"
                )
        write_model_file(out, data)
        return out
