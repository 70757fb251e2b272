"""The checks of a model's picture settings: [models.image] (how a picture becomes its
input) and [models.detector] (how its outputs become boxes), each against the model file's
own inputs and outputs, so a detector type that does not fit the model fails here, naming
the key, and not on the first frame."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from edged.config.checks import Checker, Table, show
from edged.config.schema import MODEL_NAME, DetectorConfig
from edged.vision.settings import ImageError, Preprocessing

# The model types Frigate names (edged.vision.decoders.DECODERS, which needs numpy: imported
# only when a model has a [models.detector]; a test keeps the two lists one).
MODEL_TYPES = ("ssd", "yolox", "yologeneric", "yolonas", "rfdetr", "dfine")

MAX_SERVES_AS = 16  # names one model may be asked for by; a bound, not a limit anyone meets


def image(value: Any, key: str, check: Checker, path: Path, shapes: dict | None) -> Preprocessing:
    if not isinstance(value, dict):
        raise check.fail(key, f"must be a table ([models.image]), got {show(value)}")
    t = Table(check, value, key, Preprocessing)
    pre: dict[str, Any] = {}
    for name in ("mean", "std"):
        if name in t:
            pre[name] = t.read(name, check.numbers)
    if "scale" in t:
        pre["scale"] = t.number("scale", lambda x: 0 < x < math.inf, "a number > 0")
    for name in ("color", "resize"):
        if name in t:
            pre[name] = t.string(name)
    from edged.vision.images import image_input

    try:
        pre_obj = Preprocessing(**pre)
        spec = _picture_input(check, path, shapes, key)
        if spec is not None:
            image_input(spec, pre_obj)
    except ImageError as exc:
        raise check.fail(key, str(exc)) from None
    return pre_obj


def _picture_input(check: Checker, path: Path, shapes: dict | None, key: str):
    """The model's one input, with [[models]] shapes applied (None: the format has no
    signature readable without a runtime)."""
    from backends.model_info import signature

    io = signature(path)
    if io is None:
        return None
    inputs = io[0]
    if len(inputs) != 1:
        names = ", ".join(s.name for s in inputs)
        raise check.fail(key, f"pictures need a model with one input; this one has {names}")
    spec = inputs[0]
    if shapes and spec.name in shapes:
        from dataclasses import replace

        spec = replace(spec, shape=tuple(shapes[spec.name]))
    return spec


def detector(
    value: Any, key: str, check: Checker, path: Path, shapes: dict | None
) -> DetectorConfig:
    if not isinstance(value, dict):
        raise check.fail(key, f"must be a table ([models.detector]), got {show(value)}")
    from edged.vision.labels import LabelmapError, coco80, names_from_metadata, read_labelmap

    t = Table(check, value, key, DetectorConfig)
    kind = t.string("type")
    if kind not in MODEL_TYPES:
        raise check.fail(t.key("type"), f"must be one of {', '.join(MODEL_TYPES)}; got {kind!r}")
    labels_raw = t.string("labels") if "labels" in t else "coco80"
    try:
        if labels_raw == "coco80":
            labels = coco80()
        elif labels_raw == "model":  # the class names the model file carries
            from backends.model_info import metadata

            labels = names_from_metadata(metadata(path), str(path))
        else:
            labels = read_labelmap(check.path(labels_raw, t.key("labels")))
    except LabelmapError as exc:
        raise check.fail(t.key("labels"), str(exc)) from None
    config = DetectorConfig(
        kind,
        tuple(sorted(labels.items())),
        t.number("min_score", lambda x: 0 <= x <= 1, "a number from 0 to 1"),
    )
    _decodes(check, config, path, shapes, key)
    return config


def _decodes(
    check: Checker, config: DetectorConfig, path: Path, shapes: dict | None, key: str
) -> None:
    """The decoder reads outputs of the model's shapes (where the file fixes them all):
    zeros of each output's shape, decoded, must not be a DecodeError."""
    import numpy as np

    from backends.model_info import signature
    from edged.vision.decoders import DecodeError, decode
    from edged.vision.images import image_input

    io = signature(path)
    if io is None or len(io[0]) != 1:
        return
    spec = _picture_input(check, path, shapes, key)
    outputs = io[1]
    # A dynamic batch dim is 1 here; any other dynamic dim leaves the check to the first frame.
    shapes_out = [
        [1 if d is None and i == 0 else d for i, d in enumerate(s.shape)] for s in outputs
    ]
    if spec is None or any(d is None for shape in shapes_out for d in shape):
        return
    try:
        size = image_input(spec, Preprocessing()).size
    except ImageError:
        return  # [models.image] (or its absence) is told about on its own key
    try:
        zeros = [
            np.zeros([d or 0 for d in shape], np.dtype(s.dtype))
            for shape, s in zip(shapes_out, outputs, strict=True)
        ]
        decode(config.type, zeros, size, 1.0)
    except DecodeError as exc:
        raise check.fail(
            f"{key}.type", f"{config.type} does not fit the model's outputs: {exc}"
        ) from None


def serves_as(value: Any, key: str, check: Checker) -> tuple[str, ...]:
    """Names a peer may ask for the model by: plain file names, never paths."""
    if not isinstance(value, list) or len(value) > MAX_SERVES_AS:
        raise check.fail(
            key, f"must be an array of at most {MAX_SERVES_AS} names, got {show(value)}"
        )
    names = []
    for index, name in enumerate(value):
        if not isinstance(name, str) or not MODEL_NAME.fullmatch(name) or set(name) == {"."}:
            raise check.fail(
                f"{key}[{index}]",
                f"must be a file name (letters, digits, '_', '.' or '-'; no '/'), got {show(name)}",
            )
        names.append(name)
    return tuple(names)
