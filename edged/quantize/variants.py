"""INT8 variants made on the device from calibration data, and the background job that makes
them for the daemon.

`make_variants` quantizes the original with every recipe that suits this CPU on every CPU
backend present (`edged.quantize.quantizer.measure`: gated against the FP32 original, mixed
precision where a recipe fails, timed against FP32) and keeps, per backend, the passing recipe that
ran fastest there — even one slower than FP32, so the selection's evidence can say by how
much INT8 lost. They are cached under `<state>/variants/<key>/` with a manifest, the key
being the original's sha256, the hardware fingerprint, the runtime versions, the data and
the settings: a restart, or a second model with the same original, reuses them.

The daemon runs the job as a child process (`python -m edged.quantize.variants`, see
`background_command`): on the housekeeping CPUs, at SCHED_IDLE, in its own interpreter, so
neither the quantizer's threads nor its GIL touch the inference path. The child also runs
the selection over the whole family, there on the housekeeping CPUs (the inference cores
stay the served model's), and stores it under the key the served model's own selection
would have; the daemon then swaps the pick in. Its last stdout line is a JSON report with
its duration and peak memory.

Exit codes of `python -m edged.quantize.variants`: 0 done (variants made or reused, decision
stored), 1 it failed (the JSON says why), 2 bad input (data that does not fit the model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from backends.errors import ModelError
from backends.model_info import inspect_model
from backends.tensors import TensorSpec
from edged.quantize.calibration import (
    Samples,
    calibration_and_evaluation,
)
from edged.quantize.calibration_spec import CalibrationError, CalibrationSpec
from edged.selection.inputs import feeds_digest

Progress = Callable[[str, int, int], None]
VARIANTS_VERSION = 1


@dataclass
class Made:
    """What `make_variants` produced (or found cached)."""

    key: str
    folder: Path
    variants: list[Path]
    attempts: list[dict[str, Any]]
    fp32_ms: dict[str, float]
    cpu: str
    warnings: list[str]
    cached: bool = False
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "folder": str(self.folder),
            "variants": [str(v) for v in self.variants],
            "attempts": self.attempts,
            "fp32_ms": self.fp32_ms,
            "cpu": self.cpu,
            "warnings": self.warnings,
            "cached": self.cached,
            "duration_s": self.duration_s,
        }


def load_data(
    original: Path,
    spec: CalibrationSpec,
    shapes: dict[str, tuple[int, ...]] | None,
    inputs: Sequence[TensorSpec] | None = None,
) -> tuple[Samples, Samples, list[str]]:
    """Calibration and evaluation samples for `original`, at the shapes it is served with.

    Images are resized to the served size (`shapes`) when the model's size is dynamic, so
    the accuracy is measured on what will be served; the evaluation samples must share one
    shape (runtimes that compile statically take one). `inputs`: the model's inputs when the
    caller has them (the config reads them from the file), else onnxruntime is asked.
    CalibrationError names the data."""
    from backends.model_info import detect_format

    with open(original, "rb") as f:  # the format is told by the first bytes and the name
        fmt = detect_format(original, f.read(64))
    if fmt != "onnx":
        raise CalibrationError(
            f"{original}: calibration makes INT8 variants of ONNX models; "
            f"give a {fmt} model's variants as files instead"
        )
    if inputs is None:
        from edged.quantize.quantizer import input_specs

        inputs = input_specs(original)
    preprocess = spec.preprocess
    if shapes and len(inputs) == 1 and preprocess.size is None:
        shape = shapes.get(inputs[0].name) or shapes.get("")
        if shape is not None and len(shape) == 4:
            from edged.quantize.calibration import image_layout

            try:
                layout = image_layout(inputs[0], preprocess)
            except CalibrationError:
                layout = None
            if layout is not None:
                size = (shape[2], shape[3]) if layout == "nchw" else (shape[1], shape[2])
                preprocess = replace(preprocess, size=size)
    calibration, evaluation, warnings = calibration_and_evaluation(
        spec.data, spec.eval, inputs, preprocess
    )
    first = {k: v.shape for k, v in evaluation.feeds[0].items()}
    for feed, source in zip(evaluation.feeds, evaluation.sources, strict=True):
        got = {k: v.shape for k, v in feed.items()}
        if got != first:
            raise CalibrationError(
                f"{spec.eval or spec.data}: evaluation sample {source} has shape "
                f"{_shapes(got)}, the first has {_shapes(first)}; a model is served at one "
                f"shape: give its shapes (--shape, or `shapes` in the config) or data of one "
                f"size"
            )
        if shapes:
            for name, want in shapes.items():
                key = name or next(iter(got))
                if key in got and tuple(got[key]) != tuple(want):
                    raise CalibrationError(
                        f"{spec.eval or spec.data}: sample {source} has input {key!r} of "
                        f"shape {'x'.join(map(str, got[key]))}, the model is served at "
                        f"{'x'.join(map(str, want))}"
                    )
    return calibration, evaluation, warnings


def _shapes(shapes: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())


def variants_key(original: Path, calibration: Samples, evaluation: Samples, hw, settings) -> str:
    from edged.selection.candidates import runtime_versions

    parts = {
        "v": VARIANTS_VERSION,
        "model": inspect_model(original).sha256,
        "hardware": hw.fingerprint(),
        "runtimes": runtime_versions(),
        "calibration": feeds_digest(calibration.feeds),
        "evaluation": feeds_digest(evaluation.feeds),
        "settings": {
            "targets": list(settings.targets),
            "method": settings.method,
            "max_drop": settings.max_drop,
            "scores": settings.scores.output if settings.scores else None,
        },
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cached_variants(state_dir: Path, key: str) -> Made | None:
    """The variants made earlier under `key`, when every file is still there and whole."""
    folder = state_dir / "variants" / key
    try:
        data = json.loads((folder / "manifest.json").read_text())
        files = [folder / name for name in data["files"]]
        if any(hashlib.sha256(f.read_bytes()).hexdigest() != data["sha256"][f.name] for f in files):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Made(
        key,
        folder,
        files,
        data.get("attempts", []),
        data.get("fp32_ms", {}),
        data.get("cpu", ""),
        data.get("warnings", []),
        True,
        data.get("duration_s", 0.0),
    )


def make_variants(
    original: Path,
    calibration: Samples,
    evaluation: Samples,
    state_dir: Path,
    hw,
    settings=None,
    warnings: Sequence[str] = (),
    progress: Progress | None = None,
) -> Made:
    """The best passing INT8 recipe per CPU backend, as files (cached; see the module)."""
    from edged.quantize.quantizer import measure
    from edged.quantize.recipes import Settings

    settings = settings or Settings(targets=present_targets(hw))
    key = variants_key(original, calibration, evaluation, hw, settings)
    cached = cached_variants(state_dir, key)
    if cached is not None:
        return cached
    start = time.perf_counter()
    folder = state_dir / "variants" / key
    partial = folder.with_name(folder.name + f".part{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    files: dict[str, Path] = {}
    recipes: dict[str, str] = {}
    try:
        with measure(original, calibration, evaluation, settings, progress) as m:
            for target in settings.targets:
                passing = [
                    a
                    for a in m.attempts
                    if a.target == target and a.passed and a.speedup is not None
                ]
                if not passing:
                    continue
                best = max(passing, key=lambda a: a.speedup or 0.0)
                name = f"{original.stem}.{best.recipe.label}.onnx"
                if name not in files:
                    shutil.copyfile(best.path, partial / name)
                    files[name] = folder / name
                    recipes[name] = best.recipe.label
            attempts = [a.to_dict() for a in m.attempts]
            made = Made(
                key,
                folder,
                list(files.values()),
                attempts,
                m.fp32_ms,
                m.cpu,
                list(warnings),
                duration_s=round(time.perf_counter() - start, 2),
            )
        manifest = {
            **made.to_dict(),
            "files": list(files),
            "sha256": {n: hashlib.sha256((partial / n).read_bytes()).hexdigest() for n in files},
            "provenance": provenance(original, recipes, calibration, evaluation, hw),
        }
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)  # whole or not at all
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return made


def provenance(
    original: Path, recipes: dict[str, str], calibration: Samples, evaluation: Samples, hw
) -> dict[str, Any]:
    """What the variants were made from and with, kept in their manifest: the original's
    sha256 (edged.trust serves them only while that original is the trusted one), each
    file's recipe, the data's digests, the tools' versions and the device."""
    from edged import __version__
    from edged.selection.candidates import runtime_versions

    return {
        "original": str(original),
        "original_sha256": inspect_model(original).sha256,  # as variants_key read it (cached)
        "recipes": dict(recipes),
        "calibration_sha256": feeds_digest(calibration.feeds),
        "evaluation_sha256": feeds_digest(evaluation.feeds),
        "tools": {"edged": __version__, **runtime_versions()},
        "device": hw.fingerprint(),
        "made_at": round(time.time(), 3),
    }


