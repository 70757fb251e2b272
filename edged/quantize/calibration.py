"""Calibration and evaluation data for `edgectl quantize`: loading, preprocessing, and the
warnings that say what a data set lacks.

Three forms are accepted:

* an ``.npz`` whose arrays are named after the model's inputs, first axis = samples;
* a folder of ``.npy`` files, one sample each (single-input models; a leading batch axis of
  one is allowed);
* a folder of images (PNG, JPEG, BMP, WebP, TIFF) with a small preprocessing spec
  (`Preprocess`: resize, colour order, scale, mean/std, layout), single-input models.

Every error names the file and what is wrong with it (`CalibrationError`); nothing here
writes anywhere.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends.tensors import TensorSpec, format_shape
from edged.quantize.calibration_spec import CalibrationError, Preprocess
from edged.quantize.defaults import EVAL_SPLIT

# Bounds on what calibration data may decode to: checked from each array's header and each
# image's size before anything is decompressed, so a zip or image bomb is an error naming
# the file, not the daemon's memory.
MAX_ARRAY_BYTES = 1 << 30  # one .npy array, or one array of an .npz
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # one image (a 8192x8192 photo)
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})
RECOMMENDED_SAMPLES = 100
# Narrowness thresholds, on pixel values scaled to [0, 1] (images) or to the data set's own
# value range (arrays): a spread of per-sample mean brightness under 0.15 and a ratio of the
# highest to the lowest per-sample contrast (standard deviation) under 1.5 mean every sample
# looks alike, and the ranges calibrated from them clip what production sends.
MIN_BRIGHTNESS_SPREAD = 0.15
MIN_CONTRAST_RATIO = 1.5


@dataclass
class Samples:
    """Model feeds, one dict per sample, with where each came from and what they look like."""

    feeds: list[dict[str, np.ndarray]]
    sources: list[str]
    kind: str  # "images", "npy", "npz"
    resized: bool = False  # images resized to one size on purpose (--resize)
    # Per sample: (height, width) fed to the model; mean and standard deviation of the
    # first input on a [0, 1] scale (images before normalisation; arrays by the set's range).
    sizes: list[tuple[int, int]] = field(default_factory=list)
    brightness: list[float] = field(default_factory=list)
    contrast: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.feeds)

    def split(self, fraction: float, seed: int = 0) -> tuple[Samples, Samples]:
        """Two disjoint sets (shuffled), the second with `fraction` of the samples."""
        order = np.random.default_rng(seed).permutation(len(self))
        cut = len(self) - max(1, round(len(self) * fraction))
        if cut < 1:
            raise CalibrationError(
                f"{len(self)} sample(s) cannot be split into calibration "
                "and evaluation sets; give --eval DATA or more samples"
            )
        return self._subset(order[:cut].tolist()), self._subset(order[cut:].tolist())

    def _subset(self, index: Sequence[int]) -> Samples:
        def pick(values: list) -> list:
            return [values[i] for i in index] if values else []

        return Samples(
            pick(self.feeds),
            pick(self.sources),
            self.kind,
            self.resized,
            pick(self.sizes),
            pick(self.brightness),
            pick(self.contrast),
        )


def load_samples(
    path: str | Path, inputs: Sequence[TensorSpec], preprocess: Preprocess | None = None
) -> Samples:
    """Read `path` (.npz, folder of .npy, or folder of images) as feeds for `inputs`."""
    path = Path(path)
    if not path.exists():
        raise CalibrationError(f"{path}: no such file or folder")
    if not path.is_file() and not path.is_dir():
        raise CalibrationError(
            f"{path}: neither a regular file nor a folder (a device, FIFO or socket is not "
            "calibration data)"
        )
    if path.is_file():
        if path.suffix.lower() != ".npz":
            raise CalibrationError(
                f"{path}: expected an .npz file or a folder of images or .npy files"
            )
        samples = _load_npz(path, inputs)
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        npy = [p for p in files if p.suffix.lower() == ".npy"]
        images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
        others = [p.name for p in files if p not in npy and p not in images]
        if others:
            raise CalibrationError(
                f"{path}: files that are neither images nor .npy: "
                f"{', '.join(others[:5])}{' …' if len(others) > 5 else ''}"
            )
        if npy and images:
            raise CalibrationError(f"{path}: mixes .npy files and images; use one kind")
        if not npy and not images:
            raise CalibrationError(f"{path}: no images or .npy files in it")
        if npy:
            samples = _load_npy_folder(npy, inputs)
        else:
            samples = _load_images(images, inputs, preprocess or Preprocess())
    if not samples.feeds:
        raise CalibrationError(f"{path}: holds no samples")
    return samples


def narrowness_warnings(samples: Samples, inputs: Sequence[TensorSpec]) -> list[str]:
    """What the samples lack: too few of them, one size only, one brightness, one contrast."""
    warnings = []
    count = len(samples)
    if count < RECOMMENDED_SAMPLES:
        warnings.append(
            f"only {count} calibration sample(s) ({RECOMMENDED_SAMPLES} or more "
            "recommended): ranges taken from few samples miss rare large "
            "activations"
        )
    dynamic_spatial = any(len(s.shape) == 4 and (None in s.shape[1:]) for s in inputs)
    if (
        samples.sizes
        and dynamic_spatial
        and not samples.resized
        and count > 1
        and len(set(samples.sizes)) == 1
    ):
        h, w = samples.sizes[0]
        warnings.append(
            f"every sample is {h}x{w} while the model takes any size: add the "
            "sizes production sends (small and large, wide and tall)"
        )
    if count > 1 and samples.brightness:
        low, high = min(samples.brightness), max(samples.brightness)
        if high - low < MIN_BRIGHTNESS_SPREAD:
            warnings.append(
                f"mean brightness of every sample lies within {low:.2f}–{high:.2f} "
                "(on 0–1): add darker and brighter samples (lighting, exposure)"
            )
    if count > 1 and samples.contrast:
        low, high = min(samples.contrast), max(samples.contrast)
        if low > 0 and high / low < MIN_CONTRAST_RATIO:
            warnings.append(
                f"contrast of every sample is alike (standard deviation "
                f"{low:.3f}–{high:.3f}): add low- and high-contrast samples"
            )
    return warnings


def calibration_and_evaluation(
    path: str | Path,
    eval_path: str | Path | None,
    inputs: Sequence[TensorSpec],
    preprocess: Preprocess | None = None,
) -> tuple[Samples, Samples, list[str]]:
    """Calibration samples, evaluation samples (`eval_path`, else EVAL_SPLIT of the
    calibration held out) and the warnings that say what the calibration set lacks."""
    calibration = load_samples(path, inputs, preprocess)
    warnings = []
    if eval_path is not None:
        evaluation = load_samples(eval_path, inputs, preprocess)
    else:
        calibration, evaluation = calibration.split(EVAL_SPLIT)
        warnings.append(
            f"no evaluation set: {len(evaluation)} of the calibration samples "
            "were held out for the accuracy gate; give a separate one"
        )
    return calibration, evaluation, narrowness_warnings(calibration, inputs) + warnings


# -- loaders ------------------------------------------------------------------------------


def _check_array(where: str, spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """One sample (with its batch axis of one) for `spec`, or an error naming `where`."""
    dtype = np.dtype(spec.dtype)
    if array.dtype.kind not in "biuf" or (dtype.kind in "iu" and array.dtype.kind == "f"):
        raise CalibrationError(
            f"{where}: dtype {array.dtype} cannot feed input {spec.name!r} ({spec.dtype})"
        )
    if len(array.shape) != len(spec.shape):
        raise CalibrationError(
            f"{where}: shape {format_shape(array.shape)} has "
            f"{len(array.shape)} axes; input {spec.name!r} wants "
            f"{format_shape(spec.shape)}"
        )
    for axis, (want, got) in enumerate(zip(spec.shape, array.shape, strict=True)):
        if axis > 0 and want is not None and want != got:
            raise CalibrationError(
                f"{where}: shape {format_shape(array.shape)} does not fit "
                f"input {spec.name!r} {format_shape(spec.shape)} "
                f"(axis {axis})"
            )
    if dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise CalibrationError(f"{where}: holds NaN or infinite values")
    return np.ascontiguousarray(array.astype(dtype, copy=False))


def _range_stats(arrays: Sequence[np.ndarray]) -> tuple[list[float], list[float]]:
    """Per-sample mean and standard deviation on the set's own [0, 1] scale."""
    low = min(float(a.min()) for a in arrays)
    high = max(float(a.max()) for a in arrays)
    span = (high - low) or 1.0
    means = [(float(a.mean()) - low) / span for a in arrays]
    stds = [float(a.std()) / span for a in arrays]
    return means, stds


