"""What several edgectl subcommands share: the exit codes and the usage error, the state
folder, CPU lists, the progress bar, the daemon's address, and the option groups that more
than one subcommand takes. Imports nothing heavy: every subcommand module imports this."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_STATE_DIR = Path("/var/lib/edged")


class UsageError(ValueError):
    """Bad flags or input files: `edgectl: error: MESSAGE` and exit 2."""


def default_state_dir() -> Path:
    """/var/lib/edged when writable (the daemon's), else a per-user cache folder."""
    env = os.environ.get("EDGED_STATE_DIR")
    if env:
        return Path(env)
    if os.access(DEFAULT_STATE_DIR, os.W_OK) or (
        not DEFAULT_STATE_DIR.exists() and os.access(DEFAULT_STATE_DIR.parent, os.W_OK)
    ):
        return DEFAULT_STATE_DIR
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edged"


def check_output_name(model: Path, name: str | None, flag: str) -> None:
    """`name` (a flag's value) is one of the model's outputs, read from the file; UsageError
    naming both otherwise (formats without a file-level signature are not checked)."""
    if name is None:
        return
    from backends.model_info import signature

    outputs = [spec.name for spec in (signature(model) or ([], []))[1]]
    if outputs and name not in outputs:
        raise UsageError(f"{flag} {name}: not an output of {model} ({', '.join(outputs)})")


def parse_cpu_list(text: str, flag: str) -> list[int]:
    """A CPU list such as 2-3,6 given to `flag`; a malformed one is a usage error."""
    from sysconf.cpulist import parse_cpulist

    try:
        return parse_cpulist(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """--cpus: the CPUs to run on, each one this process may use."""
    if not text:
        return None
    cpus = parse_cpu_list(text, "--cpus")
    allowed = os.sched_getaffinity(0)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise UsageError(
            f"--cpus {text}: CPU {outside[0]} is not available to this process "
            f"(allowed: {sorted(allowed)})"
        )
    return tuple(cpus)


def check_threads(args) -> None:
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")


def check_address(text: str, unix_only: bool = False) -> str:
    """`unix:PATH`, `HOST:PORT` or `http://HOST:PORT` ([v6]:PORT too); anything else is a
    usage error (exit 2), not a connection attempt that fails with exit 1."""
    import re

    if text.startswith("unix:") and len(text) > 5:
        return text
    match = re.fullmatch(r"(?:http://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})/?", text)
    if not unix_only and match and 0 < int(match.group(2)) <= 65535:
        return text
    forms = "unix:PATH" if unix_only else "unix:PATH, HOST:PORT or http://HOST:PORT"
    raise UsageError(f"--address {text!r}: expected {forms}")


def or_dash(value: Any, spec: str) -> str:
    """A table cell: `value` formatted by `spec`, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


class Progress:
    """A tqdm bar on stderr for long phases; silent when stderr is not a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar: Any = None  # a tqdm, made on first use (tqdm is imported then)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None or self.bar.desc != phase:
            self.close()
            self.bar = tqdm(total=total, desc=phase, file=sys.stderr, leave=False)
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def quiet_runtime_logs() -> None:
    """stderr is for edgectl's one-line errors: drop the runtimes' native INFO lines (this
    imports no runtime)."""
    from backends import quiet_native_info

    quiet_native_info()


# -- options more than one subcommand takes ----------------------------------------------------


def selection_options() -> argparse.ArgumentParser:
    """The parent parser of `backends` and `bench`: how a model is selected and run."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="selection cache and OpenVINO model cache (default: "
        "/var/lib/edged if writable, else ~/.cache/edged)",
    )
    common.add_argument("--threads", type=int, default=None, help="inference threads")
    common.add_argument("--cpus", default=None, help="CPU list to run on, e.g. 2-3")
    common.add_argument(
        "--shape",
        action="append",
        metavar="NAME=DIMS",
        help="static input shape, e.g. x=1x3x640x640 (repeatable)",
    )
    return common


def policy_of(args, **extra):
    """The selection `Policy` of `selection_options` (plus `extra` fields)."""
    from edged.selection.inputs import parse_shape_args
    from edged.selection.policy import Policy

    return Policy(
        threads=args.threads,
        cpus=parse_cpus(args.cpus),
        shapes=parse_shape_args(args.shape) or None,
        **extra,
    )


def add_preprocess_arguments(parser) -> None:
    """How images become model inputs, for every command that reads calibration images."""
    pre = parser.add_argument_group("image preprocessing (folders of images)")
    pre.add_argument(
        "--resize",
        default=None,
        metavar="HxW",
        help="resize every image (default: the model's fixed size, else the "
        "image's own size rounded down to --multiple)",
    )
    pre.add_argument(
        "--multiple",
        type=int,
        default=32,
        help="size multiple for models with dynamic height/width (default 32)",
    )
    pre.add_argument("--color", default="rgb", choices=("rgb", "bgr", "gray"))
    pre.add_argument(
        "--scale",
        type=float,
        default=1.0 / 255.0,
        help="pixel multiplier before mean/std (default 1/255)",
    )
    pre.add_argument("--mean", default="0", help="per-channel mean, e.g. 0.485,0.456,0.406")
    pre.add_argument("--std", default="1", help="per-channel std, e.g. 0.229,0.224,0.225")
    pre.add_argument(
        "--layout",
        default=None,
        choices=("nchw", "nhwc"),
        help="default: from the model's input shape",
    )


def preprocess_of(args):
    """The `Preprocess` the arguments of `add_preprocess_arguments` describe."""
    from edged.quantize.calibration import parse_floats, parse_size
    from edged.quantize.calibration_spec import Preprocess

    return Preprocess(
        size=parse_size(args.resize) if args.resize else None,
        color=args.color,
        scale=args.scale,
        mean=parse_floats(args.mean, "--mean"),
        std=parse_floats(args.std, "--std"),
        layout=args.layout,
        multiple=args.multiple,
    )
