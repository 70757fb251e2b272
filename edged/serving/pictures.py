"""What a served model does with pictures, for the front ends that send pictures rather than
tensors (Frigate's ZMQ detector, DeepStack's upload): the model's picture contract, made
once at load from its input and [models.image], and, for a detector ([models.detector]),
its outputs turned into boxes in the picture's coordinates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from backends.errors import InputError
from backends.tensors import TensorSpec
from edged.config.schema import DetectorConfig, ModelConfig
from edged.vision.boxes import Detections, frigate_rows
from edged.vision.decoders import decode
from edged.vision.frames import yuv420_to_rgb
from edged.vision.images import (
    Fit,
    ImageError,
    ImageInput,
    Preprocessing,
    decode_image,
    fit,
    image_input,
    tensor,
)


@dataclass(frozen=True)
class Pictures:
    input: ImageInput
    output_names: tuple[str, ...]  # the model's outputs in its order (decoders read by order)
    detector: DetectorConfig | None

    def to_tensor(self, data: bytes, where: str) -> tuple[np.ndarray, Fit, tuple[int, int]]:
        """An encoded picture (JPEG, PNG, ...) as the model's input (a batch of one), how it
        was fitted, and the picture's own (height, width). ImageError says what is wrong."""
        pixels, size = decode_image(data, where, size_hint=self.input.size)
        fitted, how = fit(pixels, self.input)
        return tensor(fitted, self.input), how, size

    def batch(self, pictures: np.ndarray) -> tuple[np.ndarray, list[Fit]]:
        """A BYTES tensor of N encoded pictures ([N], or [1] for one) as the model's input
        batch. InputError names the input and the picture that cannot be used."""
        if pictures.ndim != 1 or len(pictures) == 0:
            raise InputError(
                f"input {self.input.name!r}: pictures come as a BYTES tensor of shape [N], "
                f"got {list(pictures.shape)}"
            )
        size = self.input.size
        return self._stack(
            pictures, "picture", lambda data, where: decode_image(data, where, size_hint=size)[0]
        )

    def frames(self, frames: np.ndarray, layout: str) -> tuple[np.ndarray, list[Fit]]:
        """Raw YUV 4:2:0 camera frames ([N, height * 3 / 2, width] uint8, `layout` nv12 or
        i420) as the model's input batch."""
        if frames.ndim != 3 or len(frames) == 0:
            raise InputError(
                f"input {self.input.name!r}: {layout} frames come as [N, height * 3 / 2, "
                f"width], got {list(frames.shape)}"
            )
        size = self.input.size
        return self._stack(
            frames, "frame", lambda frame, where: yuv420_to_rgb(frame, layout, where, size)
        )

    def _stack(
        self, items: np.ndarray, kind: str, pixels_of: Callable[[Any, str], np.ndarray]
    ) -> tuple[np.ndarray, list[Fit]]:
        """Each item as RGB pixels (`pixels_of(item, where)`), fitted to the input, stacked
        into one batch; how each was fitted. ImageError becomes the request's InputError."""
        batch, fits = [], []
        try:
            for index, item in enumerate(items):
                pixels = pixels_of(item, f"input {self.input.name!r}, {kind} {index}")
                fitted, how = fit(pixels, self.input)
                batch.append(tensor(fitted, self.input))
                fits.append(how)
        except ImageError as exc:
            raise InputError(str(exc)) from None
        return np.concatenate(batch), fits

    def detections(
        self,
        outputs: Mapping[str, np.ndarray],
        fit: Fit | None = None,
        min_score: float | None = None,
    ) -> Detections:
        """The detector's boxes in `outputs` (one picture's), normalised to the picture
        (`fit` maps them back when it was resized); best first."""
        assert self.detector is not None
        threshold = self.detector.min_score if min_score is None else min_score
        arrays = [outputs[name] for name in self.output_names]
        dets = decode(self.detector.type, arrays, self.input.size, threshold)
        if fit is not None:
            dets = Detections(fit.to_picture(dets.boxes), dets.scores, dets.classes).clipped()
        return dets.best(len(dets))


def pictures_of(
    mc: ModelConfig, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> Pictures | None:
    """The model's picture handling; None where it takes no picture (several inputs, or no
    colour axis) and has no picture settings. A model with [models.image] or
    [models.detector] that takes no picture raises ImageError (the config check refuses
    most such files first; a format read only by its runtime is told here)."""
    wanted = mc.image is not None or mc.detector is not None or bool(mc.serves_as)
    try:
        if len(inputs) != 1:
            raise ImageError(
                f"pictures need a model with one input; this one has "
                f"{', '.join(s.name for s in inputs)}"
            )
        spec = inputs[0]
        if mc.shapes and spec.name in mc.shapes:  # the sizes it is served at ([[models]] shapes)
            spec = replace(spec, shape=tuple(mc.shapes[spec.name]))
        contract = image_input(spec, mc.image or Preprocessing())
    except ImageError:
        if wanted:
            raise
        return None
    return Pictures(contract, tuple(s.name for s in outputs), mc.detector)


def tensors_of(
    pictures: Pictures | None,
    inputs: dict[str, np.ndarray],
    frames: Mapping[str, str],
    model: str,
) -> tuple[dict[str, np.ndarray], list[Fit]]:
    """A request's inputs with its pictures (BYTES inputs: encoded JPEG, PNG, ...) or raw
    frames (`frames`: input -> nv12/i420) made into the model's input tensor, the others as
    they are; and how each picture was fitted. InputError when the model takes no picture
    there."""
    for name, array in inputs.items():
        if array.dtype != object and name not in frames:
            continue
        if pictures is None or name != pictures.input.name:
            what = f"a {frames[name]} frame" if name in frames else "BYTES"
            raise InputError(
                f"{model}: input {name!r} is {what}, and this model takes no pictures there "
                "(send a tensor, or give the model one picture input and [models.image])"
            )
        if name in frames:
            x, fits = pictures.frames(array, frames[name])
        else:
            x, fits = pictures.batch(array)
        return {**inputs, name: x}, fits
    return inputs, []


def detections_output(
    pictures: Pictures | None, outputs: Mapping[str, np.ndarray], fits: list[Fit], model: str
) -> dict[str, np.ndarray]:
    """The request's `postprocess = "detections"`: the detector's outputs decoded, one
    picture after another, into {"detections": [N, 20, 6]} of Frigate's rows (class, score,
    ymin, xmin, ymax, xmax; normalised to each picture, best first, zero rows after)."""
    if pictures is None or pictures.detector is None:
        raise InputError(f"{model}: postprocess needs a detector ([models.detector]); it has none")
    first = next(iter(outputs.values()))
    rows = []
    for index in range(first.shape[0] if first.ndim else 1):
        one = {name: array[index : index + 1] for name, array in outputs.items()}
        how = fits[index] if index < len(fits) else None
        rows.append(frigate_rows(pictures.detections(one, how)))
    return {"detections": np.stack(rows)}
