"""The aarch64 lane's side of the tests: programs run in the emulated arm64 root, driven from the
host's pytest (collecting the suite under emulation alone would cost minutes).

The root (built by scripts/arm64_root.py, or EDGED_ARM64_ROOT) is a bookworm arm64 tree with
a venv in opt/edged whose `bin/python3`, `bin/edgectl` and `bin/edged` are host-side wrappers
that run the aarch64 interpreter under qemu-aarch64. Every run here gets this working tree
first on its path and a fixed CPU model (EDGED_ARM64_CPU), and prints its emulated wall time
as an `arm64-time:` line: timings are reported, never gated on (emulation is ~100x slower and
says nothing about a board's speed).

`python -m tests.support.arm64 outputs JOBS OUT [CACHE]` is the output recorder the comparison
test runs twice, on the host and in the root: each model on its candidates, on the evaluation
inputs selection makes, pickled for the host to compare.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edged.selection.accuracy import Accuracy
from tests.support import REPO

CLS, CLS_INT8 = "ppocr_cls.onnx", "ppocr_cls_int8.onnx"
DET, DET_INT8 = "ppocrv4_det.onnx", "ppocrv4_det_int8.onnx"
FACE = "face_detection_short_range.tflite"
ROOT_ENV = "EDGED_ARM64_ROOT"  # a built root to use as is (the lane's override)
CPU_ENV = "EDGED_ARM64_CPU"
DEFAULT_CPU = "cortex-a76"  # RK3588, Raspberry Pi 5: dotprod, fp16
# What the hardware probe must read for each emulated core (QEMU 10 writes /proc/cpuinfo for
# the -cpu model): the ARM_INT8_FEATURES of sysconf.hardware it has.
CPU_INT8_FEATURES = {
    "cortex-a53": ["asimd"],  # ARMv8.0: i.MX8M Plus
    "cortex-a72": ["asimd"],  # ARMv8.0: RK3399, Raspberry Pi 4
    "cortex-a55": ["asimd", "asimddp"],  # ARMv8.2: RK3568, i.MX93
    "cortex-a76": ["asimd", "asimddp"],  # ARMv8.2: RK3588, Raspberry Pi 5
}
# Environment the host's Python may carry that must not reach the emulated one.
_HOST_ONLY = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "EDGED_ISA_QEMU", "VIRTUAL_ENV")


def lane_cpu() -> str:
    return os.environ.get(CPU_ENV) or DEFAULT_CPU


def build_root() -> Path | None:
    """scripts/arm64_root.py's ensure() (imported by path: scripts/ is no package), or None
    when the script is not there."""
    script = REPO / "scripts" / "arm64_root.py"
    if not script.exists():
        return None
    spec = importlib.util.spec_from_file_location("edged_arm64_root", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return Path(module.ensure())


@dataclass
class Run:
    """A finished program in the root."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def json(self):
        try:
            return json.loads(self.stdout)
        except ValueError:
            raise AssertionError(
                f"not JSON (exit {self.returncode}): {self.stdout[-2000:]}\n{self.stderr[-3000:]}"
            ) from None

    def why(self) -> str:
        return f"{' '.join(self.argv)}: exit {self.returncode}\n{self.stderr[-4000:]}"


@dataclass(frozen=True)
class Arm64Root:
    path: Path
    cpu: str = DEFAULT_CPU

    @property
    def bin(self) -> Path:
        return self.path / "opt" / "edged" / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python3"

    @property
    def edgectl(self) -> Path:
        return self.bin / "edgectl"

    @property
    def edged(self) -> Path:
        return self.bin / "edged"

    def env(self, cpu: str | None = None, **extra: str) -> dict[str, str]:
        """The environment of a run: this checkout on the path (whatever the root's own .pth
        says), no .pyc written into it by the emulated interpreter, the CPU model, and no
        host Python settings."""
        env = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY}
        env["PYTHONPATH"] = str(REPO)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env[CPU_ENV] = cpu or self.cpu
        if "EDGED_ARM64_QEMU" not in env:  # the pinned one (a hand-built root's wrapper needs it)
            env["EDGED_ARM64_QEMU"] = str(_qemu_aarch64())
        env.update(extra)
        return env

    def run(
        self,
        program: str,
        *args: str | Path,
        label: str,
        timeout: float = 900,
        cpu: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Run:
        """`program` (python3, edgectl, edged) of the root with `args`, its time printed."""
        argv = [str(self.bin / program), *map(str, args)]
        start = time.perf_counter()
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**self.env(cpu), **(env or {})},
            timeout=timeout,
        )
        seconds = time.perf_counter() - start
        print(f"arm64-time: {label}: {seconds:.1f} s emulated ({cpu or self.cpu})")
        return Run(argv, proc.returncode, proc.stdout, proc.stderr, seconds)

    def daemon_argv(self) -> list[str]:
        """tests.support.daemon_harness starts `[*python_argv(), "-m", "edged.daemon",
        "--config", CONFIG]`; as its python_argv, this runs the root's `bin/edged --config
        CONFIG` instead (the shell drops "-m edged.daemon" and execs, so the harness's pid is
        the emulator's and its signals reach the daemon)."""
        return ["/bin/sh", "-c", 'shift 2; exec "$0" "$@"', str(self.edged)]


