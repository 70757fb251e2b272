"""edgectl stays light where it can: building the parser (`--help`, and every command before
its handler runs) imports no numpy, no inference runtime and no psutil, so `edgectl status`
on a small device costs what the status call costs. And the subcommand convention holds:
every module of edged/cli with `register` has its own `ORDER`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = (
    "numpy",
    "onnxruntime",
    "openvino",
    "psutil",
    "prometheus_client",
    "uvicorn",
    # selection's policy (DEFAULT_MAX_DROP, shown in --help) is light; its runs are not
    "edged.selection.select",
    "edged.selection.accuracy",
    "edged.selection.bench",
    "edged.serving",
    "edged.quantize.quantizer",
)


def _modules_after(argv: list[str]) -> tuple[int, list[str]]:
    """Run `edgectl ARGV` in a fresh interpreter; its exit code and which HEAVY modules it
    had imported by the end."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from edged.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main({argv!r})
            except SystemExit as exc:  # --help exits from argparse
                rc = exc.code
        print(json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "100"},
    )
    rc, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    return rc, heavy


@pytest.mark.parametrize(
    "argv", [["--help"], ["status", "--help"], ["plan", "--help"], ["quantize", "--help"]]
)
@pytest.mark.integration
def test_building_the_parser_imports_nothing_heavy(argv: list[str]) -> None:
    assert _modules_after(argv) == (0, [])


@pytest.mark.integration
def test_a_usage_error_of_status_imports_nothing_heavy() -> None:
    """The handler runs and fails on its input (exit 2) before any connection is tried."""
    assert _modules_after(["status", "--address", "garbage"]) == (2, [])


def test_every_subcommand_module_registers_with_a_unique_order() -> None:
    from edged.cli.main import subcommand_modules

    modules = subcommand_modules()
    names = [m.__name__.rsplit(".", 1)[1] for m in modules]
    assert {"backends", "bench", "status", "tuning", "provision", "quantize", "reload"} <= set(
        names
    )
    orders = [m.ORDER for m in modules]
    assert all(isinstance(order, int) for order in orders)
    assert len(set(orders)) == len(orders), dict(zip(names, orders, strict=True))


def test_every_subcommand_has_a_handler() -> None:
    from edged.cli.main import build_parser

    [sub] = [a for a in build_parser()._actions if a.dest == "command"]
    missing = [
        name for name, parser in sub.choices.items() if not callable(parser.get_default("func"))
    ]
    assert sub.choices and not missing
