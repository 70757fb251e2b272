"""A model worker's sessions and the switches between them: the serving session, the warm
standby, the selection's pick (`primary`), fail-over to the next verified backend, sessions
retired between batches and those a stalled thread was left inside (closed only when it
returns). ModelWorker (edged.serving.engine) mixes this in; the queue, batching and the
worker thread are the engine's.

Every switch happens under `_switch_lock`; the worker reads `session` once per batch, so a
switch takes effect at the next batch and no batch sees two sessions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from backends.base import Candidate, Session
from backends.errors import BackendError, InputError
from edged.logs import event
from edged.serving.requests import Fallbacks

log = logging.getLogger("edged.serving.engine")


class SessionSwitching:
    """The session half of a ModelWorker. `_generation` is the worker's: a thread serving an
    older generation was taken over after a stall and no longer fails over."""

    name: str
    _generation: int

    def _init_switching(
        self,
        session: Session,
        fallbacks: Fallbacks | None,
        on_failover: Callable[[str], None] | None,
        reference: Callable[[], Session] | None,
    ) -> None:
        # Loads the model on its float32 reference runtime (selection's), to tell whether an
        # input that made the backend fail is the input's fault: only on that rare path.
        self._reference = reference
        self.session = session
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
        self.failovers = 0
        self.last_error: str | None = None
        self._switch_lock = threading.Lock()  # one fail-over at a time

    def _close_all(self) -> None:
        """Close every session not left inside a stalled thread (the worker has stopped)."""
        with self._switch_lock:
            sessions = [self.session, self.standby, *self._retired]
            self.standby, self._retired = None, []
        for session in {id(s): s for s in sessions if s is not None}.values():
            if not self._is_abandoned(session):
                close_later(session)

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
                event(
                    log,
                    "failover_impossible",
                    "%s: %s; no other verified backend to fail over to",
                    self.name,
                    reason,
                    level=logging.ERROR,
                    model=self.name,
                    backend=failed.candidate.key,
                    reason=reason,
                )
                return False
            event(
                log,
                "failover",
                "%s: %s; failing over from %s to %s%s",
                self.name,
                reason,
                failed.candidate.key,
                replacement.candidate.key,
                " (the warm standby)" if warm else "",
                level=logging.WARNING,
                model=self.name,
                backend=replacement.candidate.key,
                failed_backend=failed.candidate.key,
                reason=reason,
                standby=warm,
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
            old: Session | None
            old, self.session = self.session, session
            if primary:
                self.primary = session.candidate.key
            if old is not session:
                if keep_as_standby:
                    old, self.standby = self.standby, old
                if old is not None:
                    self._retired.append(old)

    def promote_standby(self) -> bool:
        """The standby serves from the next batch on, as the pick, and the session it
        replaces is closed once its batch is done; the standby slot is left empty. False
        when there is no standby."""
        with self._switch_lock:
            if self.standby is None:
                return False
            old, self.session, self.standby = self.session, self.standby, None
            self.primary = self.session.candidate.key
            if old is not self.session:
                self._retired.append(old)
            return True

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

    # -- running with fail-over ----------------------------------------------------------
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