@functools.cache
def _qemu_aarch64() -> Path:
    sys.path.insert(0, str(REPO))
    from scripts.qemu_user import qemu_binary

    return qemu_binary("aarch64")


# -- the output recorder (runs on the host and in the root) ---------------------------------


def record_outputs(
    jobs: list[dict], out: Path, state_dir: Path | None = None, threads: int = 1
) -> None:
    """For each job {"model": path, "shapes": {name: dims} | None, "inputs": path.npz
    (optional)}: the evaluation inputs selection makes (edged.selection.inputs, seeds
    0..VERIFY_SAMPLES-1), or the .npz's (arrays named after the inputs, one sample per
    index of the first axis: real images, for a detector), the outputs of the
    model's float32 reference (selection's: the first of reference_candidates that loads) and
    of every available candidate that runs the model's own arithmetic or float32 (precision
    "model" or "fp32": OpenVINO's bf16/fp16 are selection's business, and each INT8 compile
    costs tens of seconds emulated). OpenVINO compiles go to its cache under `state_dir` (the
    selection's: the lane's `edgectl backends` runs compiled the fp32 ones first)."""
    import hashlib

    from backends import LoadOptions, get_backend, probe_hardware, reference_candidates
    from backends.errors import BackendError, InputError, ModelError
    from backends.model_info import inspect_model
    from edged.selection.candidates import backend_candidates
    from edged.selection.inputs import make_inputs, resolve_shapes
    from edged.selection.policy import VERIFY_SAMPLES

    hw = probe_hardware()
    results = {"arch": hw.arch, "isa": hw.isa_summary(), "models": {}}
    for job in jobs:
        model = inspect_model(job["model"])
        entry: dict = {"runs": {}}
        samples = None
        base = LoadOptions(threads=threads, cache_root=state_dir)
        candidates = [("reference", c) for c in reference_candidates(model)] + [
            (c.key, c)
            for c in backend_candidates(hw, model)
            if c.available and c.precision in ("model", "fp32")
        ]
        for label, candidate in candidates:
            if label == "reference" and "reference" in entry["runs"]:
                continue  # the first reference runtime that loads, as selection takes
            start = time.perf_counter()
            try:
                if samples is None and job.get("inputs"):
                    import numpy as np

                    with np.load(job["inputs"]) as arrays:
                        count = len(next(iter(arrays.values())))
                        samples = [
                            {k: v[i : i + 1] for k, v in arrays.items()} for i in range(count)
                        ]
                    shapes = {k: tuple(v.shape) for k, v in samples[0].items()}
                    entry["inputs_sha256"] = hashlib.sha256(
                        b"".join(f[k].tobytes() for f in samples for k in sorted(f))
                    ).hexdigest()
                    entry["shapes"] = {k: list(v) for k, v in shapes.items()}
                if samples is None:
                    probe_session = get_backend(candidate.backend).load(model, candidate, base)
                    shapes = resolve_shapes(probe_session.inputs, job.get("shapes"), model.name)
                    samples = [
                        make_inputs(probe_session.inputs, shapes, seed)
                        for seed in range(VERIFY_SAMPLES)
                    ]
                    probe_session.close()
                    digest = hashlib.sha256()
                    for feeds in samples:
                        for name in sorted(feeds):
                            digest.update(feeds[name].tobytes())
                    entry["inputs_sha256"] = digest.hexdigest()
                    entry["shapes"] = {k: list(v) for k, v in shapes.items()}
                options = LoadOptions(threads=threads, shapes=shapes, cache_root=state_dir)
                session = get_backend(candidate.backend).load(model, candidate, options)
                try:
                    outputs = [session.run(feeds) for feeds in samples]
                    info = session.info()
                finally:
                    session.close()
            except (BackendError, InputError, ModelError, ImportError) as exc:
                if label != "reference":
                    entry["runs"][label] = {"error": str(exc).splitlines()[0]}
                continue
            entry["runs"][label] = {
                "key": candidate.key,
                "outputs": outputs,
                "precision": info.get("precision"),
                "seconds": round(time.perf_counter() - start, 2),
            }
        results["models"][str(model.path)] = entry
    with out.open("wb") as f:
        pickle.dump(results, f)


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or argv[0] != "outputs":
        print("usage: python -m tests.support.arm64 outputs JOBS.json OUT.pickle [STATE_DIR]")
        return 2
    cache = Path(argv[3]) if len(argv) == 4 else None
    record_outputs(json.loads(Path(argv[1]).read_text()), Path(argv[2]), cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


def figure(acc: Accuracy) -> str:
    """An accuracy comparison on one line, for the `arm64-figure:` lines of the notes."""
    top1 = "" if acc.top1_agreement is None else f" top-1 {acc.top1_agreement:.3f}"
    return (
        f"score {acc.score:.6f} ({acc.rule}) cosine {acc.cosine:.6f} min {acc.cosine_min:.6f} "
        f"max-abs {acc.max_abs:.3g}{top1}"
    )
