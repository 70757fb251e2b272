"""Concrete input shapes and reference inputs for a model whose dims may be dynamic."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from backends.errors import InputError
from backends.tensors import TensorSpec, format_shape, shape_fits

DEFAULT_DIM = 224  # for dynamic spatial dims when the user gives no --shape


def parse_shape_args(args: Sequence[str] | None) -> dict[str, tuple[int, ...]]:
    """`NAME=1x3x320x320` (or `1,3,320,320`); a bare shape applies to a single-input model
    and is stored under the empty name."""
    shapes: dict[str, tuple[int, ...]] = {}
    for arg in args or []:
        name, _, dims = arg.rpartition("=")
        try:
            shape = tuple(int(d) for d in dims.replace(",", "x").split("x") if d.strip())
            if not shape or any(d <= 0 for d in shape):
                raise ValueError
        except ValueError:
            raise InputError(
                f"--shape {arg!r}: expected NAME=DxDx... with positive integers "
                f"(e.g. x=1x3x320x320)"
            ) from None
        shapes[name] = shape
    return shapes


def resolve_shapes(
    specs: Sequence[TensorSpec], overrides: Mapping[str, Sequence[int]] | None, model: str
) -> dict[str, tuple[int, ...]]:
    """A static shape per input: overrides first, else the model's dims with dynamic ones
    filled (batch 1, others DEFAULT_DIM)."""
    overrides = dict(overrides or {})
    if "" in overrides:
        if len(specs) != 1:
            raise InputError(
                f"{model}: has {len(specs)} inputs; name the input in --shape "
                f"(inputs: {', '.join(s.name for s in specs)})"
            )
        overrides[specs[0].name] = overrides.pop("")
    unknown = sorted(set(overrides) - {s.name for s in specs})
    if unknown:
        raise InputError(
            f"{model}: --shape names unknown input {unknown[0]!r}; inputs: "
            f"{', '.join(s.name for s in specs)}"
        )
    shapes = {}
    for spec in specs:
        if spec.name in overrides:
            shape = tuple(overrides[spec.name])
            if not shape_fits(spec.shape, shape):
                raise InputError(
                    f"{model}: --shape for {spec.name!r} is "
                    f"{format_shape(shape)}, the model takes "
                    f"{format_shape(spec.shape)}"
                )
            shapes[spec.name] = shape
        else:
            shapes[spec.name] = tuple(
                d if d is not None else (1 if axis == 0 else DEFAULT_DIM)
                for axis, d in enumerate(spec.shape)
            )
    return shapes


def text_like_images(height: int, width: int, count: int, seed: int):
    """Grey images in [0, 1]: light paper with dark glyph strokes in lines, varied contrast.

    Vision models answer noise with nothing (a text detector's output is all zeros, so any
    runtime "matches" the reference); structured images with edges make them work.
    """
    rng = np.random.default_rng(seed)
    for _ in range(count):
        paper = rng.uniform(170, 255)
        ink = rng.uniform(0, paper - 80)
        img = np.full((height, width), paper, dtype=np.float32)
        img += rng.normal(0, 6, size=img.shape).astype(np.float32)
        line_h = int(rng.integers(max(4, height // 12), max(5, height // 3)))
        y = int(rng.integers(0, max(1, height // 8)))
        while y + line_h < height:
            x = int(rng.integers(0, max(1, width // 6)))
            end = int(rng.integers(width // 2, width))
            while x < end:
                glyph_w = int(rng.integers(max(2, line_h // 3), max(3, line_h)))
                stroke = max(1, line_h // 8)
                for _ in range(int(rng.integers(2, 5))):
                    gx = x + int(rng.integers(0, glyph_w))
                    gy = y + int(rng.integers(0, line_h))
                    if rng.random() < 0.5:
                        img[y : y + line_h, gx : gx + stroke] = ink
                    else:
                        img[gy : gy + stroke, x : x + glyph_w] = ink
                x += glyph_w + int(rng.integers(1, max(2, line_h // 3)))
            y += line_h + int(rng.integers(line_h // 2, 2 * line_h))
        yield np.clip(img, 0, 255) / 255.0


def _image_layout(shape: tuple[int, ...]) -> str | None:
    """ "nchw"/"nhwc" when `shape` looks like a batch of 1- or 3-channel images."""
    if len(shape) != 4:
        return None
    if shape[1] in (1, 3) and shape[2] >= 8 and shape[3] >= 8:
        return "nchw"
    if shape[3] in (1, 3) and shape[1] >= 8 and shape[2] >= 8:
        return "nhwc"
    return None


def make_inputs(
    specs: Sequence[TensorSpec], shapes: Mapping[str, Sequence[int]], seed: int = 0
) -> dict[str, np.ndarray]:
    """Deterministic inputs: image-like tensors get text-like images scaled to [-1, 1], other
    floats uniform in [-1, 1), integers span the dtype's full range."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        shape = tuple(shapes[spec.name])
        layout = _image_layout(shape)
        if dtype.kind == "f" and layout:
            n, h, w = (shape[0], shape[2], shape[3]) if layout == "nchw" else shape[:3]
            channels = shape[1] if layout == "nchw" else shape[3]
            grey = np.stack(list(text_like_images(h, w, n, seed)))  # n, h, w
            axis = 1 if layout == "nchw" else 3
            batch = np.repeat(np.expand_dims(grey, axis), channels, axis=axis)
            feeds[spec.name] = (batch * 2.0 - 1.0).astype(dtype)
        elif dtype.kind == "f":
            feeds[spec.name] = rng.uniform(-1.0, 1.0, size=shape).astype(dtype)
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
            feeds[spec.name] = rng.integers(
                info.min, info.max, size=shape, endpoint=True, dtype=dtype
            )
        elif dtype.kind == "b":
            feeds[spec.name] = rng.random(shape) < 0.5
        else:
            raise InputError(f"input {spec.name!r}: cannot make test data of dtype {dtype}")
    return feeds


