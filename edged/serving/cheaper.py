"""The cheaper way to run a model while the device cools, from what the selection measured.

Cost is the CPU time an inference keeps busy: the candidate's measured p50 times the cores
it occupies (its threads on a CPU, one on an accelerator, whose host thread mostly waits).
Among the candidates the selection verified against the original (status passed or
selected), the cheapest one costing at least 10 % less than the running one is used; when
none does and the model runs on more than one CPU thread, the same candidate on one thread
is: the same graph gives the same results, and one busy core heats less than several."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from backends.base import Candidate, LoadOptions
from edged.selection.candidates import find_candidate
from edged.serving.models import is_accelerator

if TYPE_CHECKING:
    from backends.model_info import ModelInfo
    from edged.selection.decision import Evidence
    from edged.serving.models import ServedModel
    from sysconf.hardware import HardwareFacts

MARGIN = 0.9  # cheaper means at most this share of the running cost
VERIFIED = ("passed", "selected")


@dataclass(frozen=True)
class Plan:
    model: ModelInfo
    candidate: Candidate
    options: LoadOptions
    why: str


def threads_of(served: ServedModel) -> int:
    policy = served.policy
    return policy.threads or len(policy.cpus or ()) or os.cpu_count() or 1


def cost(ev: Evidence, threads: int) -> float | None:
    if ev.latency is None:
        return None
    return ev.latency.p50_ms * (1 if is_accelerator(ev.candidate) else threads)


def cheaper_plan(served: ServedModel, hw: HardwareFacts | None) -> Plan | None:
    """What to load instead of the running session (module docstring); None: nothing
    cheaper is known."""
    selection = served.selection
    running = served.worker.session
    path = getattr(getattr(running, "model", None), "path", None)
    threads = threads_of(served)
    verified = [e for e in selection.evidence if e.status in VERIFIED and e.latency is not None]
    now = next(
        (
            e
            for e in verified
            if e.candidate.key == running.candidate.key and selection.model_of(e).path == path
        ),
        None,
    )
    now_cost = cost(now, threads) if now is not None else None
    options = served.load_options()
    if now_cost is not None:
        others = [(cost(e, threads) or 0.0, e) for e in verified if e is not now]
        cheap = [(c, e) for c, e in others if c <= MARGIN * now_cost]
        if cheap:
            best_cost, best = min(cheap, key=lambda item: item[0])
            best_model = selection.model_of(best)
            why = (
                f"{best.candidate.key} on {best_model.path.name} (p50 x cores {best_cost:.3g} ms, "
                f"against {now_cost:.3g} ms on {running.candidate.key})"
            )
            candidate = find_candidate(hw, best_model, best.candidate)
            return Plan(best_model, candidate, options, why)
    model = getattr(running, "model", None)
    if threads > 1 and not is_accelerator(running.candidate) and model is not None:
        why = f"{running.candidate.key} on one thread instead of {threads}"
        return Plan(model, running.candidate, replace(options, threads=1), why)
    return None
