"""The statistics extension's counters (Triton's `model_stats`: per model the success,
failure, queue and compute durations, and per batch size the executions), kept by
`edged.serving.inference` as requests end and answered on HTTP /v2/models[/{m}]/stats and
gRPC ModelStatistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edged.serving.protocol import VERSION

if TYPE_CHECKING:
    from edged.serving.inference import Answer


# -- the statistics extension -----------------------------------------------------------------


@dataclass
class Duration:
    """Triton's StatisticDuration: how many, and their nanoseconds together."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _Batches:
    """Executions of one batch size (in requests), built from the requests that ran in them:
    each of a batch of b reports the batch's compute time, and counts 1/b of the execution."""

    executions: float = 0.0
    input_ns: int = 0
    infer_ns: float = 0.0
    output_ns: int = 0


@dataclass
class ModelStatistics:
    """What Triton's statistics extension reports per model version, from what edged
    measures (all on the event loop: no lock). The phases:

    - queue: from the request's submission to its batch starting (the engine's queue time);
    - compute_input: decoding the request's tensors and checking them against the model
      (edged's equivalent of preparing a backend's inputs; the runtime's own input copy is
      inside its run and so in compute_infer);
    - compute_infer: the batch's run on the backend (the engine's compute time), inputs
      concatenated and outputs split included;
    - compute_output: encoding the outputs into the response;
    - success / fail: whole requests, from arrival to their answer (failures: of a model
      that exists, as Triton counts them);
    - cache_hit / cache_miss: always zero (edged has no response cache).

    execution_count and batch_stats are derived from the requests (see _Batches); their
    batch size is the number of requests run together. Counts start when the daemon does
    (a reload that replaces the model keeps them: they are the model's, not the version's)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    last_inference_ms: int = 0
    batches: dict[int, _Batches] = field(default_factory=dict)

    def to_dict(self, name: str) -> dict[str, Any]:
        zero = Duration().to_dict()
        batches = sorted(self.batches.items())
        return {
            "name": name,
            "version": VERSION,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": sum(round(b.executions) for _, b in batches),
            "inference_stats": {
                "success": self.success.to_dict(),
                "fail": self.fail.to_dict(),
                "queue": self.queue.to_dict(),
                "compute_input": self.compute_input.to_dict(),
                "compute_infer": self.compute_infer.to_dict(),
                "compute_output": self.compute_output.to_dict(),
                "cache_hit": zero,
                "cache_miss": zero,
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": {"count": round(b.executions), "ns": b.input_ns},
                    "compute_infer": {"count": round(b.executions), "ns": int(b.infer_ns)},
                    "compute_output": {"count": round(b.executions), "ns": b.output_ns},
                }
                for size, b in batches
            ],
            "memory_usage": [],
        }


class Statistics:
    def __init__(self) -> None:
        self._models: dict[str, ModelStatistics] = {}

    def model(self, name: str) -> ModelStatistics:
        stats = self._models.get(name)
        if stats is None:
            stats = self._models[name] = ModelStatistics()
        return stats

    def succeeded(self, name: str, answer: Answer, total_s: float) -> None:
        stats = self.model(name)
        timing = answer.timing
        input_ns, output_ns = int(answer.input_s * 1e9), int(answer.output_s * 1e9)
        stats.success.add(total_s)
        stats.queue.add(timing.queue_s)
        stats.compute_input.ns += input_ns
        stats.compute_input.count += 1
        stats.compute_infer.add(timing.compute_s)
        stats.compute_output.ns += output_ns
        stats.compute_output.count += 1
        stats.inference_count += answer.samples
        stats.last_inference_ms = int(time.time() * 1000)
        size = max(1, timing.batch_size)
        batch = stats.batches.get(size)
        if batch is None:
            batch = stats.batches[size] = _Batches()
        batch.executions += 1 / size
        batch.input_ns += input_ns
        batch.infer_ns += timing.compute_s * 1e9 / size
        batch.output_ns += output_ns

    def failed(self, name: str, total_s: float) -> None:
        self.model(name).fail.add(total_s)
