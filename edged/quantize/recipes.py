"""INT8 recipes and making a QDQ model by one.

A recipe says which op types are quantized (all, or Conv/MatMul only), with which scheme
(U8S8 on CPUs with an 8-bit dot product, else 7-bit-weight U8S8 and U8U8, see `recipes_for`),
and which nodes stay FP32. The FP32 model is prepared once (opset 13, shape inference and
graph optimisation: `prepare`), its activation ranges calibrated once and cached, and each
recipe is then quantized from it (static, per-channel weights, QDQ: `Quantizer`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from backends import ModelError
from edged.quantize.calibration import Samples
from edged.quantize.defaults import DEFAULT_MAX_DROP
from edged.selection.accuracy import ScoreMap

Progress = Callable[[str, int, int], None]

# Op types that carry the arithmetic; "conv-matmul" quantizes only these.
COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


class QuantizeError(RuntimeError):
    """The model cannot be quantized; the message says at which step and why."""


# INT8 schemes (activations, weights): U8S8 is what VNNI/AMX/Arm dotprod kernels want; on
# x86 without VNNI, onnxruntime's U8S8 kernels multiply pairs with vpmaddubsw, whose int16
# sums saturate (its quantization guide: reduce_range, i.e. 7-bit weights, or U8U8 there).
SCHEMES = {
    "u8s8": ("QUInt8", "QInt8", False),
    "u8s8-rr": ("QUInt8", "QInt8", True),
    "u8u8": ("QUInt8", "QUInt8", False),
}
NO_DOT_PRODUCT_SCHEMES = ("u8s8-rr", "u8u8")


@dataclass(frozen=True)
class Recipe:
    name: str
    op_types: tuple[str, ...] | None  # None: every op type onnxruntime can quantize
    fp32_nodes: tuple[str, ...] = ()
    only: tuple[str, ...] = ()  # quantize just these nodes (sensitivity probes)
    scheme: str = "u8s8"  # a key of SCHEMES

    @property
    def label(self) -> str:
        base = self.name if self.scheme == "u8s8" else f"{self.name}-{self.scheme}"
        return f"{base}+{len(self.fp32_nodes)}fp32" if self.fp32_nodes else base


BASE_RECIPES = (Recipe("full", None), Recipe("conv-matmul", COMPUTE_OPS))


def recipes_for(int8_dot_product: bool) -> tuple[Recipe, ...]:
    """The recipes worth trying on this CPU: U8S8 where it has an 8-bit dot product; where
    it has none, 7-bit-weight U8S8 and U8U8 instead (plain U8S8 saturates there, and a
    model that passes on such a CPU passes on every other as well)."""
    if int8_dot_product:
        return BASE_RECIPES
    return tuple(replace(r, scheme=s) for s in NO_DOT_PRODUCT_SCHEMES for r in BASE_RECIPES)


def prepare(model_path: Path, workdir: Path) -> Path:
    """Opset 13 or newer, shapes inferred and the graph optimised: what quantize_static
    wants. Returns the prepared model's path in `workdir`."""
    import onnx
    from onnx import version_converter
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        model = onnx.load(str(model_path))
    except Exception as exc:  # onnx raises DecodeError, ValueError, OSError...
        raise ModelError(f"{model_path}: not a readable ONNX model ({exc})") from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        # QDQ with per-channel axes needs opset 13; on 11/12 the quantized model is invalid.
        try:
            model = version_converter.convert_version(model, 13)
        except Exception as exc:
            raise QuantizeError(
                f"{model_path}: cannot upgrade opset {opset} to 13 ({exc})"
            ) from None
    staged = workdir / "opset13.onnx"
    onnx.save(model, str(staged))
    prepared = workdir / "prepared.onnx"
    # chdir: the pre-processing may leave temporary models in the working folder.
    # Symbolic shape inference gives up on dynamic spatial dims ("Incomplete symbolic shape
    # inference"); ONNX shape inference plus optimisation are what the quantizer needs.
    with contextlib.chdir(workdir):
        try:
            quant_pre_process(str(staged), str(prepared), skip_symbolic_shape=True)
        except Exception as exc:
            raise QuantizeError(
                f"{model_path}: shape inference / pre-processing failed ({exc})"
            ) from None
    return prepared