def _load_npz(path: Path, inputs: Sequence[TensorSpec]) -> Samples:
    try:
        _check_npz_sizes(path)
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise CalibrationError(f"{path}: not a readable .npz file ({exc})") from None
    names = [spec.name for spec in inputs]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise CalibrationError(
            f"{path}: no array for input(s) {', '.join(missing)}; it holds "
            f"{', '.join(arrays) or 'nothing'} (name each array after a "
            f"model input: {', '.join(names)})"
        )
    extra = sorted(set(arrays) - set(names))
    if extra:
        raise CalibrationError(
            f"{path}: arrays {', '.join(extra)} match no model input ({', '.join(names)})"
        )
    counts = {n: arrays[n].shape[0] if arrays[n].ndim else 0 for n in names}
    if len(set(counts.values())) != 1:
        raise CalibrationError(
            f"{path}: inputs have different sample counts "
            f"({', '.join(f'{k}={v}' for k, v in counts.items())}); the "
            "first axis is the sample axis"
        )
    count = counts[names[0]]
    feeds = []
    for i in range(count):
        feeds.append(
            {
                spec.name: _check_array(
                    f"{path}: array {spec.name!r} sample {i}", spec, arrays[spec.name][i : i + 1]
                )
                for spec in inputs
            }
        )
    first = [f[names[0]] for f in feeds]
    means, stds = _range_stats(first) if first and first[0].dtype.kind == "f" else ([], [])
    return Samples(
        feeds, [f"{path.name}[{i}]" for i in range(count)], "npz", False, [], means, stds
    )


