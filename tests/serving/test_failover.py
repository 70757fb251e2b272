"""Warm standby under a request stream: an RK3588's NPU (the RKNN backend, with the RKNNLite
stand-in at the driver boundary) is unplugged and plugged back while requests arrive; none
is lost, the model serves degraded on its standby meanwhile, and the pick serves again after
it is verified once more against the original. See tests/support/failover.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edged.config import BatchingConfig
from edged.selection.policy import Policy
from edged.serving.models import load_model
from tests.support.failover import SHAPES, Board, Stream, first_served_by, stand_in

POLICY = Policy(runs=20, warmup=2, time_budget_s=1.0, threads=1, shapes=SHAPES, backend="auto")
# Room for the stream to queue through a loaded CI machine's pauses: a refusal counts as lost.
BATCHING = BatchingConfig(timeout_ms=2000, watchdog_ms=500, max_queue_size=1024)
NPU = "rknn:NPU:model"


@pytest.fixture
def board(models_dir: Path, tmp_path: Path):
    board = Board(tmp_path, models_dir)
    with stand_in(board):
        yield board


def _served(board: Board, tmp_path: Path, policy: Policy = POLICY):
    return load_model(
        "cls",
        board.original,
        policy,
        BATCHING,
        board.facts(),
        tmp_path / "state",
        variants=(board.variant,),
    )


def test_the_rknn_variant_is_verified_against_its_original(board: Board, tmp_path: Path) -> None:
    served = _served(board, tmp_path, Policy(**{**POLICY.__dict__, "backend": "rknn"}))
    try:
        sel = served.selection
        assert sel.selected.candidate.key == NPU and sel.model.path == board.variant
        assert sel.against_original and sel.selected.accuracy is not None
        assert sel.selected.accuracy.passes(POLICY.max_drop)
        # An accelerator pick keeps a standby by default: with the backend pinned, the
        # original on its reference runtime's CPU path.
        assert served.worker.standby is not None
        assert served.worker.standby.candidate.key == "onnxruntime:CPU:model"
        assert served.status()["device_used"] == "rk3588 NPU"
    finally:
        served.worker.stop(1.0)


@pytest.mark.slow
def test_unplug_and_replug_under_a_stream_loses_nothing(board: Board, tmp_path: Path) -> None:
    served = _served(board, tmp_path, Policy(**{**POLICY.__dict__, "backend": "rknn"}))
    stream = Stream(served.worker, rate_hz=100)
    try:
        assert served.worker.session.candidate.key == NPU
        stream.start()
        time.sleep(0.5)
        unplugged = time.perf_counter()
        board.unplug()
        outcome = served.adapt(board.facts())  # the daemon's hot-plug handler
        assert "until rknn:NPU:model returns" in outcome
        status = served.status()
        assert status["degraded"] and status["backend"] == "onnxruntime"
        time.sleep(0.5)
        plugged = time.perf_counter()
        board.plug()
        outcome = served.adapt(board.facts())
        assert outcome.startswith("switched back to rknn:NPU:model"), outcome
        assert served.worker.standby.candidate.key == "onnxruntime:CPU:model"  # warm again
        time.sleep(0.5)
    finally:
        stream.stop()
        served.worker.stop(1.0)
    lost = [o for o in stream.outcomes if o.error is not None or o.latency_s is None]
    assert not lost, lost[:3]
    assert len(stream.outcomes) > 50
    assert any(o.backend == "onnxruntime:CPU:model" for o in stream.between(unplugged, plugged))
    back = first_served_by(stream.outcomes, NPU, plugged)
    assert back is not None
    assert not served.worker.degraded and served.worker.failovers == 1


def test_a_pick_that_failed_without_an_unplug_comes_back_after_verifying(
    board: Board, tmp_path: Path
) -> None:
    """The NPU errors (its node stays): the model fails over at once; `recover` (the
    daemon's supervisor runs it every 30 s) verifies the pick again and switches back only
    when it passes; while the NPU still fails, it stays on the standby and says why."""
    import numpy as np

    served = _served(board, tmp_path, Policy(**{**POLICY.__dict__, "backend": "rknn"}))
    feeds = {"x": np.zeros(SHAPES["x"], np.float32)}
    try:
        board.npu.raises = RuntimeError("rknn_run: job timeout")
        served.worker._run_with_failover(feeds)  # the worker's path for one batch
        assert served.worker.degraded and served.worker.standby is None
        outcome = served.recover(board.facts())
        assert outcome is not None and "did not verify again" in outcome
        assert served.worker.degraded
        board.npu.raises = None
        outcome = served.recover(board.facts())
        assert outcome is not None and outcome.startswith("switched back to rknn:NPU:model")
        assert not served.worker.degraded
        assert served.worker.session.run(feeds)
    finally:
        served.worker.stop(1.0)