def present_targets(hw) -> tuple[str, ...]:
    """The CPU backends installed here that can gate a quantized model."""
    from backends import get_backend, quantize_targets, target_device

    targets = quantize_targets("onnx")
    present = tuple(t for t in targets if get_backend(target_device(t)[0]).version() is not None)
    return present or targets[:1]


def settings_for(policy, hw, cpus=None):
    """The quantize `Settings` a model's variants are made with under its selection policy
    (one place: the key the daemon looks the variants up by must be the child's)."""
    from edged.quantize.recipes import Settings
    from edged.selection.accuracy import ScoreMap

    return Settings(
        targets=present_targets(hw),
        max_drop=policy.max_drop,
        threads=policy.threads,
        cpus=cpus,
        scores=ScoreMap(policy.scores) if policy.scores else None,
    )


def evaluation_of(samples: Samples, spec: CalibrationSpec):
    from edged.selection.decision import Evaluation

    where = f"of {spec.eval}" if spec.eval else f"held out of {spec.data}"
    return Evaluation(samples.feeds, f"{len(samples)} samples {where}")


# -- the daemon's background job ------------------------------------------------------------


def background_command(
    original: Path,
    variants: Sequence[Path],
    spec: CalibrationSpec,
    state_dir: Path,
    policy,
    housekeeping: Sequence[int],
) -> list[str]:
    """argv of the child process that makes the variants and stores the family's decision
    (see the module docstring); `policy` is the served model's selection policy."""
    request = {
        "original": str(original),
        "variants": [str(v) for v in variants],
        "calibration": spec.to_dict(),
        "state_dir": str(state_dir),
        "policy": _policy_dict(policy),
        "housekeeping": list(housekeeping),
    }
    return [sys.executable, "-m", "edged.quantize.variants", "--request", json.dumps(request)]