class _Reader:
    """A CalibrationDataReader over in-memory feeds (subclassed lazily: importing
    onnxruntime.quantization costs ~1 s and the CLI's other commands never need it)."""

    @staticmethod
    def make(
        feeds: Sequence[Mapping[str, np.ndarray]],
        progress: Progress | None = None,
        phase: str = "calibrate",
    ):
        from onnxruntime.quantization import CalibrationDataReader

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.index = 0

            def get_next(self):
                if self.index >= len(feeds):
                    return None
                if progress:
                    progress(phase, self.index, len(feeds))
                self.index += 1
                return dict(feeds[self.index - 1])

            def __len__(self) -> int:
                return len(feeds)

        return Reader()


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    return {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[name]


class Quantizer:
    """Quantizes the prepared model with any recipe, calibrating only once when the
    installed onnxruntime can cache ranges (`calibration_cache_path`, 1.2x+)."""

    def __init__(
        self,
        prepared: Path,
        workdir: Path,
        calibration: Samples,
        method: str,
        progress: Progress | None = None,
    ) -> None:
        self.prepared = prepared
        self.workdir = workdir
        self.calibration = calibration
        self.method = method
        self.progress = progress
        self.cache = workdir / f"ranges-{method}.json"
        from onnxruntime.quantization import quantize_static

        self._can_cache = "calibration_cache_path" in inspect.signature(quantize_static).parameters

    reference_target = "onnxruntime"  # where the FP32 reference and the probes run

    def compute_nodes(self) -> list[str]:
        """The prepared graph's compute nodes (`COMPUTE_OPS`), in graph order."""
        import onnx

        graph = onnx.load(str(self.prepared), load_external_data=False).graph
        return [n.name for n in graph.node if n.op_type in COMPUTE_OPS and n.name]

    def data_producers(self, nodes: Sequence[str]) -> list[str]:
        """The non-compute nodes producing the data input of `nodes`: in the full recipe they
        would quantize that tensor anyway, so an FP32 node takes its producer along."""
        import onnx

        graph = onnx.load(str(self.prepared), load_external_data=False).graph
        producer = {out: n for n in graph.node for out in n.output}
        by_name = {n.name: n for n in graph.node}
        extra = []
        for name in nodes:
            node = by_name.get(name)
            if node is None or not node.input:
                continue
            src = producer.get(node.input[0])
            if src is not None and src.op_type not in COMPUTE_OPS:
                extra.append(src.name)
        return extra

    def quantize(self, recipe: Recipe, keep: bool = True) -> Path:
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

        activation, weight, reduce_range = SCHEMES[recipe.scheme]
        out = self.workdir / f"{recipe.label}.onnx"
        if keep and out.exists():
            return out
        kwargs: dict[str, Any] = {}
        if self._can_cache:
            kwargs["calibration_cache_path"] = str(self.cache)
        if self.method == "percentile":
            kwargs["extra_options"] = {"CalibPercentile": 99.99}
        # Ranges are calibrated for every tensor the first time (op_types None); a recipe
        # that quantizes fewer op types reads the subset it needs from the cache.
        if self._can_cache and not self.cache.exists() and recipe.op_types is not None:
            self.quantize(Recipe("full", None))
        reader = _Reader.make(self.calibration.feeds, self.progress)
        # The Entropy/Percentile calibrators print() their progress: keep stdout for --json.
        with contextlib.chdir(self.workdir), contextlib.redirect_stdout(sys.stderr):
            try:
                quantize_static(
                    str(self.prepared),
                    str(out),
                    reader,
                    quant_format=QuantFormat.QDQ,
                    per_channel=True,
                    activation_type=getattr(QuantType, activation),
                    weight_type=getattr(QuantType, weight),
                    reduce_range=reduce_range,
                    op_types_to_quantize=list(recipe.op_types) if recipe.op_types else None,
                    nodes_to_quantize=list(recipe.only) or None,
                    nodes_to_exclude=list(recipe.fp32_nodes),
                    calibrate_method=_method(self.method),
                    **kwargs,
                )
            except Exception as exc:
                out.unlink(missing_ok=True)
                raise QuantizeError(
                    f"quantizing with recipe {recipe.label} failed: {exc}"
                ) from None
        return out


# The settings of one quantize run: the recipes it tries, on which targets, judged how.
@dataclass(frozen=True)
class Settings:
    # Where the INT8 model is gated; empty: every backend that declares the model's format
    # (backends.quantize_targets).
    targets: tuple[str, ...] = ()
    method: str = "minmax"
    max_drop: float = DEFAULT_MAX_DROP
    threads: int | None = None
    cpus: Sequence[int] | None = None
    runs: int = 200
    time_budget_s: float = 20.0
    recipes: tuple[Recipe, ...] | None = None  # None: `recipes_for` this machine's CPU
    io: str | None = None  # a .tflite's input/output type: int8, uint8, float (None: float)
    # An NPU target: the passing INT8 model is written even where it does not beat FP32 on
    # this CPU (the NPU runs nothing else).
    require_int8: bool = False
    # A detector's score output: the gate compares detections (`edged.selection.accuracy`),
    # and a .tflite's score logits get a clipped range (`tflite_graph.clip_ranges`).
    scores: ScoreMap | None = None