WORDS = (
    "edge",
    "inference",
    "board",
    "latency",
    "INT8",
    "2026",
    "NPU",
    "delegate",
    "core",
    "isolated",
    "thermal",
    "fleet",
    "jitter",
    "kernel",
    "model",
    "OCR",
    "text",
    "line",
    "invoice",
    "total",
    "12.50",
    "EUR",
    "serial",
    "No.",
    "A-113",
    "Raspberry",
    "Pi",
)


def rendered_text_lines(
    count: int,
    seed: int,
    height: int | None = None,
    width: int | None = None,
    font_px: tuple[int, int] = (14, 40),
    paper: tuple[int, int] = (150, 255),
    ink: tuple[int, int] = (0, 110),
):
    """PIL images of real rendered text: a line of words of random length, font size,
    paper and ink brightness (contrast), and image size (`height`/`width` fix them). The
    OCR models were trained on such crops; calibration and evaluation sets for
    `edgectl quantize` tests and benchmarks are made of them. Needs Pillow (the quantize
    extra)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    for _ in range(count):
        size = int(rng.integers(font_px[0], font_px[1] + 1))
        font = ImageFont.load_default(size)
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 7))))
        left, top, right, bottom = font.getbbox(text)
        pad = int(rng.integers(2, max(3, size // 2)))
        w = width or int(right - left + 2 * pad)
        h = height or int(bottom - top + 2 * pad)
        bg = int(rng.integers(paper[0], paper[1] + 1))
        fg = int(rng.integers(ink[0], min(ink[1], bg - 20) + 1))
        img = Image.new("L", (w, h), bg)
        ImageDraw.Draw(img).text((pad - left, pad - top), text, fill=fg, font=font)
        noise = rng.normal(0, 4, size=(h, w))
        pixels = np.clip(np.asarray(img, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
        yield Image.fromarray(pixels).convert("RGB")


def rendered_text_pages(
    count: int,
    seed: int,
    sizes: Sequence[tuple[int, int]] = ((128, 256), (160, 320), (96, 384)),
    **line_options,
):
    """PIL images for a text detector: one to four rendered text lines (see
    `rendered_text_lines`; its keyword options pass through) placed on paper of one of
    `sizes` (height, width), cycling through them."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    lines = rendered_text_lines(count * 4, seed + 1, **line_options)
    for index in range(count):
        height, width = sizes[index % len(sizes)]
        page = None
        y = int(rng.integers(0, max(1, height // 8)))
        for _ in range(int(rng.integers(1, 5))):
            line = next(lines)
            if page is None:  # the paper takes the first line's background
                page = Image.new("RGB", (width, height), line.getpixel((0, 0)))
            if y + line.height > height:
                break
            x = int(rng.integers(0, max(1, width - line.width))) if line.width < width else 0
            page.paste(line.crop((0, 0, min(line.width, width), line.height)), (x, y))
            y += line.height + int(rng.integers(2, 24))
        yield page


def feeds_digest(feeds: Sequence[dict[str, np.ndarray]]) -> str:
    """An id of the feeds' values, for cache keys."""
    import hashlib

    h = hashlib.sha256()
    for feed in feeds:
        for name in sorted(feed):
            h.update(name.encode())
            h.update(np.ascontiguousarray(feed[name]).tobytes())
    return h.hexdigest()[:16]
