"""edgectl: inspect and measure what edged would do on this device.

Exit codes (documented in docs/CLI.md; scripts rely on them):
  0  success
  1  the work could not be done (no backend ran the model correctly, a runtime failed)
  2  bad input: usage, a missing/corrupt/unsupported model, a wrong shape or input name

Each subcommand is a module of this package with `register(sub)` and `ORDER` (its place in
`edgectl --help`); this file finds them, so a new subcommand is one new file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from edged.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, UsageError

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer its reader left
EXIT_INTERRUPTED = 130  # 128 + SIGINT


def subcommand_modules() -> list[ModuleType]:
    """Every module of edged.cli that defines `register`, in `ORDER`."""
    import edged.cli

    modules = []
    for info in pkgutil.iter_modules(edged.cli.__path__):
        if info.name == "main":  # this module (also `python -m edged.cli.main`'s __main__)
            continue
        module = importlib.import_module(f"edged.cli.{info.name}")
        if callable(getattr(module, "register", None)):
            modules.append(module)
    return sorted(modules, key=lambda module: module.ORDER)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgectl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    for module in subcommand_modules():
        module.register(sub)
    return parser


def _version() -> str:
    from edged import __version__

    return f"edgectl {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _run(build_parser().parse_args(argv))
        sys.stdout.flush()  # here, so that a closed pipe is seen inside the try
        return code
    except BrokenPipeError:
        # The reader went away (`edgectl status | head`): stop quietly, as other CLI tools
        # do. stdout is pointed at /dev/null so the interpreter's last flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run(args) -> int:
    """The subcommand's handler; the errors every subcommand shares become one line on
    stderr and an exit code."""
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        code = _exit_code_of(exc)
        if code is None:
            raise
        print(f"edgectl: error: {exc}", file=sys.stderr)
        return code


def _exit_code_of(exc: Exception) -> int | None:
    """2 for bad input (a usage error, a model or input a backend refused), 1 for a runtime
    that failed, None for anything else. The backends' errors are looked up in sys.modules,
    not imported: the `backends` package imports numpy, which `status` or `plan` never need,
    and an error of that package can only have been raised once it was imported."""
    if isinstance(exc, UsageError):
        return EXIT_BAD_INPUT
    backends = sys.modules.get("backends")
    if backends is None:
        return None
    if isinstance(exc, (backends.InputError, backends.ModelError)):
        return EXIT_BAD_INPUT
    if isinstance(exc, backends.BackendError):
        return EXIT_FAILED
    return None


if __name__ == "__main__":
    sys.exit(main())
