"""The checks of [[models]]: each model's files are read at load (format, signature, and
the calibration data against the inputs), so a wrong file fails here, naming the key, and
not at serving. The backends and the data loaders are imported only when a model needs them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from edged.config import vision
from edged.config.checks import Checker, ConfigError, Table, show
from edged.config.schema import (
    CALIBRATION_KEYS,
    MAX_BATCH,
    MAX_MS,
    MAX_THREADS,
    MODEL_NAME,
    ModelConfig,
)
from edged.quantize.calibration_spec import CalibrationError, CalibrationSpec, Preprocess
from edged.selection.policy import PRECISIONS


def models(check: Checker, value: Any) -> tuple[ModelConfig, ...]:
    if isinstance(value, dict):
        raise check.fail(
            "models", "expected an array of tables ([[models]]), got one table ([models])"
        )
    if not isinstance(value, list):
        raise check.fail("models", f"expected an array of tables ([[models]]), got {show(value)}")
    found: list[ModelConfig] = []
    seen: dict[str, int] = {}
    aliases: dict[str, int] = {}
    for index, table in enumerate(value):
        model = _read_model(check, table, f"models[{index}]")
        if model.name in seen:
            raise check.fail(
                f"models[{index}].name",
                f"duplicate model name {model.name!r} (also models[{seen[model.name]}])",
            )
        seen[model.name] = index
        for alias in model.serves_as:
            if alias in aliases:
                raise check.fail(
                    f"models[{index}].serves_as",
                    f"{alias!r} is served by models[{aliases[alias]}] already",
                )
            aliases[alias] = index
        found.append(model)
    return tuple(found)


def _read_model(check: Checker, data: Any, prefix: str) -> ModelConfig:
    """One [[models]] table, whatever its files hold. Its checks read model and data files
    that may be crafted or newer than the readers; a reader that fails in a way of its own
    (not the project's ModelError) must still be this key's error, so that the daemon exits
    2 (no restart loop) or a reload keeps the running config, instead of a traceback."""
    try:
        return _model(check, data, prefix)
    except ConfigError:
        raise
    except (RecursionError, MemoryError, ValueError, LookupError, TypeError, OSError) as exc:
        key = f"{prefix}.path"
        name = data.get("path") if isinstance(data, dict) else None
        raise check.fail(key, f"cannot read {name!r}: {type(exc).__name__}: {exc}"[:500]) from None


def _model(check: Checker, data: Any, prefix: str) -> ModelConfig:
    if not isinstance(data, dict):
        raise check.fail(prefix, f"expected a table, got {show(data)}")
    if not data:
        raise check.fail(prefix, "empty [[models]] table; name and path are required")
    t = Table(check, data, prefix, ModelConfig)
    name = t.string("name")
    # Names are URL path segments (/v2/models/<name>): "." and ".." would be rewritten.
    if not MODEL_NAME.fullmatch(name) or set(name) == {"."}:
        raise check.fail(
            f"{prefix}.name",
            f"must be letters, digits, '_', '.' or '-' (not only dots), got {name!r}",
        )
    path = _model_file(check, t.string("path"), f"{prefix}.path")
    sha256 = _sha256(check, t) if "sha256" in t else None
    signature = check.path(t.string("signature"), t.key("signature")) if "signature" in t else None
    if not check.may_read(path, sha256, signature):
        return _unread(check, t, name, path, sha256, signature)
    _sniff(check, path, f"{prefix}.path")
    variants = _variants(check, t, path)
    precision = t.string("precision")
    if precision not in PRECISIONS:
        raise check.fail(f"{prefix}.precision", f'must be "auto" or "int8", got {precision!r}')
    shapes = t.read("shapes", _shapes, check)
    threads = t.integer("threads", 1, MAX_THREADS)
    max_batch = t.integer("max_batch_size", 1, MAX_BATCH)
    preferred = t.read("preferred_batch_sizes", check.int_list, 1, max_batch)
    if len(set(preferred)) != len(preferred):
        raise check.fail(
            f"{prefix}.preferred_batch_sizes", f"lists a size twice: {list(preferred)}"
        )
    return ModelConfig(
        name=name,
        path=path,
        variants=variants,
        calibration=t.read("calibration", _calibration, check, path, shapes),
        precision=precision,
        backend=_backend(check, t.string("backend"), f"{prefix}.backend"),
        scores=_scores(check, t.string("scores"), path, f"{prefix}.scores"),
        threads=threads,
        cpus=t.read("cpus", check.cpus),
        shapes=shapes,
        max_batch_size=max_batch,
        preferred_batch_sizes=tuple(sorted(preferred)),
        max_queue_delay_us=t.integer("max_queue_delay_us", 0, 10_000_000),
        max_queue_size=t.integer("max_queue_size", 1, 65_536),
        timeout_ms=t.integer("timeout_ms", 1, MAX_MS),
        watchdog_ms=t.integer("watchdog_ms", 1, MAX_MS),
        rt_priority=_rt_priority(check, t),
        period_ms=t.number(
            "period_ms",
            lambda x: 0 < x <= MAX_MS,
            f"a number of milliseconds above 0, at most {MAX_MS}",
        ),
        standby=t.boolean("standby") if "standby" in t.data else None,
        backend_options=_backend_options(check, t),
        image=t.read("image", vision.image, check, path, shapes) if "image" in t else None,
        detector=(
            t.read("detector", vision.detector, check, path, shapes) if "detector" in t else None
        ),
        serves_as=t.read("serves_as", vision.serves_as, check),
        sha256=sha256,
        signature=signature,
    )


def _unread(
    check: Checker, t: Table, name: str, path: Path, sha256: str | None, signature: Path | None
) -> ModelConfig:
    """Under [security] models = "enforce", a model whose file is not trusted: no byte of it
    is read here (not even its header, as the checks of its variants, pictures, detector,
    scores and calibration would), and the daemon refuses it at load, naming why. Only what
    the table itself says is checked; a reload once the file is trusted checks the rest."""
    variants = t.data.get("variants", [])
    return ModelConfig(
        name=name,
        path=path,
        variants=tuple(
            _model_file(check, raw, f"{t.key('variants')}[{i}]")
            for i, raw in enumerate(variants if isinstance(variants, list) else [])
            if isinstance(raw, str)
        ),
        backend=_backend(check, t.string("backend"), t.key("backend")),
        threads=t.integer("threads", 1, MAX_THREADS),
        cpus=t.read("cpus", check.cpus),
        serves_as=t.read("serves_as", vision.serves_as, check),
        sha256=sha256,
        signature=signature,
        unread=True,
    )


def _sha256(check: Checker, t: Table) -> str:
    value = t.string("sha256").strip().lower()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise check.fail(t.key("sha256"), f"must be 64 hexadecimal digits, got {show(value)}")
    return value


def _backend_options(check: Checker, t: Table) -> dict[str, dict[str, Any]]:
    """[models.backend_options.<backend>] tables, each read by that backend's own OPTIONS
    (the backend module says what its keys mean; this reader knows none of them). A backend
    may own a [[models]] key of an older config too (RKNN's `npu_cores`: OLDER_KEYS)."""
    from backends import canonical_name, older_option_keys, read_options
    from backends.errors import OptionError

    tables: dict[str, Any] = {}
    if "backend_options" in t:
        raw = t.data["backend_options"]
        if not isinstance(raw, dict):
            raise check.fail(
                t.key("backend_options"),
                f"expected a table of backend tables ([models.backend_options.rknn]), "
                f"got {show(raw)}",
            )
        for name, table in raw.items():
            key = t.key(f"backend_options.{name}")
            if not isinstance(table, dict):
                raise check.fail(key, f"expected a table of {name}'s options, got {show(table)}")
            canonical = canonical_name(name)
            if canonical in tables:
                raise check.fail(key, f"{name} is {canonical}, given twice")
            tables[canonical] = (key, table)
    older = {k: backend for k, backend in older_option_keys().items() if k in t}
    for option, backend in older.items():  # an option written as a [[models]] key
        if option in tables.get(backend, ("", {}))[1]:
            raise check.fail(
                t.key(option), f"given twice: here and in backend_options.{backend}.{option}"
            )
        key, table = tables.get(backend, (t.key(f"backend_options.{backend}"), {}))
        tables[backend] = (key, {**table, option: t.data[option]})
    read: dict[str, dict[str, Any]] = {}
    for name, (key, table) in tables.items():
        try:
            read[name] = read_options(name, table)
        except OptionError as exc:
            if older.get(exc.key) == name:
                raise check.fail(t.key(exc.key), str(exc)) from None
            raise check.fail(f"{key}.{exc.key}" if exc.key else key, str(exc)) from None
    return read


# The kernel's own files: regular files whose size says nothing (0) and whose reading may
# never end (/proc/self/pagemap) or has effects. No model lives there.
KERNEL_DIRS = (Path("/proc"), Path("/sys"), Path("/dev"))


def _model_file(check: Checker, raw: str, key: str) -> Path:
    """A regular, readable file of at most [server] max_model_bytes, outside the
    kernel's folders: checked before anything reads it, so an endless, sparse or special
    file fails here and not by filling memory."""
    path = check.path(raw, key)
    if not path.exists():
        raise check.fail(key, f"no such file: {path}")
    real = path.resolve()
    if any(real.is_relative_to(kernel) for kernel in KERNEL_DIRS):
        raise check.fail(key, f"{path} is a kernel file ({real}), not a model")
    if not path.is_file():
        raise check.fail(key, f"not a file: {path}")
    if not os.access(path, os.R_OK):
        raise check.fail(key, f"permission denied: {path}")
    size = path.stat().st_size
    if size > check.max_model_bytes:
        raise check.fail(
            key,
            f"{path} is {size} bytes, more than [server] max_model_bytes ({check.max_model_bytes})",
        )
    return path


def _sniff(check: Checker, path: Path, key: str) -> None:
    """The file is a model edged can read (format, and its whole structure: a
    truncated, random or empty file fails here, naming the key, not at serving)."""
    from backends.errors import ModelError
    from backends.model_info import inspect_model

    try:
        inspect_model(path)
    except ModelError as exc:
        raise check.fail(key, str(exc)) from None


def _scores(check: Checker, output: str | None, path: Path, key: str) -> str | None:
    """A detector's score output: one of the model's outputs (read from the file)."""
    from backends.model_info import signature

    if output is None:
        return None
    outputs = [spec.name for spec in (signature(path) or ([], []))[1]]
    if outputs and output not in outputs:
        raise check.fail(key, f"{output!r} is not an output of the model ({', '.join(outputs)})")
    return output


def _variants(check: Checker, t: Table, original: Path) -> tuple[Path, ...]:
    """Each variant exists and takes and gives what the original does (read from the
    files: names, dtypes, fixed dims), so a wrong file fails here, not at serving."""
    from backends.errors import ModelError
    from backends.model_info import signature, signature_mismatch

    value = t.data.get("variants", [])
    if not isinstance(value, list):
        raise check.fail(t.key("variants"), f"must be an array of model paths, got {show(value)}")
    if not value:
        return ()
    try:
        want = signature(original)
    except ModelError as exc:
        raise check.fail(t.key("path"), str(exc)) from None
    paths = []
    for index, raw in enumerate(value):
        key = f"{t.key('variants')}[{index}]"
        if not isinstance(raw, str):
            raise check.fail(key, f"must be a path, got {show(raw)}")
        path = _model_file(check, raw, key)
        paths.append(path)
        if not check.may_read(path, None, None):
            continue  # enforce: left unread; the daemon refuses the model for it at load
        _sniff(check, path, key)
        try:
            got = signature(path)
        except ModelError as exc:
            raise check.fail(key, str(exc)) from None
        problem = signature_mismatch(want, got) if want and got else None
        if problem:
            raise check.fail(key, f"{path} does not match its original {original}: {problem}")
    return tuple(paths)


def _calibration(
    value: Any, key: str, check: Checker, original: Path, shapes: dict[str, tuple[int, ...]] | None
) -> CalibrationSpec:
    """A path (an .npz, a folder of .npy files or of images), or a table with `data`,
    `eval` and the image preprocessing of `edgectl quantize` (resize "HxW", multiple,
    color, scale, mean and std as numbers or arrays, layout). The data is read here
    against the original's inputs, so data that does not fit is an error at load (and
    at --check-config) naming the file and the input."""
    if isinstance(value, str):
        value = {"data": value}
    if not isinstance(value, dict):
        raise check.fail(key, f"must be a path or a table with data = PATH, got {show(value)}")
    t = Table(check, value, key, CalibrationSpec, CALIBRATION_KEYS)
    paths = {}
    for name in ("data", "eval"):
        if name not in t and name == "eval":
            continue
        path = check.path(t.string(name), t.key(name))
        if not path.exists():
            raise check.fail(t.key(name), f"no such file or folder: {path}")
        paths[name] = path
    pre: dict[str, Any] = {}
    try:
        if "resize" in t:
            from edged.quantize.calibration import parse_size

            pre["size"] = parse_size(t.string("resize"))
        for name in ("mean", "std"):
            if name in t:
                pre[name] = t.read(name, check.numbers)
        if "scale" in t:
            pre["scale"] = t.number("scale", lambda x: 0 < x < math.inf, "a number > 0")
        if "multiple" in t:
            pre["multiple"] = t.integer("multiple", 1)
        for name in ("color", "layout"):
            if name in t:
                pre[name] = t.string(name)
        spec = CalibrationSpec(paths["data"], paths.get("eval"), Preprocess(**pre))
        _calibration_fits(check, original, spec, shapes, key)
    except CalibrationError as exc:
        raise check.fail(key, str(exc)) from None
    return spec


def _calibration_fits(
    check: Checker,
    original: Path,
    spec: CalibrationSpec,
    shapes: dict[str, tuple[int, ...]] | None,
    key: str,
) -> None:
    """The data read as the daemon will read it, against the inputs in the file."""
    from backends.errors import ModelError
    from backends.model_info import signature
    from edged.quantize.variants import load_data

    try:
        io = signature(original)
    except ModelError as exc:
        raise check.fail(key.rsplit(".", 1)[0] + ".path", str(exc)) from None
    load_data(original, spec, shapes, io[0] if io else None)


def _rt_priority(check: Checker, t: Table) -> int:
    value = t.integer("rt_priority", 0)
    if value > 99:
        raise check.fail(
            t.key("rt_priority"), f"SCHED_FIFO priorities are 1-99 (0 = off), got {value}"
        )
    return value


def _backend(check: Checker, spec: str, key: str) -> str:
    """ "auto" or "backend[:device[:precision]]"; the backend name made canonical (so
    "ov:CPU" and "openvino:CPU" share one cached selection). Devices and precisions
    depend on the machine and are checked by selection, not here."""
    from backends import REGISTRY, canonical_name  # names only; no runtime is imported

    if spec == "auto":
        return spec
    parts = spec.split(":")
    name = canonical_name(parts[0])
    if name not in REGISTRY or len(parts) > 3 or not all(p.strip() for p in parts):
        raise check.fail(
            key,
            f'must be "auto" or BACKEND[:DEVICE[:PRECISION]] with '
            f"BACKEND one of {', '.join(REGISTRY)}; got {spec!r}",
        )
    return ":".join([name, *parts[1:]])


def _shapes(value: Any, key: str, check: Checker) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, dict):
        raise check.fail(key, f"must be a table of input name = [dims], got {show(value)}")
    shapes = {}
    for name, dims in value.items():
        shape = check.int_list(dims, f"{key}.{name}", 1)
        if not shape:
            raise check.fail(f"{key}.{name}", "must list at least one dimension")
        shapes[name] = shape
    return shapes
