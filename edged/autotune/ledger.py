"""The tuning loop's record, kept in the daemon's state dir as one JSON file (replaced
atomically) so `edgectl tune` can list it without asking the daemon, and so a restarted
daemon does not retry what already failed.

Steps, newest last (at most MAX_STEPS): each proposal with its state, "proposed" (auto =
propose, or the hourly budget was spent), "applied" (being verified), "kept", "reverted",
"refused" (the system refused every write) or "gone" (an operator's `edgectl revert` took it
back first), its changes (path, old, new), the verdict's figures and reason. `failed`: the
fingerprints (action and the exact changes) of steps that were reverted or refused: never
tried again until the evidence changes, which means until the action proposes different
changes (another IRQ, another thread). `remaining`: the causes no action answers, and why.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

MAX_STEPS = 100
LEDGER_NAME = "tuning-loop.json"
HOUR_S = 3600.0


def fingerprint(action: str, changes: list[dict[str, Any]]) -> str:
    return json.dumps([action, sorted((c["path"], c["new"]) for c in changes)])


class Ledger:
    def __init__(self, path: Path | None, mode: str) -> None:
        self.path = path
        self.mode = mode
        self.phase = "observing"
        self.steps: list[dict[str, Any]] = []
        self.failed: dict[str, dict[str, Any]] = {}
        self.remaining: list[dict[str, Any]] = []
        self.write_error: str | None = None
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:  # a broken record must not stop the daemon
            self.write_error = f"{path}: unreadable, starting a new record ({exc})"
            return
        if isinstance(doc, dict):
            self.steps = [s for s in doc.get("steps") or [] if isinstance(s, dict)]
            self.failed = {
                k: v for k, v in (doc.get("failed") or {}).items() if isinstance(v, dict)
            }
            for step in self.steps:  # a daemon stopped mid-verification: its journal has it
                if step.get("state") == "applied":
                    step["state"] = "unverified"
                    step["reason"] = "the daemon stopped before verifying it (still applied)"

    def next_id(self) -> int:
        return max((int(s.get("id", 0)) for s in self.steps), default=0) + 1

    def add(self, step: dict[str, Any]) -> dict[str, Any]:
        step.setdefault("id", self.next_id())
        step.setdefault("at", round(time.time(), 3))
        self.steps.append(step)
        del self.steps[:-MAX_STEPS]
        self.save()
        return step

    def applied_in_last_hour(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        return sum(1 for s in self.steps if s.get("applied_at", -HOUR_S) > now - HOUR_S)

    def fail(self, step: dict[str, Any]) -> None:
        self.failed[step["fingerprint"]] = {
            "action": step["action"],
            "cause": step["cause"],
            "at": round(time.time(), 3),
            "reason": step.get("reason"),
        }
        self.save()

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "phase": self.phase,
            "updated": round(time.time(), 3),
            "steps": self.steps,
            "failed": self.failed,
            "remaining": self.remaining,
        }

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
            os.replace(tmp, self.path)
            self.write_error = None
        except OSError as exc:
            self.write_error = f"{self.path}: {exc.strerror or exc}"