def _single_input(where: Path, inputs: Sequence[TensorSpec], kind: str) -> TensorSpec:
    if len(inputs) != 1:
        raise CalibrationError(
            f"{where}: a folder of {kind} feeds single-input models; this "
            f"model has {len(inputs)} inputs "
            f"({', '.join(s.name for s in inputs)}): use an .npz named "
            "after them"
        )
    return inputs[0]


def _load_npy_folder(files: Sequence[Path], inputs: Sequence[TensorSpec]) -> Samples:
    spec = _single_input(files[0].parent, inputs, ".npy files")
    feeds = []
    for file in files:
        try:
            with open(file, "rb") as f:
                _check_npy_size(file, f)
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise CalibrationError(f"{file}: not a readable .npy file ({exc})") from None
        if array.ndim == len(spec.shape) - 1:
            array = array[None]
        if array.ndim and array.shape[0] != 1:
            raise CalibrationError(
                f"{file}: holds {array.shape[0]} samples on its first "
                "axis; one .npy file is one sample (or use an .npz)"
            )
        feeds.append({spec.name: _check_array(str(file), spec, array)})
    arrays = [f[spec.name] for f in feeds]
    means, stds = _range_stats(arrays) if arrays[0].dtype.kind == "f" else ([], [])
    return Samples(feeds, [f.name for f in files], "npy", False, [], means, stds)


def image_layout(spec: TensorSpec, preprocess: Preprocess) -> str:
    if preprocess.layout:
        return preprocess.layout
    shape = spec.shape
    if len(shape) != 4:
        raise CalibrationError(
            f"input {spec.name!r} {format_shape(shape)} is not an image "
            "batch (4 axes); feed it from an .npz instead"
        )
    if shape[1] in (1, 3):
        return "nchw"
    if shape[3] in (1, 3):
        return "nhwc"
    raise CalibrationError(
        f"input {spec.name!r} {format_shape(shape)}: cannot tell the "
        "channel axis; give --layout nchw or nhwc"
    )


def _target_size(
    spec: TensorSpec, layout: str, preprocess: Preprocess, image_size: tuple[int, int], where: Path
) -> tuple[int, int]:
    h, w = (spec.shape[2], spec.shape[3]) if layout == "nchw" else (spec.shape[1], spec.shape[2])
    if preprocess.size:
        if (h is not None and h != preprocess.size[0]) or (
            w is not None and w != preprocess.size[1]
        ):
            raise CalibrationError(
                f"resize {preprocess.size[0]}x{preprocess.size[1]} does not "
                f"fit input {spec.name!r} {format_shape(spec.shape)}"
            )
        return preprocess.size
    if h is not None and w is not None:
        return h, w
    m = preprocess.multiple
    th = h if h is not None else image_size[0] // m * m
    tw = w if w is not None else image_size[1] // m * m
    if th < 1 or tw < 1:
        raise CalibrationError(
            f"{where}: {image_size[0]}x{image_size[1]} is smaller than the "
            f"size multiple {m}; give --resize HxW"
        )
    return th, tw


