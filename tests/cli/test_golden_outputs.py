"""What users see, byte for byte: `edgectl` help texts and the serving `/metrics` exposition.

These are interfaces people script against (and the layout of the code behind them changes),
so a difference fails here until tests/golden/ is regenerated on purpose
(EDGED_UPDATE_GOLDEN=1; see tests/golden/README.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from edged.serving.metrics import ServingMetrics

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("EDGED_UPDATE_GOLDEN") == "1"
COMMANDS = (
    "backends",
    "bench",
    "status",
    "plan",
    "apply",
    "revert",
    "tune",
    "provision",
    "audit",
    "fleet",
    "quantize",
    "reload",
)


def _matches(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path}: no golden file (EDGED_UPDATE_GOLDEN=1 writes it)"
    expected = path.read_text()
    assert text == expected, f"{path} differs from what edgectl printed now:\n{text}"


def _edgectl(*argv: str) -> str:
    # The console script next to this interpreter: what a user runs, entry point included.
    edgectl = Path(sys.executable).with_name("edgectl")
    env = dict(os.environ, COLUMNS="100")
    done = subprocess.run(
        [str(edgectl), *argv], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


@pytest.mark.integration
def test_edgectl_help_is_unchanged():
    _matches(GOLDEN / "help" / "edgectl.txt", _edgectl("--help"))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.integration
def test_subcommand_help_is_unchanged(command):
    _matches(GOLDEN / "help" / f"{command}.txt", _edgectl(command, "--help"))


def test_every_subcommand_has_a_golden_help():
    # A new subcommand brings its golden help text along (and is listed in COMMANDS).
    listed = {p.stem for p in (GOLDEN / "help").glob("*.txt")} - {"edgectl"}
    assert listed == set(COMMANDS)


def test_metrics_exposition_is_unchanged():
    metrics = ServingMetrics()
    metrics.observe("det", 0.001, 0.002, 0.003, 2)
    metrics.count("det", "200")
    text = generate_latest(metrics.registry).decode()
    # `_created` samples are the wall-clock time the series was made: the one volatile line.
    stable = "".join(line + "\n" for line in text.splitlines() if "_created" not in line)
    _matches(GOLDEN / "metrics.txt", stable)
