"""What a calibration set is: where its data is and how its images become model inputs.

Plain data with no numpy, apart from the loading in `edged.quantize.calibration`: the config
holds these (`[[models]] calibration = { ... }`), and loading or checking a config must not
import numpy. Field metadata `toml` is the config's spelling of a field where it differs
(`resize` for `size`, as the `--resize` flag), or None where it is not a key of its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class CalibrationError(ValueError):
    """Calibration or evaluation data that cannot be used; says which file and why."""


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes a model input: resize to `size` (height, width) or, for models
    with dynamic spatial dims and no size, keep the image's size rounded down to a multiple
    of `multiple`; RGB/BGR/grey; pixel * scale, then (x - mean) / std per channel; layout
    nchw/nhwc (None: from the model's input shape)."""

    size: tuple[int, int] | None = field(default=None, metadata={"toml": "resize"})
    multiple: int = 32
    color: str = "rgb"
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: str | None = None

    def __post_init__(self) -> None:
        if self.color not in ("rgb", "bgr", "gray"):
            raise CalibrationError(f"colour {self.color!r}: use rgb, bgr or gray")
        if self.layout not in (None, "nchw", "nhwc"):
            raise CalibrationError(f"layout {self.layout!r}: use nchw or nhwc")
        if any(s == 0 for s in self.std):
            raise CalibrationError(f"std {self.std}: a standard deviation of 0 divides by zero")
        if self.multiple < 1:
            raise CalibrationError(f"multiple {self.multiple}: must be 1 or more")


@dataclass(frozen=True)
class CalibrationSpec:
    """Where the data is and how images become inputs (config `calibration`, `preprocess`;
    CLI `--calibration`, `--eval` and the preprocessing flags)."""

    data: Path
    eval: Path | None = None
    # In the config its fields are keys of the calibration table itself.
    preprocess: Preprocess = field(default_factory=Preprocess, metadata={"toml": None})

    def to_dict(self) -> dict[str, Any]:
        return {
            "data": str(self.data),
            "eval": str(self.eval) if self.eval else None,
            "preprocess": asdict(self.preprocess),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationSpec:
        pre: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in (data.get("preprocess") or {}).items()
        }
        return cls(
            Path(data["data"]), Path(data["eval"]) if data.get("eval") else None, Preprocess(**pre)
        )