def _load_images(
    files: Sequence[Path], inputs: Sequence[TensorSpec], preprocess: Preprocess
) -> Samples:
    try:
        from PIL import Image
    except ImportError:
        raise CalibrationError(
            "reading images needs Pillow: pip install 'edged[quantize]'"
        ) from None
    spec = _single_input(files[0].parent, inputs, "images")
    layout = image_layout(spec, preprocess)
    channels = spec.shape[1] if layout == "nchw" else spec.shape[3]
    if channels is None:
        raise CalibrationError(
            f"input {spec.name!r} {format_shape(spec.shape)}: its channel axis ({layout}) is "
            "dynamic; images need a fixed number of channels"
        )
    color = "gray" if channels == 1 else preprocess.color
    if channels == 3 and preprocess.color == "gray":
        raise CalibrationError(f"input {spec.name!r} has 3 channels; --color gray needs 1")
    mean = _per_channel("mean", preprocess.mean, channels)
    std = _per_channel("std", preprocess.std, channels)
    samples = Samples([], [], "images", resized=preprocess.size is not None)
    for file in files:
        try:
            with Image.open(file) as img:  # reads the header only
                if img.width * img.height > MAX_IMAGE_PIXELS:
                    raise CalibrationError(
                        f"{file}: {img.width}x{img.height} pixels, more than the "
                        f"{MAX_IMAGE_PIXELS} a calibration image may have"
                    )
                img.load()
                rgb = img.convert("L" if color == "gray" else "RGB")
        except CalibrationError:
            raise
        except Exception as exc:  # Pillow's decoders fail in their own ways (see vision.images)
            raise CalibrationError(f"{file}: cannot read the image ({exc})") from None
        size = (rgb.height, rgb.width)
        th, tw = _target_size(spec, layout, preprocess, size, file)
        if (th, tw) != size:
            rgb = rgb.resize((tw, th), Image.Resampling.BILINEAR)
        pixels = np.asarray(rgb, dtype=np.float32)
        if pixels.ndim == 2:
            pixels = pixels[..., None]
        elif color == "bgr":
            pixels = pixels[..., ::-1]
        unit = pixels / 255.0
        samples.brightness.append(float(unit.mean()))
        samples.contrast.append(float(unit.std()))
        samples.sizes.append((th, tw))  # what the model is fed
        x = (pixels * preprocess.scale - mean) / std  # h, w, c
        x = x.transpose(2, 0, 1)[None] if layout == "nchw" else x[None]
        samples.feeds.append({spec.name: _check_array(str(file), spec, x)})
        samples.sources.append(file.name)
    return samples


def _per_channel(name: str, values: tuple[float, ...], channels: int) -> np.ndarray:
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise CalibrationError(
            f"{name} has {len(values)} values; the input has {channels} "
            "channels (give one value, or one per channel)"
        )
    return np.asarray(values, dtype=np.float32)


def parse_floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise CalibrationError(f"{what} {text!r}: expected numbers separated by commas") from None
    return values


def parse_size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise CalibrationError(f"resize {text!r}: expected HEIGHTxWIDTH, e.g. 48x192") from None
    if h < 1 or w < 1:
        raise CalibrationError(f"resize {text!r}: height and width must be positive")
    return h, w


def _check_npy_size(name: object, f) -> None:
    """The array in .npy stream `f` decodes to at most MAX_ARRAY_BYTES (read from its
    header; ValueError otherwise, as np.load's own errors are)."""
    from numpy.lib import format as npy

    version = npy.read_magic(f)
    if version == (1, 0):
        shape, _, dtype = npy.read_array_header_1_0(f)
    else:
        shape, _, dtype = npy.read_array_header_2_0(f)
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize > MAX_ARRAY_BYTES:
        raise ValueError(
            f"array {name} of shape {shape} would take {count * dtype.itemsize} bytes, "
            f"more than {MAX_ARRAY_BYTES}"
        )


def _check_npz_sizes(path: Path) -> None:
    """Every array of an .npz within MAX_ARRAY_BYTES, from the headers, before np.load
    decompresses any."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.filename.endswith(".npy"):
                with archive.open(info) as f:
                    _check_npy_size(info.filename.removesuffix(".npy"), f)
