"""A tensor's name, dtype and shape, as a runtime or a model file tells them.

Plain data below `backends.base` and `backends.model_info`: model inspection reads these from
model files, sessions report them, and `base.check_feeds` checks feeds against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "float32", "int8", "uint8", ...
    shape: tuple[int | None, ...]  # None marks a dynamic dimension

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def shape_fits(spec_shape: Sequence[int | None], shape: Sequence[int]) -> bool:
    """Same rank, and every static dim of the spec equal (None = dynamic, anything fits)."""
    return len(spec_shape) == len(shape) and all(
        want is None or want == got for want, got in zip(spec_shape, shape, strict=True)
    )


def format_shape(shape: Sequence[int | None]) -> str:
    return "x".join("?" if d is None else str(d) for d in shape)
