"""The tuning loop (edged.autotune) on a board's temporary root, fed windows from a small
simulated kernel: a softirq source on the inference core that a change fixes is found,
applied, verified and kept; a change that does not help, or that makes the median worse, is
reverted on its own and not tried again until the evidence changes; the budget and the
propose mode hold back; `edgectl revert` restores the root exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from edged.autotune.ledger import LEDGER_NAME
from edged.autotune.loop import TuningLoop
from edged.autotune.settings import TuningConfig
from edged.autotune.verdict import WindowFigures, judge, mann_whitney_less
from sysconf.cpusets import CpuPlan
from sysconf.journals import Journals
from sysconf.sysroot import SysRoot
from tests.support.roots import board_root, tree_state
from tests.support.schema import check

PLAN = CpuPlan(inference=(3,), housekeeping=(0, 1, 2), source="override")
RQ = "sys/block/vda/queue/rq_affinity"


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def publish_event(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))

    def states(self) -> list[str]:
        for seq, (kind, detail) in enumerate(self.events, 1):  # as the publisher sends them
            check("event", {"ts": 1.0, "seq": seq, "bdSeq": 0, "kind": kind, **detail})
        return [d["state"] for k, d in self.events if k == "tuning"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = board_root(tmp_path / "root", cpus=4)
    (root / RQ).parent.mkdir(parents=True, exist_ok=True)
    (root / RQ).write_text("1\n")
    return root


def window(p50: float, p999: float, outliers: dict[str, int], count: int = 600) -> dict:
    return {
        "models": {
            "det": {
                "count": count,
                "p50_ms": p50,
                "p99_ms": round(p50 * 1.6, 3),
                "p999_ms": p999,
                "outlier_count": sum(outliers.values()),
                "outliers": outliers,
            }
        }
    }


class Kernel:
    """Windows as the device would give them: the BLOCK softirq lands on the inference core
    (long tail, its outliers) until rq_affinity is 2 on the root, if `fixable`."""

    def __init__(self, root: Path, fixable: bool = True, slower_after: float = 1.0) -> None:
        self.root, self.fixable, self.slower_after = root, fixable, slower_after
        self.rng = random.Random(7)

    def window(self) -> dict:
        noise = self.rng.uniform(0.95, 1.05)
        fixed = (self.root / RQ).read_text().strip() == "2"
        if fixed and self.fixable:
            return window(2.0 * noise * self.slower_after, 3.1 * noise, {"softirq:TIMER": 2})
        if fixed:  # applied, no effect
            return window(2.0 * noise, 9.0 * noise, {"softirq:BLOCK": 5, "softirq:TIMER": 1})
        return window(2.0 * noise, 9.0 * noise, {"softirq:BLOCK": 5, "softirq:TIMER": 1})


def make_loop(root: Path, tmp_path: Path, sink: Sink, **settings) -> TuningLoop:
    config = TuningConfig(**{"auto": "apply", "windows": 3, "settle_windows": 1, **settings})
    return TuningLoop(config, PLAN, tmp_path, sink, root=SysRoot.at(root))


def feed(loop: TuningLoop, kernel: Kernel, n: int) -> None:
    for _ in range(n):
        loop.observe(kernel.window())


def test_a_softirq_source_is_found_fixed_verified_and_kept(root: Path, tmp_path: Path) -> None:
    before = tree_state(root)
    sink, kernel = Sink(), Kernel(root)
    loop = make_loop(root, tmp_path, sink)
    feed(loop, kernel, 2)
    assert loop.phase == "observing" and (root / RQ).read_text() == "1\n"  # 2 windows: wait
    feed(loop, kernel, 1)
    assert (root / RQ).read_text().strip() == "2" and loop.phase == "settling"
    feed(loop, kernel, 1 + 3)  # settle, then as many windows as the evidence
    assert loop.phase == "observing"
    assert sink.states() == ["applied", "kept"]
    ledger = json.loads((tmp_path / LEDGER_NAME).read_text())
    (step,) = ledger["steps"]
    assert step["state"] == "kept" and step["action"] == "block-rq-affinity"
    assert step["cause"] == "softirq:BLOCK" and step["reason"].startswith("helped")
    assert step["verdict"]["before"]["p999_ms"] > 2 * step["verdict"]["after"]["p999_ms"]
    assert step["verdict"]["p_value"] <= 0.05
    assert len(step["before_windows"]) == len(step["after_windows"]) == 3
    assert (root / RQ).read_text().strip() == "2"
    # Kept: the next windows have nothing the catalogue answers (the tick stays, said why).
    feed(loop, kernel, 3)
    assert sink.states() == ["applied", "kept"]
    assert [r["cause"] for r in loop.ledger.remaining] == ["softirq:TIMER"]
    # Journalled with everything else: edgectl's revert restores the exact previous state.
    Journals(SysRoot.at(root), "/var/lib/edged").revert()
    assert tree_state(root) == before


def test_a_change_that_does_not_help_is_reverted_and_not_retried(
    root: Path, tmp_path: Path
) -> None:
    before = tree_state(root)
    sink, kernel = Sink(), Kernel(root, fixable=False)
    loop = make_loop(root, tmp_path, sink)
    feed(loop, kernel, 3 + 1 + 3)
    assert sink.states() == ["applied", "reverted"]
    assert (root / RQ).read_text() == "1\n"  # taken back at once
    step = loop.ledger.steps[-1]
    assert step["reason"].startswith("did not help") and step["undo"] == [[f"/{RQ}", "restored"]]
    # The same evidence again: not retried, and said so.
    feed(loop, kernel, 6)
    assert sink.states() == ["applied", "reverted"]
    assert "tried before and reverted" in loop.ledger.remaining[0]["why"]
    # The evidence changes (a second disk): the action proposes other changes, tried anew.
    (root / "sys/block/sdb/queue").mkdir(parents=True)
    (root / "sys/block/sdb/queue/rq_affinity").write_text("1\n")
    feed(loop, kernel, 3)
    assert sink.states()[-1] == "applied"
    feed(loop, kernel, 4)
    assert sink.states() == ["applied", "reverted", "applied", "reverted"]
    # The undone applies leave nothing for revert to do twice; the root is as it was.
    Journals(SysRoot.at(root), "/var/lib/edged").revert()
    (root / "sys/block/sdb/queue/rq_affinity").unlink()
    (root / "sys/block/sdb/queue").rmdir()
    (root / "sys/block/sdb").rmdir()
    assert tree_state(root) == before


def test_a_change_that_makes_the_median_worse_is_reverted(root: Path, tmp_path: Path) -> None:
    sink, kernel = Sink(), Kernel(root, slower_after=1.4)
    loop = make_loop(root, tmp_path, sink)
    feed(loop, kernel, 7)
    assert sink.states() == ["applied", "reverted"]
    assert loop.ledger.steps[-1]["reason"].startswith("worse: median p50")
    assert (root / RQ).read_text() == "1\n"


def test_the_budget_and_the_propose_mode_hold_back(root: Path, tmp_path: Path) -> None:
    sink, kernel = Sink(), Kernel(root, fixable=False)
    loop = make_loop(root, tmp_path / "a", sink, max_changes_per_hour=1)
    (tmp_path / "a").mkdir()
    feed(loop, kernel, 7)
    (root / "sys/block/sdb/queue").mkdir(parents=True)
    (root / "sys/block/sdb/queue/rq_affinity").write_text("1\n")
    feed(loop, kernel, 6)
    assert sink.states() == ["applied", "reverted", "proposed"]  # once, not every window
    assert "budget of 1 changes an hour is spent" in loop.ledger.steps[-1]["reason"]
    assert (root / "sys/block/sdb/queue/rq_affinity").read_text() == "1\n"

    before = tree_state(root)
    sink = Sink()
    loop = make_loop(root, tmp_path, sink, auto="propose")
    feed(loop, kernel, 8)
    assert sink.states() == ["proposed"]
    assert tree_state(root) == before
    (step,) = loop.ledger.steps
    assert [c["path"] for c in step["changes"]] == [
        "/sys/block/sdb/queue/rq_affinity",
        "/sys/block/vda/queue/rq_affinity",
    ]


def test_a_restarted_daemon_keeps_the_record(root: Path, tmp_path: Path) -> None:
    sink, kernel = Sink(), Kernel(root, fixable=False)
    feed(make_loop(root, tmp_path, sink), kernel, 7)
    again = make_loop(root, tmp_path, Sink())
    assert [s["state"] for s in again.ledger.steps] == ["applied", "reverted"][1:]
    assert again.ledger.failed  # and so it does not retry it
    feed(again, kernel, 6)
    assert [s["state"] for s in again.ledger.steps] == ["reverted"]


def test_the_rank_test() -> None:
    assert mann_whitney_less([1, 2, 3], [4, 5, 6]) == pytest.approx(1 / 20)
    assert mann_whitney_less([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(1 / 252)
    assert mann_whitney_less([1, 2, 3, 4, 6], [5, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert mann_whitney_less([4, 5, 6], [1, 2, 3]) == 1.0
    assert mann_whitney_less([1, 1, 1], [1, 1, 1]) == 1.0  # ties: no evidence

    def w(p50: float, p999: float) -> WindowFigures:
        return WindowFigures(100, p50, p50 * 1.5, p999, {})

    one_wild = judge([w(2, 9), w(2, 9.5), w(2, 30)], [w(2, 3), w(2, 3.3), w(2, 8.9)])
    assert one_wild.keep  # ranks: one wild window does not decide
    noisy = judge([w(2, 9), w(2, 4), w(2, 8)], [w(2, 3), w(2, 7), w(2, 5)])
    assert not noisy.keep and noisy.reason.startswith("did not help")
    with pytest.raises(ValueError):
        judge([], [w(2, 3)])


def test_edgectl_tune_lists_the_record(root: Path, tmp_path: Path, capsys) -> None:
    from edged.cli.main import main

    kernel = Kernel(root, fixable=False)
    feed(make_loop(root, tmp_path, Sink()), kernel, 7)
    assert main(["tune", "--state-dir", str(tmp_path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["mode"] == "apply" and record["steps"][0]["state"] == "reverted"
    assert main(["tune", "--state-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "#1 " in text and "REVERTED block-rq-affinity for softirq:BLOCK" in text
    assert "/sys/block/vda/queue/rq_affinity: '1' -> '2'" in text
    assert "before -> after (medians of 3 windows): p50" in text and "did not help" in text
    assert main(["tune", "--state-dir", str(tmp_path / "none")]) == 1
    assert "no record of the tuning loop" in capsys.readouterr().err
