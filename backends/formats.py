"""Model formats: how a file is recognised, what its graph computes in, and the platform name
it is served under. Each backend module declares the formats it owns (`FORMATS`), so adding a
runtime with its own file format (.rknn, .hef) touches no other module; `backends.model_info`
asks this registry what a file is.

Numpy-free and runtime-free: recognising and inspecting a file is cheap and safe before any
runtime is chosen (the config check does it for every model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backends.errors import ModelError
from backends.tensors import TensorSpec

Signature = tuple[list[TensorSpec], list[TensorSpec]]


@dataclass(frozen=True)
class FormatFacts:
    """What reading a model file told: the precision its graph computes in and why."""

    precision: str  # "int8", "fp16", "fp32", "mixed"
    detail: str
    # ONNX INT8 activation/weight scheme ("u8s8", "u8s8-rr", "u8u8", "s8s8"), else None.
    int8_scheme: str | None = None
    # The device a compiled model is built for, as its file says ("rk3588", "hailo8").
    target: str | None = None


def _cannot_tell(data: bytes) -> bool | None:
    return None


@dataclass(frozen=True)
class ModelFormat:
    name: str  # ModelInfo.format: "onnx", "openvino-ir", "tflite", "rknn", "hef"
    description: str  # the format's name for people: "ONNX", "TFLite", "Hailo HEF"
    suffixes: tuple[str, ...]  # lower case, with the dot
    # The protocol's `platform` in model metadata (Triton's names where Triton has one).
    platform: str
    # Reads the file's bytes: precision and target. Raises ModelError naming the path.
    read: Callable[[Path, bytes], FormatFacts]
    # From the first bytes alone: True (it is this format), False (it is not), None (cannot
    # tell by content, e.g. protobuf has no magic: the suffix decides).
    recognise: Callable[[bytes], bool | None] = _cannot_tell
    # Why a file with this suffix is not one, when `recognise` said False ("no TFL3 ...").
    not_it: str = ""
    # The file's inputs and outputs without a runtime; None where only a runtime can tell.
    signature: Callable[[Path, bytes], Signature] | None = None
    # The file's own key/value metadata (an ONNX model's metadata_props: an Ultralytics export
    # keeps its class names there); None where the format has none edged reads.
    metadata: Callable[[Path, bytes], dict[str, str]] | None = None


def registered() -> dict[str, ModelFormat]:
    """Every backend's formats by name, in backend order (imported on first use: the
    backends package imports this module)."""
    from backends import model_formats

    return model_formats()


def detect(path: Path, data: bytes) -> ModelFormat:
    """The format of a model file: by content where the format has a magic, else by suffix.
    ModelError names the path and what was expected."""
    formats = list(registered().values())
    for fmt in formats:
        if fmt.recognise(data):
            return fmt
    suffix = path.suffix.lower()
    for fmt in formats:
        if suffix in fmt.suffixes:
            if fmt.recognise(data) is False:
                why = fmt.not_it or "wrong magic bytes"
                raise ModelError(f"{path}: not a {fmt.description} model ({why})")
            return fmt
    known = [f"{f.description} {'/'.join(f.suffixes)}" for f in formats]
    listed = ", ".join(known[:-1]) + f" or {known[-1]}" if len(known) > 1 else known[0]
    raise ModelError(f"{path}: unsupported model format (expected {listed})")


def platform_of(format_name: str) -> str:
    """The protocol's platform name for a model format (the format's own name if unknown)."""
    fmt = registered().get(format_name)
    return fmt.platform if fmt is not None else format_name
