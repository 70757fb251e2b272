"""The picture settings a config holds ([models.image]), apart from the code that applies
them (`images`), so that reading a config does not import numpy or Pillow."""

from __future__ import annotations

from dataclasses import dataclass

COLORS = ("rgb", "bgr")
RESIZE_MODES = ("stretch", "letterbox")


class ImageError(ValueError):
    """A picture or a picture contract that cannot be used; the message says what."""


@dataclass(frozen=True)
class Preprocessing:
    """How a picture becomes the model's input, as configured: colour order, pixel * scale,
    then (x - mean) / std per channel (one value: every channel), and how a picture of
    another size is fitted. Integer inputs (a quantized model's uint8) take the pixels as
    they are."""

    color: str = "rgb"
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    resize: str = "stretch"

    def __post_init__(self) -> None:
        if self.color not in COLORS:
            raise ImageError(f"colour {self.color!r}: use {' or '.join(COLORS)}")
        if self.resize not in RESIZE_MODES:
            raise ImageError(f"resize {self.resize!r}: use {' or '.join(RESIZE_MODES)}")
        if any(s == 0 for s in self.std):
            raise ImageError(f"std {list(self.std)}: a standard deviation of 0 divides by zero")
