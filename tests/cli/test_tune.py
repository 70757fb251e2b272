"""`edgectl tune` on a fixture board root (never the live system): recorded telemetry in,
the causes ranked, each answered by the catalogue's actions (or said why not), applied
through the journal and reverted to the exact previous state; and the catalogue's rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sysconf.actions import answers, catalogue, evidence_from_telemetry
from tests.support.roots import board_root, tree_state

REPO = Path(__file__).resolve().parents[2]


def edgectl(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    assert "--root" in args, "tests must never tune the live system"
    proc = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "EDGED_STATE_DIR": "/nonexistent-edged-state"},
    )
    assert proc.returncode == rc, proc.stderr
    return proc


def window(outliers: dict[str, int]) -> dict:
    return {"models": {"det": {"count": 1000, "outliers": outliers}}}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = board_root(tmp_path / "root", cpus=4)
    for path, text in {
        "sys/block/vda/queue/rq_affinity": "1\n",
        "sys/block/loop0/queue/rq_affinity": "1\n",  # no hardware: never proposed
        "sys/class/net/eth0/queues/rx-0/rps_cpus": "0\n",
        "sys/class/net/eth0/queues/tx-0/xps_cpus": "0\n",
        "sys/class/net/lo/queues/rx-0/rps_cpus": "0\n",
    }.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_causes_ranked_answered_applied_and_reverted(root: Path, tmp_path: Path) -> None:
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_text(
        "\n".join(
            json.dumps(w)
            for w in [
                window({"softirq:BLOCK": 30, "irq": 8, "unexplained": 2}),
                window({"softirq:BLOCK": 10, "softirq:NET_RX": 5, "preempted": 1}),
            ]
        )
        + "\n"
    )
    before = tree_state(root)
    args = ["tune", "--telemetry", str(telemetry), "--root", str(root), "--inference-cpus", "3"]
    report = json.loads(edgectl(*args, "--json").stdout)
    assert tree_state(root) == before  # a proposal writes nothing
    causes = {c["cause"]: c for c in report["causes"]}
    assert [c["cause"] for c in report["causes"]] == [
        "softirq:BLOCK",
        "irq",
        "softirq:NET_RX",
        "unexplained",
        "preempted",
    ]
    assert causes["softirq:BLOCK"]["outliers"] == 40 and causes["softirq:BLOCK"]["windows"] == 2
    (block,) = causes["softirq:BLOCK"]["proposals"]
    assert [(c["path"], c["old"], c["new"]) for c in block["changes"]] == [
        ("/sys/block/vda/queue/rq_affinity", "1", "2")
    ]
    (rps,) = causes["softirq:NET_RX"]["proposals"]
    assert [(c["path"], c["new"]) for c in rps["changes"]] == [
        ("/sys/class/net/eth0/queues/rx-0/rps_cpus", "7")
    ]
    (irq,) = causes["irq"]["proposals"]
    assert irq["changes"] and all("3" not in c["new"] for c in irq["changes"] if c["kind"] == "irq")
    assert "no interrupt" in causes["unexplained"]["why_none"]
    assert causes["preempted"]["why_none"] == "no action in the catalogue answers 'preempted' yet"

    text = edgectl(*args, "--apply").stdout
    assert "edgectl revert restores" in text
    assert (root / "sys/block/vda/queue/rq_affinity").read_text().strip() == "2"
    assert (root / "sys/class/net/eth0/queues/rx-0/rps_cpus").read_text().strip() == "7"
    again = json.loads(edgectl(*args, "--json").stdout)  # applied: nothing left to propose
    block_again = {c["cause"]: c for c in again["causes"]}["softirq:BLOCK"]["proposals"][0]
    assert block_again["changes"] == [] and "already completes" in block_again["blocked"]
    edgectl("revert", "--root", str(root))
    assert tree_state(root) == before


def test_bad_telemetry_is_a_clear_error(root: Path, tmp_path: Path) -> None:
    for name, text, words in [
        ("missing.json", None, "No such file"),
        ("lines.jsonl", '{"models": {}}\n{"models": \n', "line 2: not JSON"),
        ("other.json", '{"topic": "audit"}', "not telemetry payloads"),
    ]:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        err = edgectl("tune", "--telemetry", str(path), "--root", str(root), rc=2).stderr
        assert str(path) in err and words in err


def test_the_catalogue() -> None:
    modules = catalogue()
    names = [m.NAME for m in modules]
    assert len(names) == len(set(names)) >= 4
    for module in modules:
        assert module.RISK in ("low", "medium", "high") and module.ANSWERS
        assert module.__doc__, f"{module.__name__} says what it changes and why"
    assert [m.NAME for m in modules if answers(m, "softirq:BLOCK")] == ["block-rq-affinity"]
    evidence = evidence_from_telemetry([window({"irq": 2, "x": 0}), window({"irq": 1})])
    assert [(e.cause, e.outliers, e.windows) for e in evidence] == [("irq", 3, 2)]
