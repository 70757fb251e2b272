"""Raw YUV 4:2:0 camera frames (NV12, I420) to RGB: a picture made into a frame with the
BT.601 studio-range matrix (written here, forward) comes back as itself within the error
4:2:0 chroma allows; shrinking towards the model's size keeps the colours; frames of a
wrong shape are named errors."""

from __future__ import annotations

import numpy as np
import pytest

from edged.vision.frames import frame_size, yuv420_to_rgb
from edged.vision.settings import ImageError
from tests.support.frames import to_yuv420


def smooth_picture(h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (h + w) + 64], axis=-1)
    return rgb.astype(np.uint8)


@pytest.mark.parametrize("layout", ["nv12", "i420"])
def test_a_frame_comes_back_as_its_picture(layout: str) -> None:
    rgb = smooth_picture(48, 64)
    back = yuv420_to_rgb(to_yuv420(rgb, layout), layout, "f")
    assert back.shape == rgb.shape and back.dtype == np.uint8
    assert np.abs(back.astype(int) - rgb).max() <= 4


@pytest.mark.parametrize("layout", ["nv12", "i420"])
def test_pure_colours_and_the_size_hint(layout: str) -> None:
    """Red, green, blue and grey blocks on a 1080p frame, shrunk by 3 for a 320x320 model."""
    rgb = np.zeros((1080, 1920, 3), np.uint8)
    rgb[:540, :960] = (255, 0, 0)
    rgb[:540, 960:] = (0, 255, 0)
    rgb[540:, :960] = (0, 0, 255)
    rgb[540:, 960:] = (128, 128, 128)
    small = yuv420_to_rgb(to_yuv420(rgb, layout), layout, "f", size_hint=(320, 320))
    assert small.shape == (360, 640, 3)
    for (y, x), colour in {
        (90, 160): (255, 0, 0),
        (90, 480): (0, 255, 0),
        (270, 160): (0, 0, 255),
        (270, 480): (128, 128, 128),
    }.items():
        assert np.abs(small[y, x].astype(int) - colour).max() <= 3, (y, x, small[y, x])


@pytest.mark.parametrize(
    ("shape", "layout", "says"),
    [
        ((720, 640), "yuyv", "image_format 'yuyv': use one of nv12, i420"),
        ((1, 720, 640), "nv12", "is (height * 3 / 2, width) bytes"),
        ((721, 640), "nv12", "721 rows of 640"),
        ((720, 641), "i420", "720 rows of 641"),
        ((0, 640), "nv12", "0 rows of 640"),
    ],
)
def test_frames_of_a_wrong_shape_are_named(shape, layout: str, says: str) -> None:
    with pytest.raises(ImageError) as err:
        frame_size(shape, layout, "input 'x', frame 0")
    assert str(err.value).startswith("input 'x', frame 0: ") and says in str(err.value)
