"""The form a .tflite model is in, as an NPU delegate sees it: full-integer or not, the
types of its inputs and outputs, static shapes, and which compiler (if any) it went
through. Read from the file without a runtime (`backends.model_info`'s flatbuffer reader),
so a CI machine checks a model for a board it is not.

Compilers leave a custom op in the graph: Arm's Vela writes "ethos-u" (one op per NPU
partition), Coral's edgetpu_compiler writes "edgetpu-custom-op".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from backends.errors import ModelError
from backends.model_info import ModelInfo, inspect_model, read_model_file
from backends.tflite_file import custom_codes, signature

COMPILERS = {"ethos-u": "vela", "edgetpu-custom-op": "edgetpu"}


@dataclass(frozen=True)
class TfliteForm:
    precision: str  # model_info's: "int8" (full-integer), "fp32", "fp16", "mixed"
    input_types: tuple[str, ...]
    output_types: tuple[str, ...]
    static_shapes: bool  # no dynamic dim anywhere at the inputs
    custom_codes: tuple[str, ...]
    compiled_for: str | None  # "vela", "edgetpu", or None

    @property
    def full_integer(self) -> bool:
        return self.precision == "int8"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "full_integer": self.full_integer}


def tflite_form(path: str | Path, info: ModelInfo | None = None) -> TfliteForm:
    """The form of the .tflite at `path`; `info`: its `inspect_model`, when the caller has it
    (the file is then read once here, not twice)."""
    path = Path(path)
    info = info or inspect_model(path)
    if info.format != "tflite":
        raise ModelError(f"{path}: not a TFLite model ({info.format})")
    data = read_model_file(path)
    inputs, outputs = signature(path, data)
    codes = tuple(custom_codes(path, data))
    compiled = next((COMPILERS[c] for c in codes if c in COMPILERS), None)
    return TfliteForm(
        info.precision,
        tuple(s.dtype for s in inputs),
        tuple(s.dtype for s in outputs),
        all(d is not None for s in inputs for d in s.shape),
        codes,
        compiled,
    )
