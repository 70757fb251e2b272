"""Per-model inference worker: bounded queue, deadlines, dynamic batching, pinned thread.

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

import numpy as np

from backends.base import Candidate, Session, check_feeds
from backends.errors import BackendError, InputError
from edged.serving.requests import (
    BatchingConfig,
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


class ModelWorker:
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
        # Loads the model on its float32 reference runtime (selection's), to tell whether an
        # input that made the backend fail is the input's fault: only on that rare path.
        self._reference = reference
        self.session = session
        self.batching = batching
        self.cpus = tuple(cpus) if cpus else None
        self._next_session = fallbacks
        self._on_failover = on_failover
        # A verified session on another device, loaded and warmed before it is needed
        # (`standby = true`): a fail-over to it costs a pointer swap, not a model load.
        self.standby: Session | None = None
        # The selection's pick; serving on anything else is degraded (a fall-back).
        self.primary = session.candidate.key
        self._retired: list[Session] = []  # switched away from; closed between batches
        self._running: Session | None = None  # the session the running batch is inside
        # Sessions a stalled thread was left inside, with that thread's generation: not closed
        # while it may still be in them, closed when it returns (`_run`). Held by object, not
        # id(): a freed session's id is reused by the next one allocated at its address.
        self._abandoned: list[tuple[int, Session]] = []
        self.recorder = recorder  # per-request latency for telemetry (HDR histograms)
        self._queue: collections.deque[Pending] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.batchable = batching.max_batch_size > 1 and all(
            spec.shape and spec.shape[0] is None for spec in session.inputs
        )
        self.failovers = 0
        self.last_error: str | None = None
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
        self._switch_lock = threading.Lock()  # one fail-over at a time
        self.scheduling = "other"  # what the worker thread really got ("fifo:50", ...)
        self.native_id: int | None = None  # the worker thread's kernel thread id
        # Requests the API has admitted and whose bodies it is still reading. They count
        # against max_queue_size so that a flood is refused before its bodies are in memory.
        # Touched only on the event loop.
        self.admitting = 0
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
            with self._switch_lock:
                sessions = [self.session, self.standby, *self._retired]
                self.standby, self._retired = None, []
            for session in {id(s): s for s in sessions if s is not None}.values():
                if not self._is_abandoned(session):
                    close_later(session)

    def stalled(self, bound_s: float) -> bool:
        """True while one batch has been running for longer than `bound_s` (a hung runtime),
        scaled by how much larger its inputs are than the largest batch that completed."""
        busy = self._busy_since
        return busy is not None and time.monotonic() - busy > bound_s * self._size_scale()

    def _size_scale(self) -> float:
        largest = self._largest_done
        return max(1.0, self._inflight_bytes / largest) if largest else 1.0

    def _is_abandoned(self, session: Session) -> bool:
        return any(s is session for _, s in self._abandoned)

    def _returned(self, generation: int) -> None:
        """A thread taken over after a stall came back: the sessions it was left inside are
        free now; closed unless they serve again (switched back to)."""
        with self._switch_lock:
            mine = [s for g, s in self._abandoned if g == generation]
            self._abandoned = [(g, s) for g, s in self._abandoned if g != generation]
            in_use = (self.session, self.standby, *self._retired)
        for session in mine:
            if not any(session is s for s in in_use) and not self._is_abandoned(session):
                close_later(session)

    @property
    def queue_depth(self) -> int:
        """Requests waiting: queued, and admitted with their bodies still being read or
        decoded (they hold queue room: a stalled upload shows here, not as a silent full
        queue)."""
        return len(self._queue) + self.admitting

    # -- switching backends ------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        """Serving on a fall-back, not on the selection's pick."""
        return self.session.candidate.key != self.primary

    def fail_over(
        self,
        reason: str,
        usable: Callable[[Candidate], bool] | None = None,
        retire: bool = True,
        failed: Session | None = None,
    ) -> bool:
        """Switch to the warm standby, else the next verified backend (that `usable`
        accepts). False if none loads; then the current session stays. The session left is
        closed once no batch runs on it (`retire`; a stalled one is left alone: its thread
        is still inside it). `failed`: the session that failed; when another thread has
        switched away from it meanwhile, that switch stands (True)."""
        with self._switch_lock:
            if failed is not None and self.session is not failed:
                return True
            failed = self.session
            replacement = self.standby
            if replacement is not None and (
                replacement.candidate.key == failed.candidate.key
                or (usable is not None and not usable(replacement.candidate))
            ):
                replacement = None  # on the device that failed, or gone with it
            warm = replacement is not None
            if warm:
                self.standby = None
            elif self._next_session is not None:
                replacement = self._next_session(usable)
            if replacement is None:
                log.error("%s: %s; no other verified backend to fail over to", self.name, reason)
                return False
            log.warning(
                "%s: %s; failing over from %s to %s%s",
                self.name,
                reason,
                failed.candidate.key,
                replacement.candidate.key,
                " (the warm standby)" if warm else "",
            )
            self.last_error = reason
            self.failovers += 1
            self.session = replacement  # the worker reads it per batch: the next batch uses it
            if retire:
                self._retired.append(failed)
        if self._on_failover is not None:
            self._on_failover(reason)
        return True

    def set_fallbacks(self, fallbacks: Fallbacks) -> None:
        with self._switch_lock:
            self._next_session = fallbacks

    def set_standby(self, session: Session | None) -> None:
        """Keep `session` loaded for the next fail-over (None: keep none); the one it
        replaces is closed between batches (a batch may be running on it: a retry, or it
        served a moment ago)."""
        with self._switch_lock:
            old, self.standby = self.standby, session
            if old is not None and old is not session:
                self._retired.append(old)

    def swap_session(
        self, session: Session, primary: bool = True, keep_as_standby: bool = False
    ) -> None:
        """Use `session` from the next batch on (a better backend appeared, or the pick came
        back). `primary`: it is the selection's pick. `keep_as_standby`: the session it
        replaces stays loaded as the standby; else it is closed once its batch is done."""
        with self._switch_lock:
            old, self.session = self.session, session
            if primary:
                self.primary = session.candidate.key
            if old is not session:
                if keep_as_standby:
                    old, self.standby = self.standby, old
                if old is not None:
                    self._retired.append(old)

    def _close_retired(self) -> None:
        """Close the sessions switched away from: called by the worker between batches, so
        none is closed while a batch runs on it."""
        if not self._retired:
            return
        with self._switch_lock:
            retired, self._retired = self._retired, []
        for session in retired:
            if (
                session is not self.session
                and session is not self.standby
                and not self._is_abandoned(session)
            ):
                close_later(session)

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
        offset = 0
        for item in live:
            n = next(iter(item.feeds.values())).shape[0] if len(live) > 1 else 0
            result = (
                outputs
                if len(live) == 1
                else {k: v[offset : offset + n] for k, v in outputs.items()}
            )
            offset += n
            item.done(result, None, Timing(start - item.enqueued, end - start, len(live)))
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

    def _run_with_failover(self, feeds, generation: int | None = None) -> dict[str, np.ndarray]:
        session = self._running = self.session
        try:
            return session.run(feeds)
        except InputError:
            raise
        except BackendError as exc:
            if generation is not None and generation != self._generation:
                raise  # taken over after a stall: the batch runs elsewhere; no retry here
            self.last_error = str(exc)
            moved = lambda c: c.key != session.candidate.key  # noqa: E731
            standby = self.standby
            if self.session is session and standby is not None and moved(standby.candidate):
                # The warm standby is a verified session: it answering the input says the
                # backend failed, not the input; and its answer is the retry's answer.
                self._running = standby
                try:
                    outputs = standby.run(feeds)
                except InputError as standby_exc:
                    raise InputError(
                        f"{self.name}: the standby {standby.candidate.key} refuses these "
                        f"inputs too ({str(standby_exc)[:200]}); the backend said: "
                        f"{str(exc)[:200]}"
                    ) from None
                except BackendError as standby_exc:  # broken too: not the input's fault
                    log.error("%s: the standby failed as well: %s", self.name, standby_exc)
                    self.set_standby(None)
                else:
                    self.fail_over(str(exc), moved, failed=session)
                    return outputs
            if self.session is session:
                fault = self._input_fault(feeds, exc)
                if fault is not None:
                    raise fault from None  # the input's fault: 400, and no switch of backend
                if not self.fail_over(str(exc), moved, failed=session):
                    raise
            # Failed over, here or meanwhile (a hot-plug took the standby): the request is
            # retried once, there.
            session = self._running = self.session
            return session.run(feeds)

    def _input_fault(self, feeds, exc: BackendError) -> InputError | None:
        """An InputError when the reference runtime fails on these inputs too (a size the
        model cannot compute, say 7x7 for a detector that halves five times): then the
        input is at fault, not the backend, and failing over would move the model for good
        because of one bad request. None when the reference runs them (or is unknown)."""
        if self._reference is None:
            return None
        try:
            reference = self._reference()
        except Exception as load_error:  # cannot tell: treat as the backend's fault
            log.warning(
                "%s: reference runtime did not load to check an input: %s", self.name, load_error
            )
            return None
        try:
            reference.run(feeds)
        except (BackendError, InputError) as ref_exc:
            shapes = ", ".join(f"{k}={'x'.join(map(str, np.shape(v)))}" for k, v in feeds.items())
            return InputError(
                f"{self.name}: the model cannot compute inputs of shape "
                f"{shapes}: its reference runtime fails on them too "
                f"({str(ref_exc)[:200]}); the backend said: {str(exc)[:200]}"
            )
        finally:
            reference.close()
        return None


def close_later(session: Session) -> None:
    """Close a session on a thread of its own: releasing a device that hung or went away can
    block in its driver, and nothing that serves may wait for that."""

    def close() -> None:
        try:
            session.close()
        except Exception as exc:  # a dead device's release may fail; nothing depends on it
            log.warning("closing %s failed: %s", session.candidate.key, exc)

    threading.Thread(target=close, name="edged-close", daemon=True).start()


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
