"""The tuning loop: fed one telemetry window at a time (the telemetry thread calls `observe`
after publishing it), it ranks the causes of the outliers on the inference cores and acts.

observing -> (a proposal) -> settling -> verifying -> observing

* Observing: the last `windows` windows with requests are the evidence. A cause counts when
  it is among the outliers of at least `min_window_share` of them; causes are ranked by the
  outliers they touched (each outlier is a request above its window's p99, so this is the
  share of the tail the cause explains). The first cause some action of the catalogue
  (sysconf.actions) has changes for, and whose exact changes did not fail before, is the
  proposal; the causes none answers are kept in the ledger with why.
* auto = "propose": the proposal is reported (MQTT event "tuning", the log, the ledger that
  `edgectl tune` and the status list), once per distinct proposal.
* auto = "apply": unless the hourly budget is spent, it is applied through the tuning journal
  (so `edgectl revert` restores it with everything else), the evidence windows become the
  "before", `settle_windows` windows are skipped, and as many windows as the evidence are
  collected "after". edged.autotune.verdict judges them: kept, or taken back at once
  (`Journal.undo_last`) and remembered as failed. One change at a time; the evidence starts
  afresh after each.

Every step is a log event (EVENT=tuning_proposed/_applied/_kept/_reverted/_refused), an MQTT
event and a ledger entry. Errors of the loop itself are logged, never raised into telemetry.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from edged import logs
from edged.autotune.ledger import LEDGER_NAME, Ledger, fingerprint
from edged.autotune.settings import TuningConfig
from edged.autotune.verdict import WindowFigures, figures, judge
from sysconf.cpusets import CpuPlan
from sysconf.sysroot import SysRoot

log = logging.getLogger("edged.autotune")


class EventSink(Protocol):
    def publish_event(self, kind: str, detail: dict[str, Any]) -> object: ...


class TuningLoop:
    def __init__(
        self,
        config: TuningConfig,
        plan: CpuPlan,
        ledger_dir: Path | None,
        sink: EventSink | None = None,
        root: SysRoot | None = None,
        may_move: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> None:
        """`may_move`: which of the threads telemetry names (comm, pid, tid) an action may
        move (default: those whose name matches [tuning] movable; the actions never move
        edged's own nor kernel threads). Tests limit it to the processes they started."""
        from sysconf.journals import Journals

        self.config = config
        self.plan = plan
        self.root = root or SysRoot.at(config.root)
        # Under another root the journal lives inside it, where `edgectl revert --root` looks.
        state_dir = str(config.state_dir) if self.root.is_live else "/var/lib/edged"
        self.journals = Journals(self.root, state_dir)
        self.sink = sink
        self.may_move = may_move
        if may_move is None and config.movable != ("*",):
            patterns = config.movable
            self.may_move = lambda t: any(
                fnmatch.fnmatchcase(str(t.get("comm")), p) for p in patterns
            )
        self.ledger = Ledger(ledger_dir / LEDGER_NAME if ledger_dir else None, config.auto)
        if self.ledger.write_error:
            log.warning("tuning: %s", self.ledger.write_error)
        self._lock = threading.Lock()
        self._evidence: collections.deque[tuple[dict[str, Any], WindowFigures]] = collections.deque(
            maxlen=config.windows
        )
        self._before: list[WindowFigures] = []
        self._after: list[WindowFigures] = []
        self._settle = 0
        self._current: dict[str, Any] | None = None  # the step being verified
        self._last_proposed: str | None = None
        self._last_remaining: list[str] = []

    @property
    def phase(self) -> str:
        return self.ledger.phase

    # -- feeding -----------------------------------------------------------------------------
    def observe(self, payload: dict[str, Any]) -> None:
        """One telemetry window (never raises: a failing loop must not cost telemetry)."""
        try:
            with self._lock:
                self._observe(payload)
        except Exception:
            log.exception("tuning: the loop failed on a window; it goes on with the next")

    def _observe(self, payload: dict[str, Any]) -> None:
        window = figures(payload)
        if window is None:
            return  # no requests: no evidence either way
        if self.ledger.phase == "settling":
            self._settle -= 1
            if self._settle <= 0:
                self._set_phase("verifying")
            return
        if self.ledger.phase == "verifying":
            self._after.append(window)
            if len(self._after) >= len(self._before):
                self._verify()
            return
        self._evidence.append((payload, window))
        if len(self._evidence) >= self.config.windows:
            self._consider()

    # -- observing ---------------------------------------------------------------------------
    def _consider(self) -> None:
        from sysconf.actions import evidence_from_telemetry, propose_for

        needed = math.ceil(self.config.min_window_share * self.config.windows)
        evidence = [
            e
            if self.may_move is None
            else dataclasses.replace(e, intruders=tuple(t for t in e.intruders if self.may_move(t)))
            for e in evidence_from_telemetry([p for p, _ in self._evidence], live=True)
            if e.windows >= needed
        ]
        causes = propose_for(self.root, self.plan, evidence)
        chosen: tuple[dict[str, Any], dict[str, Any]] | None = None
        remaining = []
        for cause in causes:
            usable = [
                p
                for p in cause["proposals"]
                if p["changes"] and fingerprint(p["action"], p["changes"]) not in self.ledger.failed
            ]
            if usable and chosen is None:
                chosen = (cause, usable[0])
            elif not usable:
                why = cause.get("why_none") or "; ".join(
                    f"{p['action']}: {p['blocked'] or 'tried before and reverted'}"
                    for p in cause["proposals"]
                )
                remaining.append(
                    {"cause": cause["cause"], "outliers": cause["outliers"], "why": why}
                )
        self._note_remaining(remaining)
        if chosen is None:
            return
        cause, proposal = chosen
        step = {
            "action": proposal["action"],
            "cause": cause["cause"],
            "outliers": cause["outliers"],
            "windows": cause["windows"],
            "risk": proposal["risk"],
            "expected": proposal["expected"],
            "changes": proposal["changes"],
            "fingerprint": fingerprint(proposal["action"], proposal["changes"]),
        }
        if self.config.auto == "propose":
            if step["fingerprint"] != self._last_proposed:
                self._last_proposed = step["fingerprint"]
                self._record("proposed", step, "auto = propose: not applied")
            return
        used = self.ledger.applied_in_last_hour()
        if used >= self.config.max_changes_per_hour:
            if step["fingerprint"] != self._last_proposed:
                self._last_proposed = step["fingerprint"]
                why = f"the budget of {self.config.max_changes_per_hour} changes an hour is spent"
                self._record("proposed", step, why)
            return
        self._apply(step)

    def _note_remaining(self, remaining: list[dict[str, Any]]) -> None:
        self.ledger.remaining = remaining
        names = [f"{r['cause']}: {r['why']}" for r in remaining]
        if names != self._last_remaining:
            self._last_remaining = names
            for text in names:
                logs.event(log, "tuning_unanswered", "tuning: no change answers %s", text)
            self.ledger.save()

    # -- applying ----------------------------------------------------------------------------
    def _apply(self, step: dict[str, Any]) -> None:
        from sysconf.change_records import Change

        changes = [Change.from_dict(c) for c in step["changes"]]
        try:
            result = self.journals.apply(changes)
        except (OSError, ValueError) as exc:
            step["journal"] = str(self.journals.path)
            self._refused(step, f"the journal refused it: {exc}")
            return
        step["journal"] = str(self.journals.path)
        step["applied"] = [c.to_dict() for c in result.applied]
        step["refused"] = [{**c.to_dict(), "why": why} for c, why in result.skipped]
        if not result.applied:
            why = "; ".join(f"{c.path}: {w}" for c, w in result.skipped) or "nothing to change"
            self._refused(step, why)
            return
        step["applied_at"] = round(time.time(), 3)
        self._before = [w for _, w in self._evidence]
        step["before_windows"] = [w.to_dict() for w in self._before]
        self._after = []
        self._current = step
        self._record("applied", step, step["expected"])
        self._settle = self.config.settle_windows
        self._set_phase("settling" if self._settle > 0 else "verifying")

    def _refused(self, step: dict[str, Any], why: str) -> None:
        self._record("refused", step, why, level=logging.WARNING)
        self.ledger.fail(step)
        self._evidence.clear()

    # -- verifying ---------------------------------------------------------------------------
    def _verify(self) -> None:
        step = self._current
        assert step is not None
        verdict = judge(self._before, self._after, self.config.worse_tolerance)
        step["verdict"] = verdict.to_dict()
        step["after_windows"] = [w.to_dict() for w in self._after]
        step["verified_at"] = round(time.time(), 3)
        if verdict.keep:
            self._record("kept", step, verdict.reason)
        elif not self.journals.tuning.pending():
            # Someone reverted the journal meanwhile (edgectl revert): nothing of it is left.
            self._record("gone", step, f"{verdict.reason}; the journal was reverted meanwhile")
        else:
            step["undo"] = [list(pair) for pair in self.journals.tuning.undo_last()]
            self._record("reverted", step, verdict.reason, level=logging.WARNING)
            self.ledger.fail(step)
        self._current = None
        self._before, self._after = [], []
        self._evidence.clear()
        self._set_phase("observing")

    # -- reporting ---------------------------------------------------------------------------
    def _set_phase(self, phase: str) -> None:
        self.ledger.phase = phase
        self.ledger.save()

    def _record(
        self, state: str, step: dict[str, Any], reason: str, level: int = logging.INFO
    ) -> None:
        step["state"] = state
        step["reason"] = reason
        if "id" not in step:
            self.ledger.add(step)
        else:
            self.ledger.save()
        changes = ", ".join(f"{c['path']} {c['old']!r} -> {c['new']!r}" for c in step["changes"])
        logs.event(
            log,
            f"tuning_{state}",
            "tuning: %s %s for %s (%s): %s",
            state,
            step["action"],
            step["cause"],
            changes,
            reason,
            level=level,
            action=step["action"],
            cause=step["cause"],
            step=step["id"],
            reason=reason,
            journal=step.get("journal"),
        )
        if self.ledger.write_error:
            log.warning("tuning: cannot keep the record: %s", self.ledger.write_error)
        if self.sink is not None:
            detail = {
                "step": step["id"],
                "state": state,
                "action": step["action"],
                "cause": step["cause"],
                "risk": step["risk"],
                "reason": reason,
                "changes": step["changes"],
            }
            if "verdict" in step:
                detail["before"] = step["verdict"]["before"]
                detail["after"] = step["verdict"]["after"]
            try:
                self.sink.publish_event("tuning", detail)
            except Exception:
                log.exception("tuning: publishing the event failed")

    def status(self) -> dict[str, Any]:
        """For the daemon's status: the mode, phase and the last few steps."""
        with self._lock:
            last = self.ledger.steps[-5:]
            return {
                "auto": self.config.auto,
                "phase": self.ledger.phase,
                "steps": [
                    {k: s.get(k) for k in ("id", "state", "action", "cause", "reason")}
                    for s in last
                ],
                "remaining": list(self.ledger.remaining),
                "journal": str(self.journals.path),
            }


def tuning_for(config: Any, plan: CpuPlan | None, sink: EventSink | None) -> TuningLoop | None:
    """The daemon's loop for its config's [tuning] (edged.config.Config: autotune sits below
    config), its ledger in [server] state_dir; None, said in the log, where it cannot run."""
    settings, state_dir = config.tuning, config.server.state_dir
    if plan is None or not plan.inference:
        log.warning("tuning: auto = %s needs inference cores (pin a model); off", settings.auto)
        return None
    loop = TuningLoop(settings, plan, state_dir, sink)
    log.info(
        "tuning: auto = %s on CPUs %s, %d-window evidence and verification; journal %s",
        settings.auto,
        ",".join(map(str, plan.inference)),
        settings.windows,
        loop.journals.path,
    )
    return loop
