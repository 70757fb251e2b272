"""Raw camera frames made from pictures, for the tests of the frame path: the forward BT.601
studio-range transform, written apart from edged's (inverse) one."""

from __future__ import annotations

import numpy as np


def to_yuv420(rgb: np.ndarray, layout: str) -> np.ndarray:
    """The forward BT.601 limited-range transform, with 2x2 chroma averaging."""
    r, g, b = (rgb[..., i].astype(np.float64) for i in range(3))
    y = 16 + 0.257 * r + 0.504 * g + 0.098 * b
    u = 128 - 0.148 * r - 0.291 * g + 0.439 * b
    v = 128 + 0.439 * r - 0.368 * g - 0.071 * b
    h, w = y.shape

    def half(p):
        return p.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))

    y8 = np.clip(np.rint(y), 0, 255).astype(np.uint8)
    u8, v8 = (np.clip(np.rint(half(p)), 0, 255).astype(np.uint8) for p in (u, v))
    if layout == "nv12":
        chroma = np.stack([u8, v8], axis=-1).reshape(h // 2, w)
    else:
        chroma = np.concatenate([u8.reshape(-1), v8.reshape(-1)]).reshape(h // 2, w)
    return np.concatenate([y8, chroma])
