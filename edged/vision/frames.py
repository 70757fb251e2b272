"""Raw camera frames, YUV 4:2:0 as V4L2, GStreamer and the NPU vendors' pipelines hand them
over: NV12 (the Y plane, then interleaved U/V at half size) and I420 (Y, then U, then V).
A frame comes as one uint8 array of (height * 3 / 2, width) rows, the planes one after the
other, and becomes (h, w, 3) RGB for the picture path (`edged.vision.images.fit`).

The planes are shrunk towards the model's size first (Pillow's box `reduce` by a whole
factor, the chroma planes resized to match), so a 1080p frame for a 320x320 model is
converted at 360x640, not 1080x1920. The colour matrix is BT.601 with limited (studio)
range, as cameras and OpenCV's YUV420 conversions use: written here because neither Pillow
(full-range JFIF YCbCr only) nor numpy has it, and OpenCV is not a dependency.
"""

from __future__ import annotations

import numpy as np

from edged.vision.settings import ImageError

FORMATS = ("nv12", "i420")


def frame_size(shape: tuple[int, ...], layout: str, where: str) -> tuple[int, int]:
    """The (height, width) of a frame of `shape` (rows, width), or ImageError saying why
    that is no YUV 4:2:0 frame."""
    if layout not in FORMATS:
        raise ImageError(f"{where}: image_format {layout!r}: use one of {', '.join(FORMATS)}")
    if len(shape) != 2:
        raise ImageError(
            f"{where}: a {layout} frame is (height * 3 / 2, width) bytes, got {list(shape)}"
        )
    rows, width = shape
    if rows % 3 or (rows * 2 // 3) % 2 or width % 2 or not rows or not width:
        raise ImageError(
            f"{where}: {rows} rows of {width}: a {layout} frame has height * 3 / 2 rows of an "
            "even width, for an even height"
        )
    return rows * 2 // 3, width


def yuv420_to_rgb(
    frame: np.ndarray, layout: str, where: str, size_hint: tuple[int, int] | None = None
) -> np.ndarray:
    """`frame` (uint8, (height * 3 / 2, width)) as (h, w, 3) uint8 RGB; with `size_hint`
    (the size it will be fitted to) at the smallest whole reduction still at least as big."""
    from PIL import Image

    height, width = frame_size(frame.shape, layout, where)
    frame = np.ascontiguousarray(frame, dtype=np.uint8)
    y = frame[:height]
    chroma = frame[height:].reshape(-1)
    half = (height // 2, width // 2)
    if layout == "nv12":
        uv = chroma.reshape(half[0], half[1], 2)
        u, v = uv[..., 0], uv[..., 1]
    else:
        quarter = half[0] * half[1]
        u, v = chroma[:quarter].reshape(half), chroma[quarter:].reshape(half)
    factor = 1
    if size_hint is not None:
        factor = max(1, min(height // max(1, size_hint[0]), width // max(1, size_hint[1])))
    luma = Image.fromarray(y)
    if factor > 1:
        luma = luma.reduce(factor)
    size = luma.size  # (w, h)
    planes = [np.asarray(luma, np.int32)]
    for plane in (u, v):
        planes.append(
            np.asarray(
                Image.fromarray(np.ascontiguousarray(plane)).resize(
                    size, Image.Resampling.BILINEAR
                ),
                np.int32,
            )
        )
    return _bt601_limited(*planes)


def _bt601_limited(y: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Integer BT.601 studio-range YUV -> RGB (coefficients scaled by 2^10)."""
    c = (y - 16) * 1192
    d = u - 128
    e = v - 128
    r = c + 1634 * e
    g = c - 401 * d - 832 * e
    b = c + 2066 * d
    rgb = np.stack([r, g, b], axis=-1)
    return np.clip((rgb + 512) >> 10, 0, 255).astype(np.uint8)
