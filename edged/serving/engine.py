"""Per-model inference worker: bounded queue, deadlines, dynamic batching, pinned thread.
Its sessions and the switches between them (fail-over, standby) are edged.serving.failover's.

The API side (asyncio) only appends to a deque under a short lock and awaits a future; the
worker thread takes requests, forms batches and runs the session (the runtimes release the
GIL while they compute). Nothing on the inference path waits for the API or telemetry.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from backends.base import Session, check_feeds
from backends.errors import BackendError
from edged.config import BatchingConfig
from edged.serving.failover import SessionSwitching
from edged.serving.requests import (
    DeadlineExceeded,
    Done,
    Fallbacks,
    NotServing,
    Pending,
    QueueFull,
    Timing,
)
from edged.telemetry.batches import batch_begin, batch_end
from edged.telemetry.latency import LatencyRecorder
from edged.telemetry.sampler import name_thread

log = logging.getLogger("edged.serving.engine")


class ModelWorker(SessionSwitching):
    """Serves one model from one thread. `submit` never blocks: a full queue is an error."""

    def __init__(
        self,
        name: str,
        session: Session,
        batching: BatchingConfig,
        cpus: Sequence[int] | None = None,
        fallbacks: Fallbacks | None = None,
        on_failover: Callable[[str], None] | None = None,
        recorder: LatencyRecorder | None = None,
        reference: Callable[[], Session] | None = None,
    ) -> None:
        self.name = name
        self._init_switching(session, fallbacks, on_failover, reference)
        self.batching = batching
        self.cpus = tuple(cpus) if cpus else None
        self.recorder = recorder  # per-request latency for telemetry (HDR histograms)
        self._queue: collections.deque[Pending] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.batchable = batching.max_batch_size > 1 and all(
            spec.shape and spec.shape[0] is None for spec in session.inputs
        )
        self.batches_run = 0
        self._busy_since: float | None = None  # monotonic start of the batch being run
        self._inflight: list[Pending] | None = None  # that batch
        # The stall bounds (watchdog_ms, hang_s) are for a batch no larger than the largest
        # that completed: a larger valid input (a dynamic size, no `shapes`) is given time in
        # proportion, so a slow request is not taken for a hung device.
        self._inflight_bytes = 0
        self._largest_done = 0
        # A thread serves one generation; after a stall take-over its results are dropped.
        self._generation = 0
        self.scheduling = "other"  # what the worker thread really got ("fifo:50", ...)
        self.native_id: int | None = None  # the worker thread's kernel thread id
        # Requests the API has admitted and whose bodies it is still reading. They count
        # against max_queue_size so that a flood is refused before its bodies are in memory.
        # Touched only on the event loop.
        self.admitting = 0
        # edged.serving.admission.Gate while [thermal] admission is on (None: admit all).
        self.gate: Any = None
        # (session, feed signatures check_feeds accepted for it): see _check_feeds.
        self._checked: tuple[Session | None, set[tuple]] = (None, set())

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop,
            args=(self._generation,),
            name=f"edged-infer-{self.name}",
            daemon=True,
        )
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, drain_s: float = 5.0) -> None:
        """Finish what is queued (bounded by `drain_s`), then fail the rest and stop."""
        deadline = time.monotonic() + drain_s
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._cond:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in left:
            item.done(None, NotServing(f"{self.name}: shutting down"), None)
        if self._thread is not None:
            # One deadline for draining and joining: a hung runtime cannot hold the stop.
            self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        if self._thread is None or not self._thread.is_alive():  # nothing runs in them now
            self._close_all()

    def stalled(self, bound_s: float) -> bool:
        """True while one batch has been running for longer than `bound_s` (a hung runtime),
        scaled by how much larger its inputs are than the largest batch that completed."""
        busy = self._busy_since
        return busy is not None and time.monotonic() - busy > bound_s * self._size_scale()

    @property
    def busy(self) -> bool:
        """A batch is running now (one that may stall)."""
        return self._busy_since is not None

    def _size_scale(self) -> float:
        largest = self._largest_done
        return max(1.0, self._inflight_bytes / largest) if largest else 1.0

    @property
    def queue_depth(self) -> int:
        """Requests waiting: queued, and admitted with their bodies still being read or
        decoded (they hold queue room: a stalled upload shows here, not as a silent full
        queue)."""
        return len(self._queue) + self.admitting

    def take_over_if_stalled(self) -> bool:
        """Called by a supervisor: when one batch has run longer than `watchdog_ms`, abandon
        the stuck thread (native code cannot be interrupted), fail over, and re-run the
        batch once on the new backend in a fresh thread. The stuck thread's result, if it
        ever comes, is dropped."""
        bound = self.batching.watchdog_ms / 1000.0
        with self._cond:
            if not self.stalled(bound) or not self._inflight:
                return False
            stuck = self._inflight
            stuck_session = self._running or self.session
            # The stuck thread is still inside it.
            self._abandoned.append((self._generation, stuck_session))
        if not self.fail_over(
            f"backend stalled: one batch ran for more than {bound:g} s",
            lambda c: c.key != stuck_session.candidate.key,
            retire=False,
            failed=stuck_session,
        ):
            return False  # keep waiting; the systemd watchdog is the last resort
        with self._cond:
            if self._inflight is not stuck:  # it finished while the fail-over loaded
                return False
            self._generation += 1
            self._inflight = None
            self._busy_since = None
            retry = [item for item in stuck if not item.retried]
            for item in stuck:
                if item.retried:
                    item.done(None, BackendError(f"{self.name}: stalled twice"), None)
                item.retried = True
            self._queue.extendleft(reversed(retry))  # first in line on the new backend
            self._cond.notify_all()
        self.start()
        return True

    # -- submitting ------------------------------------------------------------------------
    def check_room(self) -> None:
        """Raise QueueFull / NotServing unless one more request can be admitted. Admitted
        are the waiting, the running batch and those whose bodies are still being read, up
        to max_queue_size waiting plus one batch running. Cheap and lock-free: the API calls
        it before it reads a body, so a full queue costs the daemon no body memory."""
        if self._stopping:
            raise NotServing(f"{self.name}: shutting down")
        if not self.alive():
            raise NotServing(f"{self.name}: worker is not running")
        if self.gate is not None:
            self.gate.check()  # Throttled (503, Retry-After) while the device cools
        inflight = self._inflight
        admitted = len(self._queue) + self.admitting + (len(inflight) if inflight else 0)
        if admitted >= self.batching.max_queue_size + self._batch_room():
            raise self._queue_full()

    def _batch_room(self) -> int:
        return self.batching.max_batch_size if self.batchable else 1

    def _queue_full(self) -> QueueFull:
        return QueueFull(
            f"{self.name}: queue full ({self.batching.max_queue_size} requests waiting)"
        )

    def submit(
        self, feeds: Mapping[str, np.ndarray], done: Done, timeout_ms: float | None = None
    ) -> float:
        """Queue one request; returns its deadline (time.monotonic())."""
        self._check_feeds(feeds)
        deadline = time.monotonic() + self._timeout_ms(timeout_ms) / 1000.0
        item = Pending(feeds, deadline, time.perf_counter(), done)
        with self._cond:
            if self._stopping:
                raise NotServing(f"{self.name}: shutting down")
            # Waiting means behind the running batch: while none runs, the head of the queue
            # is the next batch (the worker has not taken it yet), so it does not count as
            # waiting. The same room check_room() admits bodies against.
            running = self._batch_room() if self._inflight is None else 0
            if len(self._queue) >= self.batching.max_queue_size + running:
                raise self._queue_full()
            self._queue.append(item)
            self._cond.notify()
        return deadline

    def _timeout_ms(self, timeout_ms: float | None) -> float:
        """The request's deadline from now: the configured timeout, or less if it asks."""
        limit = self.batching.timeout_ms
        return min(limit, timeout_ms) if timeout_ms and timeout_ms > 0 else limit

    def _check_feeds(self, feeds: Mapping[str, np.ndarray]) -> None:
        """check_feeds, once per feed signature (names, array types, dtypes, shapes) and
        session: it is a function of just those, and costs ≈3 µs a request otherwise."""
        session = self.session
        checked = self._checked
        if checked[0] is not session:
            checked = self._checked = (session, set())
        try:
            key = tuple([(name, type(a), a.dtype, a.shape) for name, a in feeds.items()])
            if key in checked[1]:
                return
        except (AttributeError, TypeError):  # not arrays: check_feeds says what is wrong
            key = None
        check_feeds(session.inputs, feeds, self.name)
        if key is not None and len(checked[1]) < 64:
            checked[1].add(key)

    async def infer(
        self, feeds: Mapping[str, np.ndarray], timeout_ms: float | None = None
    ) -> tuple[dict[str, np.ndarray], Timing]:
        """Submit and wait, at most until the request's deadline: a worker hung inside the
        runtime must not hold the caller forever (the stall take-over may come later, or
        never). A result arriving after that is dropped by `_settle`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(outputs, error, timing) -> None:
            try:  # noqa: SIM105 (per request: cheaper than contextlib.suppress)
                loop.call_soon_threadsafe(_settle, future, outputs, error, timing)
            except RuntimeError:
                pass  # the loop is gone (the caller gave up at its deadline and exited)

        submitted = time.monotonic()
        deadline = self.submit(feeds, done, timeout_ms)
        # One timer handle rather than asyncio.wait_for (which wraps the future in a task-like
        # waiter): this runs on every request.
        # The message names the request's timeout itself, not the (later) time it was measured.
        timer = loop.call_later(
            max(0.0, deadline - submitted),
            _expire,
            future,
            self.name,
            self._timeout_ms(timeout_ms) / 1000.0,
        )
        try:
            return await future
        finally:
            timer.cancel()

    # -- the worker thread -----------------------------------------------------------------
    def _loop(self, generation: int) -> None:
        self.native_id = threading.get_native_id()
        name_thread(f"infer-{self.name}")
        if self.cpus:
            os.sched_setaffinity(0, set(self.cpus))  # this thread only (Linux semantics)
        if self.batching.rt_priority:
            self._set_fifo(self.batching.rt_priority)
        while True:
            batch = self._take(generation)
            if batch is None:
                return
            self._run(batch, generation)
            # Not held while waiting for the next: the inputs may be views of a client's
            # shared memory, whose mapping cannot close while a view is alive.
            del batch

    def _set_fifo(self, priority: int) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        except PermissionError:
            log.warning(
                "%s: SCHED_FIFO %d refused (needs CAP_SYS_NICE or an RLIMIT_RTPRIO); "
                "the worker runs with normal scheduling",
                self.name,
                priority,
            )
            return
        except OSError as exc:
            log.warning("%s: SCHED_FIFO %d failed: %s; normal scheduling", self.name, priority, exc)
            return
        self.scheduling = f"fifo:{priority}"

    def _take(self, generation: int) -> list[Pending] | None:
        with self._cond:
            while not self._queue:
                if self._stopping or generation != self._generation:
                    return None
                self._cond.wait()
            if generation != self._generation:
                return None
            first = self._queue.popleft()
            batch = [first]
            if not self.batchable:
                return batch
            # Zero-wait fast path: alone in the queue means no one to batch with.
            if not self._queue:
                return batch
            key = first.batch_key()
            limit = self.batching.max_batch_size
            # Counted from the first request's arrival (as Triton does): one that already
            # waited behind a running batch does not wait the full delay again.
            wait_until = first.enqueued + self.batching.max_queue_delay_us / 1e6
            while len(batch) < limit:
                if self._queue and self._queue[0].batch_key() == key:
                    batch.append(self._queue.popleft())
                    continue
                if self._queue or len(batch) in self.batching.preferred_batch_sizes:
                    break  # next request does not fit this batch, or a preferred size is met
                remaining = wait_until - time.perf_counter()
                if remaining <= 0 or self._stopping:
                    break
                self._cond.wait(remaining)
            return batch

    def _run(self, batch: list[Pending], generation: int) -> None:
        self._close_retired()
        now = time.monotonic()
        live = []
        for item in batch:
            if item.deadline < now:
                waited_ms = (time.perf_counter() - item.enqueued) * 1e3
                item.done(
                    None,
                    DeadlineExceeded(
                        f"{self.name}: deadline passed after {waited_ms:.1f} ms in the queue"
                    ),
                    None,
                )
            else:
                live.append(item)
        if not live:
            return
        compute_start = time.perf_counter()
        feeds = (
            live[0].feeds
            if len(live) == 1
            else {
                name: np.concatenate([item.feeds[name] for item in live]) for name in live[0].feeds
            }
        )
        start = time.perf_counter()
        size = sum(v.nbytes for v in feeds.values())
        with self._cond:
            self._inflight = live
            self._inflight_bytes = size
            self._busy_since = time.monotonic()
        error: Exception | None = None
        usage = batch_begin()  # wakes the counter sampler; the thread's CPU time so far
        try:
            outputs = self._run_with_failover(feeds, generation)
        except Exception as exc:  # report to every caller; the worker keeps serving
            error = exc
        end = time.perf_counter()
        switches, off_cpu, waking = batch_end(usage, end - start)  # preempted? off-CPU?
        with self._cond:
            taken_over = generation != self._generation
            if not taken_over:
                self._inflight = None
                self._busy_since = None
                if error is None:
                    self._largest_done = max(self._largest_done, size)
        if taken_over:  # after a stall: these requests were re-run elsewhere
            self._returned(generation)
            return
        if error is not None:
            for item in live:
                item.done(None, error, None)
            return
        self.batches_run += 1
        ran = self._running.candidate if self._running is not None else None
        first = next(iter(feeds.values()), None)
        samples = first.shape[0] if first is not None and first.ndim else 1
        offset = 0
        for item in live:
            n = next(iter(item.feeds.values())).shape[0] if len(live) > 1 else 0
            result = (
                outputs
                if len(live) == 1
                else {k: v[offset : offset + n] for k, v in outputs.items()}
            )
            offset += n
            timing = Timing(
                start - item.enqueued,
                end - start,
                len(live),
                compute_start,
                start,
                end,
                time.perf_counter(),
                samples,
                ran,
            )
            item.done(result, None, timing)
        if self.recorder is not None:  # after the replies: they do not wait for bookkeeping
            for item in live:
                self.recorder.record(
                    end - item.enqueued,
                    start - item.enqueued,
                    end - start,
                    start,
                    end,
                    switches,
                    off_cpu,
                    waking,
                )


def _expire(future: asyncio.Future, name: str, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(
            DeadlineExceeded(
                f"{name}: deadline passed after {timeout_s * 1e3:.1f} ms without an answer from "
                f"the backend"
            )
        )


def _settle(future: asyncio.Future, outputs, error, timing) -> None:
    if future.done():
        return  # the client went away and the handler was cancelled
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result((outputs, timing))