def _policy_dict(policy) -> dict[str, Any]:
    data = asdict(policy)
    data["shapes"] = {k: list(v) for k, v in (policy.shapes or {}).items()}
    data["cpus"] = list(policy.cpus) if policy.cpus else None
    return data


def _policy_of(data: dict[str, Any]):
    from edged.selection.policy import Policy

    data = dict(data)
    data["shapes"] = {k: tuple(v) for k, v in (data.get("shapes") or {}).items()} or None
    data["cpus"] = tuple(data["cpus"]) if data.get("cpus") else None
    return Policy(**data)


def become_background() -> None:
    """The calling process to SCHED_IDLE (it runs only when a CPU has nothing else to do),
    falling back to nice 19 where the policy is refused; and ended with its parent (the
    daemon killed with -9 leaves no job behind: PR_SET_PDEATHSIG, through libc since the
    standard library has no prctl)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        os.nice(19)
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux/glibc: the daemon's stop still ends the job


def run_request(request: dict[str, Any], progress: Progress | None = None) -> dict[str, Any]:
    """The child's work: make (or reuse) the variants, select over the family on the
    housekeeping CPUs, store the decision under the served policy's key."""
    from backends import probe_hardware
    from edged.selection.bench import pinned_thread
    from edged.selection.decision import cache_key, store
    from edged.selection.select import family_of, select

    start = time.perf_counter()
    original = Path(request["original"])
    spec = CalibrationSpec.from_dict(request["calibration"])
    state_dir = Path(request["state_dir"])
    policy = _policy_of(request["policy"])
    housekeeping = tuple(request.get("housekeeping") or ()) or None
    hw = probe_hardware()
    calibration, evaluation, warnings = load_data(original, spec, dict(policy.shapes or {}))
    settings = settings_for(policy, hw, housekeeping)
    with pinned_thread(housekeeping):
        made = make_variants(
            original, calibration, evaluation, state_dir, hw, settings, warnings, progress
        )
        variants = [Path(v) for v in request.get("variants", [])] + made.variants
        evaluation_set = evaluation_of(evaluation, spec)
        measured = select(
            original,
            hw,
            replace(policy, cpus=housekeeping),
            state_dir,
            progress,
            variants=variants,
            evaluation=evaluation_set,
        )
    family = family_of(original, variants)
    served_key = cache_key(family[0], hw, policy, family[1:], evaluation_set)
    if measured.cache_key != served_key:
        note = (
            f"measured in the background on CPUs {list(housekeeping or ())} at idle "
            f"priority while the model served (the inference cores stay the model's)"
        )
        store(
            state_dir, replace(measured, cache_key=served_key, warnings=[*measured.warnings, note])
        )
    return {
        "ok": True,
        "made": made.to_dict(),
        "variants": [str(v) for v in variants],
        "selection_key": served_key,
        "pick": str(measured.model.path),
        "why": measured.why,
        "duration_s": round(time.perf_counter() - start, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edged.quantize.variants", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--request", required=True, help="the job as JSON")
    args = parser.parse_args(argv)
    become_background()
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's per-node noise

    last: dict[str, Any] = {"phase": "", "at": 0.0}

    def progress(phase: str, done: int, total: int) -> None:
        # At most twice a second per phase: the daemon's job thread reads every line.
        now = time.monotonic()
        if phase == last["phase"] and now - last["at"] < 0.5 and done < total:
            return
        last.update(phase=phase, at=now)
        print(f"progress {phase} {done}/{total}", file=sys.stderr, flush=True)

    try:
        report = run_request(json.loads(args.request), progress)
        code = 0
    except (CalibrationError, ModelError, ValueError) as exc:
        report, code = {"ok": False, "error": str(exc)}, 2
    except Exception as exc:  # the daemon shows it in status; the model keeps serving
        report, code = {"ok": False, "error": f"{exc.__class__.__name__}: {exc}"}, 1
    report.setdefault("peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    # Where and how it ran, for status (and the test that it kept off the inference cores).
    idle = getattr(os, "SCHED_IDLE", None)
    report["scheduling"] = (
        "idle"
        if idle is not None and os.sched_getscheduler(0) == idle
        else f"nice {os.getpriority(os.PRIO_PROCESS, 0)}"
    )
    report["cpus"] = sorted(os.sched_getaffinity(0))
    print(json.dumps(report), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
