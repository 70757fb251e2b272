"""What a request is to the engine: its errors (with the HTTP status each maps to), its
timing and the queued entry itself (a model's batching settings are the config's
BatchingConfig). Apart from `edged.serving.engine` so the API can name them without the
worker."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from backends.base import Candidate, Session


class EngineError(Exception):
    status = 500


class QueueFull(EngineError):
    status = 503


class DeadlineExceeded(EngineError):
    status = 504


class NotServing(EngineError):
    status = 503


@dataclass(frozen=True)
class Timing:
    queue_s: float
    compute_s: float
    batch_size: int  # requests in the batch
    # For traces (perf_counter values): the batch's compute began (before its inputs were
    # stacked), its inputs were ready, the backend returned, this request's outputs were cut.
    compute_start: float = 0.0
    input_end: float = 0.0
    output_start: float = 0.0
    compute_end: float = 0.0
    samples: int = 0  # samples in the batch (its batch dim)
    ran: Candidate | None = None  # the backend that ran it (the standby after a fail-over)


# Picks the next verified backend's session; the argument, when given, says which candidates
# are still usable (an accelerator may have gone away).
Fallbacks = Callable[[Callable[[Candidate], bool] | None], "Session | None"]
Done = Callable[[dict[str, np.ndarray] | None, BaseException | None, Timing | None], None]


@dataclass
class Pending:
    feeds: Mapping[str, np.ndarray]
    deadline: float  # time.monotonic()
    enqueued: float  # time.perf_counter()
    done: Done
    retried: bool = False  # re-run once on another backend after a stall

    def batch_key(self) -> tuple:
        return tuple((k, v.shape[1:], v.dtype.str) for k, v in sorted(self.feeds.items()))
