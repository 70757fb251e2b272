"""The per-model worker on a real onnxruntime session: batching, bounded queue, deadlines,
fail-over. The one fake is a fault injector around a real session (a runtime that starts
failing is what fail-over exists for, and no runtime here fails on demand)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from backends import LoadOptions, get_backend
from backends.base import Candidate
from backends.errors import BackendError
from backends.model_info import inspect_model
from edged.config import BatchingConfig
from edged.serving.engine import ModelWorker
from edged.serving.requests import DeadlineExceeded, QueueFull


@pytest.fixture(scope="module")
def cls_model(models_dir: Path):
    return inspect_model(models_dir / "ppocr_cls.onnx")


def ort_session(model):
    return get_backend("onnxruntime").load(
        model,
        Candidate("onnxruntime", "CPU", "model", options={"provider": "CPUExecutionProvider"}),
        LoadOptions(threads=1),
    )


def inputs(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)} for _ in range(n)]


class RecordingSession:
    """A real session that records batch sizes and can be told to start failing."""

    def __init__(self, session, fail_after: int | None = None) -> None:
        self._session = session
        self.candidate = session.candidate
        self.inputs, self.outputs = session.inputs, session.outputs
        self.batches: list[int] = []
        self.fail_after = fail_after

    def run(self, feeds):
        if self.fail_after is not None and len(self.batches) >= self.fail_after:
            raise BackendError("injected: the accelerator went away")
        self.batches.append(next(iter(feeds.values())).shape[0])
        return self._session.run(feeds)

    def info(self):
        return self._session.info()

    def close(self) -> None:
        self._session.close()


def run_concurrently(worker: ModelWorker, feeds_list, timeout_ms=None):
    async def main():
        return await asyncio.gather(
            *(worker.infer(f, timeout_ms) for f in feeds_list), return_exceptions=True
        )

    return asyncio.run(main())


def test_batches_under_load_and_answers_each_request(cls_model) -> None:
    session = RecordingSession(ort_session(cls_model))
    reference = ort_session(cls_model)
    worker = ModelWorker("cls", session, BatchingConfig(max_batch_size=8, max_queue_delay_us=2000))
    assert worker.batchable
    worker.start()
    try:
        feeds = inputs(24)
        results = run_concurrently(worker, feeds)
    finally:
        worker.stop()
    assert max(session.batches) > 1, session.batches  # requests were batched
    assert sum(session.batches) == 24 and max(session.batches) <= 8
    for f, (outputs, timing) in zip(feeds, results, strict=True):
        expected = reference.run(f)
        for name, value in expected.items():
            assert np.allclose(outputs[name], value, atol=1e-5)  # its own answer, in order
        assert timing.queue_s >= 0 and timing.compute_s > 0 and timing.batch_size >= 1


@pytest.mark.timing
def test_single_request_does_not_wait_for_a_batch(cls_model) -> None:
    session = RecordingSession(ort_session(cls_model))
    # A delay far over any stall of a loaded 2-core CI machine: waiting for it stands out.
    worker = ModelWorker(
        "cls", session, BatchingConfig(max_batch_size=8, max_queue_delay_us=5_000_000)
    )
    worker.start()
    try:
        start = time.perf_counter()
        [(_, timing)] = run_concurrently(worker, inputs(1))
        elapsed = time.perf_counter() - start
    finally:
        worker.stop()
    assert session.batches == [1]
    assert elapsed < 2.5, "a lone request waited for the batching delay"
    assert timing.batch_size == 1


@pytest.mark.timing
def test_queue_full_rejects_at_once(cls_model) -> None:
    gate = threading.Event()

    class Blocked(RecordingSession):
        def run(self, feeds):
            gate.wait(10)
            return super().run(feeds)

    worker = ModelWorker("cls", Blocked(ort_session(cls_model)), BatchingConfig(max_queue_size=2))
    worker.start()
    try:
        done = []
        feeds = inputs(1)[0]
        worker.submit(feeds, lambda *a: done.append(a))  # taken by the worker, blocked
        time.sleep(0.05)
        worker.submit(feeds, lambda *a: done.append(a))
        worker.submit(feeds, lambda *a: done.append(a))
        start = time.perf_counter()
        with pytest.raises(QueueFull, match=r"cls: queue full \(2 requests waiting\)"):
            worker.submit(feeds, lambda *a: done.append(a))
        assert time.perf_counter() - start < 1.0  # at once: the worker is blocked for 10 s
        gate.set()
        deadline = time.monotonic() + 10
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(done) == 3 and all(error is None for _, error, _ in done)
    finally:
        gate.set()
        worker.stop()


def test_the_next_batch_is_not_counted_as_waiting(cls_model) -> None:
    """Requests that arrive before the worker has taken the first one off the queue (here: a
    worker not started yet) must not be refused: the head of the queue is the next batch,
    not a waiting request. So submit accepts what the API's check_room admits before it
    reads bodies (max_queue_size waiting + one batch)."""
    worker = ModelWorker("cls", ort_session(cls_model), BatchingConfig(max_queue_size=2))
    done = []
    feeds = inputs(1)[0]
    for _ in range(3):  # 1 next batch + 2 waiting
        worker.submit(feeds, lambda *a: done.append(a))
    with pytest.raises(QueueFull):
        worker.submit(feeds, lambda *a: done.append(a))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(done) == 3 and all(error is None for _, error, _ in done)
    finally:
        worker.stop()


def test_deadline_in_queue(cls_model) -> None:
    gate = threading.Event()

    class Slow(RecordingSession):
        def run(self, feeds):
            gate.wait(0.3)
            return super().run(feeds)

    worker = ModelWorker("cls", Slow(ort_session(cls_model)), BatchingConfig(timeout_ms=5000))
    worker.start()

    async def main():
        first, *rest = inputs(3)
        return await asyncio.gather(
            worker.infer(first), *(worker.infer(f, 100) for f in rest), return_exceptions=True
        )

    try:
        results = asyncio.run(main())
    finally:
        worker.stop()
    # The first ran (after 0.3 s); the others waited past their 100 ms deadline.
    assert isinstance(results[0], tuple)
    assert all(isinstance(r, DeadlineExceeded) for r in results[1:]), results
    assert "deadline passed after" in str(results[1])


def test_request_cannot_raise_the_deadline(cls_model) -> None:
    worker = ModelWorker("cls", ort_session(cls_model), BatchingConfig(timeout_ms=50))
    done = []
    worker.submit(inputs(1)[0], lambda *a: done.append(a), timeout_ms=10_000)
    item = worker._queue[0]
    assert item.deadline - time.monotonic() <= 0.05


def test_fail_over_retries_on_the_next_candidate(cls_model) -> None:
    failing = RecordingSession(ort_session(cls_model), fail_after=2)
    spare = get_backend("openvino").load(
        cls_model,
        Candidate("openvino", "CPU", "fp32"),
        LoadOptions(threads=1, shapes={"x": (1, 3, 48, 192)}),
    )
    offered = [spare]
    worker = ModelWorker(
        "cls",
        failing,
        BatchingConfig(),
        fallbacks=lambda usable=None: offered.pop() if offered else None,
    )
    worker.start()
    try:
        results = [run_concurrently(worker, [f])[0] for f in inputs(5)]
    finally:
        worker.stop()
    assert all(isinstance(r, tuple) for r in results), results  # no request was lost
    assert worker.failovers == 1
    assert worker.session is spare
    assert "accelerator went away" in worker.last_error


class ClosingSession(RecordingSession):
    """Records whether (and while what) it was closed."""

    def __init__(self, session, fail_after: int | None = None) -> None:
        super().__init__(session, fail_after)
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        super().close()


def test_fail_over_takes_the_warm_standby_without_loading(cls_model) -> None:
    """With a standby loaded, a failing backend is left for it at once: the fallback
    provider (which would load a model) is never asked, no request is lost, the failed
    session is closed after its batch, and the worker is degraded until its pick returns."""
    failing = ClosingSession(ort_session(cls_model), fail_after=1)
    standby = ClosingSession(
        get_backend("openvino").load(
            cls_model,
            Candidate("openvino", "CPU", "fp32"),
            LoadOptions(threads=1, shapes={"x": (1, 3, 48, 192)}),
        )
    )
    asked = []
    worker = ModelWorker(
        "cls", failing, BatchingConfig(), fallbacks=lambda usable=None: asked.append(1)
    )
    worker.set_standby(standby)
    assert worker.primary == failing.candidate.key and not worker.degraded
    worker.start()
    try:
        results = [run_concurrently(worker, [f])[0] for f in inputs(4)]
        assert failing.closed.wait(5) and not standby.closed.is_set()
    finally:
        worker.stop()
    assert all(isinstance(r, tuple) for r in results), results
    assert worker.session is standby and worker.standby is None
    assert asked == [] and worker.failovers == 1
    assert worker.degraded
    assert standby.closed.wait(5)  # stopping closes what served
    assert len(standby.batches) == 3  # the failed request retried there, and the two after


def test_a_standby_on_the_failed_device_is_not_used(cls_model) -> None:
    """A standby on the device that failed (or one `usable` refuses: gone with it) is no
    way out; the fallback provider is asked instead."""
    active = ort_session(cls_model)
    twin = ort_session(cls_model)  # same candidate key as the active one
    spare = RecordingSession(ort_session(cls_model))
    spare.candidate = Candidate("onnxruntime", "XNNPACK", "model")
    worker = ModelWorker("cls", active, BatchingConfig(), fallbacks=lambda usable=None: spare)
    worker.set_standby(twin)
    assert worker.fail_over("injected")
    assert worker.session is spare and worker.standby is twin


def test_swap_back_keeps_the_fall_back_as_standby(cls_model) -> None:
    """The pick serving again (after re-verification) takes over from the next batch; the
    session that served meanwhile stays loaded as the standby, so a second failure is as
    cheap as the first."""
    pick = ClosingSession(ort_session(cls_model))
    fallback = ClosingSession(ort_session(cls_model))
    fallback.candidate = Candidate("openvino", "CPU", "fp32")
    worker = ModelWorker("cls", pick, BatchingConfig())
    worker.set_standby(fallback)
    assert worker.fail_over("injected", retire=False)
    assert worker.degraded and worker.session is fallback
    again = ClosingSession(ort_session(cls_model))
    worker.swap_session(again, primary=True, keep_as_standby=True)
    assert not worker.degraded and worker.session is again and worker.standby is fallback
    assert not fallback.closed.is_set()


def test_fail_over_without_spare_reports_the_error(cls_model) -> None:
    worker = ModelWorker(
        "cls",
        RecordingSession(ort_session(cls_model), fail_after=0),
        BatchingConfig(),
        fallbacks=lambda usable=None: None,
    )
    worker.start()
    try:
        [result] = run_concurrently(worker, inputs(1))
        assert isinstance(result, BackendError)
        # ... and the worker is still alive for the next request.
        assert worker.alive()
    finally:
        worker.stop()


@pytest.mark.timing
def test_stalled_backend_is_taken_over(cls_model) -> None:
    """A backend that hangs inside run (an NPU driver that stops answering): past
    watchdog_ms the batch is re-run once on the next verified backend."""
    hang = threading.Event()

    class Hanging(RecordingSession):
        def run(self, feeds):
            hang.wait(30)  # released at the end of the test
            return super().run(feeds)

    spare = get_backend("openvino").load(
        cls_model,
        Candidate("openvino", "CPU", "fp32"),
        LoadOptions(threads=1, shapes={"x": (1, 3, 48, 192)}),
    )
    reasons = []
    worker = ModelWorker(
        "cls",
        Hanging(ort_session(cls_model)),
        BatchingConfig(watchdog_ms=200),
        fallbacks=lambda usable=None: spare if usable(spare.candidate) else None,
        on_failover=reasons.append,
    )
    worker.start()

    def supervise() -> None:  # what the daemon's supervisor task does
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not worker.take_over_if_stalled():
            time.sleep(0.05)

    supervisor = threading.Thread(target=supervise)
    supervisor.start()
    try:
        start = time.perf_counter()
        [result] = run_concurrently(worker, inputs(1))
        elapsed = time.perf_counter() - start
        supervisor.join()
        assert isinstance(result, tuple), result  # answered, by the spare
        assert 0.2 <= elapsed < 5  # watchdog 0.2 s; the supervisor gives up after 10
        assert worker.session is spare and worker.failovers == 1
        assert "stalled" in reasons[0]
        assert worker.alive()
        [again] = run_concurrently(worker, inputs(1))  # and it keeps serving
        assert isinstance(again, tuple)
    finally:
        hang.set()
        worker.stop()


def test_worker_records_latency_for_telemetry(cls_model) -> None:
    from edged.telemetry.latency import LatencyRecorder

    recorder = LatencyRecorder("cls")
    worker = ModelWorker("cls", ort_session(cls_model), BatchingConfig(), recorder=recorder)
    worker.start()
    try:
        results = [run_concurrently(worker, [f])[0] for f in inputs(6)]
    finally:
        worker.stop()
    window = recorder.rotate()
    assert window.count == 6
    compute = [timing.compute_s * 1e3 for _, timing in results]
    # HDR histograms in whole µs, 3 significant digits: the max is the slowest compute.
    assert abs(window.compute.max_ms - max(compute)) < 0.05
    assert window.total.p50_ms >= window.compute.p50_ms
    assert recorder.rotate().count == 0  # the next window starts empty


@pytest.mark.timing
def test_hung_backend_answers_504_at_the_deadline(cls_model) -> None:
    """A runtime that never returns (no supervisor to take over here): the caller still gets
    its answer at the deadline, and the late result, when the runtime comes back, is
    dropped while the worker goes on serving."""
    release = threading.Event()

    class Hung(RecordingSession):
        def run(self, feeds):
            release.wait(30)
            return super().run(feeds)

    session = Hung(ort_session(cls_model))
    worker = ModelWorker("cls", session, BatchingConfig(timeout_ms=300, watchdog_ms=60_000))
    worker.start()
    try:
        start = time.perf_counter()
        results = run_concurrently(worker, inputs(2))
        elapsed = time.perf_counter() - start
        assert all(isinstance(r, DeadlineExceeded) for r in results), results
        assert "cls: deadline passed after 300.0 ms" in str(results[0])
        assert 0.25 <= elapsed < 5, elapsed  # deadline 0.3 s; the runtime hangs for 30
        release.set()
        deadline = time.monotonic() + 10
        while worker.queue_depth and time.monotonic() < deadline:
            time.sleep(0.01)
        [(outputs, _)] = run_concurrently(worker, inputs(1))  # the worker still serves
        assert next(iter(outputs.values())).shape == (1, 2)
        # The hung batch did finish; the queued one had passed its deadline and never ran.
        assert session.batches == [1, 1]
    finally:
        release.set()
        worker.stop()


@pytest.mark.parametrize(
    "error, logged",
    [
        (
            PermissionError(errno.EPERM, "Operation not permitted"),
            "SCHED_FIFO 50 refused (needs CAP_SYS_NICE or an RLIMIT_RTPRIO)",
        ),
        (OSError(errno.EINVAL, "Invalid argument"), "SCHED_FIFO 50 failed"),
    ],
)
def test_rt_priority_refused_falls_back_and_serves(
    cls_model, monkeypatch, caplog, error, logged
) -> None:
    """Without CAP_SYS_NICE the kernel answers EPERM: the worker says so and serves with
    normal scheduling. (mlockall is the daemon's, not the worker's: see test_daemon.)"""
    calls = []

    def refuse(pid, policy, param):
        calls.append((pid, policy, param.sched_priority))
        raise error

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    caplog.set_level(logging.WARNING, logger="edged.serving.engine")
    worker = ModelWorker("cls", ort_session(cls_model), BatchingConfig(rt_priority=50))
    worker.start()
    try:
        [(outputs, _)] = run_concurrently(worker, inputs(1))
    finally:
        worker.stop()
    assert calls == [(0, os.SCHED_FIFO, 50)]  # asked for, on the worker thread itself
    assert next(iter(outputs.values())).shape == (1, 2)
    assert worker.scheduling == "other"
    assert any(logged in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), (
        caplog.text
    )
