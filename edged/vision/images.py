"""Pictures into a model's input tensor: the model's picture contract (`ImageInput`: its input's
size, layout and dtype from the model, colour order and normalisation from the config), a
picture fitted to that size (stretched or letterboxed, with the `Fit` that maps boxes back),
and compressed pictures (JPEG, PNG) decoded within a pixel bound.

Frigate sends pictures already at the model's size (uint8, height x width x 3, RGB); DeepStack
clients send a JPEG of any size. Both end in `tensor`."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from backends.tensors import TensorSpec
from edged.vision.settings import ImageError, Preprocessing

LETTERBOX_FILL = 114  # the grey YOLO-family models are trained with around letterboxed pictures
MAX_PIXELS = 40_000_000  # a decoded picture, at most (an 8K frame is 33 M): a bomb's bound


@dataclass(frozen=True)
class ImageInput:
    """A model input that takes one picture: its name, size, layout and dtype (from the
    model) and the configured preprocessing."""

    name: str
    height: int
    width: int
    layout: str  # "nchw" or "nhwc"
    dtype: str  # numpy's name: "float32", "uint8", ...
    pre: Preprocessing
    mean: np.ndarray  # (3,) float32
    std: np.ndarray  # (3,) float32

    @property
    def size(self) -> tuple[int, int]:
        return self.height, self.width


def image_input(spec: TensorSpec, pre: Preprocessing) -> ImageInput:
    """The picture contract of `spec`: a 4-axis input with 3 channels first or last and a
    fixed height and width."""
    shape = spec.shape
    if len(shape) != 4:
        raise ImageError(f"input {spec.name!r} {list(shape)} is not a picture batch (4 axes)")
    if shape[1] == 3:
        layout, (h, w) = "nchw", (shape[2], shape[3])
    elif shape[3] == 3:
        layout, (h, w) = "nhwc", (shape[1], shape[2])
    else:
        raise ImageError(f"input {spec.name!r} {list(shape)} has no axis of 3 colour channels")
    if h is None or w is None:
        raise ImageError(
            f"input {spec.name!r} {list(shape)} has a dynamic height or width; give the model "
            "fixed sizes with [[models]] shapes"
        )
    per_channel = []
    for what, values in (("mean", pre.mean), ("std", pre.std)):
        if len(values) not in (1, 3):
            raise ImageError(f"{what} has {len(values)} values; give one, or one per channel (3)")
        per_channel.append(np.resize(np.asarray(values, np.float32), 3))
    return ImageInput(spec.name, h, w, layout, spec.dtype, pre, per_channel[0], per_channel[1])


@dataclass(frozen=True)
class Fit:
    """How a picture was fitted into the model's size: the model saw the picture scaled by
    (`sy`, `sx`) and shifted by (`dy`, `dx`) pixels. Maps boxes normalised to the model's
    input back to boxes normalised to the picture."""

    picture: tuple[int, int]  # height, width
    model: tuple[int, int]
    sy: float = 1.0
    sx: float = 1.0
    dy: float = 0.0
    dx: float = 0.0

    def to_picture(self, boxes: np.ndarray) -> np.ndarray:
        """(n, 4) ymin, xmin, ymax, xmax normalised to the model's input -> to the picture."""
        mh, mw = self.model
        ph, pw = self.picture
        out = np.empty_like(boxes, dtype=np.float32)
        out[:, 0::2] = (boxes[:, 0::2] * mh - self.dy) / self.sy / ph
        out[:, 1::2] = (boxes[:, 1::2] * mw - self.dx) / self.sx / pw
        return np.clip(out, 0.0, 1.0)


def fit(pixels: np.ndarray, target: ImageInput) -> tuple[np.ndarray, Fit]:
    """`pixels` (h, w, 3) uint8 resized to the model's size: stretched, or letterboxed
    (scaled to fit whole, centred on grey)."""
    from PIL import Image

    ph, pw = pixels.shape[:2]
    th, tw = target.size
    if (ph, pw) == (th, tw):
        return pixels, Fit((ph, pw), (th, tw))
    img = Image.fromarray(pixels)
    if target.pre.resize == "stretch":
        out = np.asarray(img.resize((tw, th), Image.Resampling.BILINEAR))
        return out, Fit((ph, pw), (th, tw), th / ph, tw / pw)
    scale = min(th / ph, tw / pw)
    nh, nw = max(1, round(ph * scale)), max(1, round(pw * scale))
    dy, dx = (th - nh) // 2, (tw - nw) // 2
    canvas = np.full((th, tw, 3), LETTERBOX_FILL, np.uint8)
    canvas[dy : dy + nh, dx : dx + nw] = np.asarray(img.resize((nw, nh), Image.Resampling.BILINEAR))
    return canvas, Fit((ph, pw), (th, tw), nh / ph, nw / pw, dy, dx)


def tensor(pixels: np.ndarray, target: ImageInput) -> np.ndarray:
    """The model's input (batch of 1) from `pixels` (h, w, 3) uint8 RGB at the model's size."""
    if pixels.shape != (target.height, target.width, 3):
        raise ImageError(
            f"a picture of {list(pixels.shape)}; input {target.name!r} takes "
            f"[{target.height}, {target.width}, 3]"
        )
    if target.pre.color == "bgr":
        pixels = pixels[..., ::-1]
    dtype = np.dtype(target.dtype)
    if dtype.kind in "iu":
        x = pixels.astype(dtype, copy=False)
    else:
        x = (pixels.astype(np.float32) * target.pre.scale - target.mean) / target.std
        x = x.astype(dtype, copy=False)
    x = x.transpose(2, 0, 1) if target.layout == "nchw" else x
    return np.ascontiguousarray(x[None])


def decode_image(
    data: bytes,
    where: str,
    max_pixels: int = MAX_PIXELS,
    size_hint: tuple[int, int] | None = None,
) -> tuple[np.ndarray, tuple[int, int]]:
    """A JPEG, PNG (or other format Pillow reads) as (h, w, 3) uint8 RGB, and the picture's
    own (height, width). The size is read from the header and bounded before the pixels are
    decoded. `size_hint` (height, width): the size it will be fitted to; a JPEG is then
    decoded at the smallest 1/2, 1/4 or 1/8 scale still at least that big (libjpeg's
    draft mode: a 1080p frame for a 320x320 model decodes about 4x faster)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            size = (img.height, img.width)
            if img.width * img.height > max_pixels:
                raise ImageError(
                    f"{where}: {img.width}x{img.height} pixels, more than the {max_pixels} "
                    "a picture may have"
                )
            if size_hint is not None:
                img.draft("RGB", (size_hint[1], size_hint[0]))
            rgb = img.convert("RGB")
            return np.asarray(rgb), size
    except ImageError:
        raise
    except Exception as exc:
        # Pillow's decoders fail in their own ways on damaged files (OSError, ValueError,
        # SyntaxError for a broken PNG chunk, EOFError, struct.error, ...): all are this
        # upload's error, never the daemon's.
        raise ImageError(
            f"{where}: cannot read the picture ({type(exc).__name__}: {exc})"
        ) from None
