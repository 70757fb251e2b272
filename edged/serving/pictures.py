"""What a served model does with pictures, for the front ends that send pictures rather than
tensors (Frigate's ZMQ detector, DeepStack's upload): the model's picture contract, made
once at load from its input and [models.image], and, for a detector ([models.detector]),
its outputs turned into boxes in the picture's coordinates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from backends.tensors import TensorSpec
from edged.config.schema import DetectorConfig, ModelConfig
from edged.vision.boxes import Detections
from edged.vision.decoders import decode
from edged.vision.images import Fit, ImageError, ImageInput, Preprocessing, image_input


@dataclass(frozen=True)
class Pictures:
    input: ImageInput
    output_names: tuple[str, ...]  # the model's outputs in its order (decoders read by order)
    detector: DetectorConfig | None

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
        contract = image_input(inputs[0], mc.image or Preprocessing())
    except ImageError:
        if wanted:
            raise
        return None
    return Pictures(contract, tuple(s.name for s in outputs), mc.detector)
