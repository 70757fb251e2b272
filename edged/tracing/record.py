"""One traced request: its id, model, the caller's context, Triton's named timestamps and
(level TENSORS) its tensors, and the attributes of the batch it ran in.

Timestamps are time.perf_counter() values as the serving code takes them (CLOCK_MONOTONIC
on Linux, Triton's steady clock): `ns` gives them as Triton writes them, and
`wall_ns` as OpenTelemetry wants them (the wall clock, through an offset taken when the
trace starts)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.tracing.context import TraceParent

# How the front ends name their receive and send timestamps, as Triton's do.
RECV = {
    "HTTP": ("HTTP_RECV_START", "HTTP_RECV_END"),
    "GRPC": ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END"),
}
SEND = {"HTTP": ("HTTP_SEND_START", "HTTP_SEND_END"), "GRPC": ("GRPC_SEND_START", "GRPC_SEND_END")}


def _recv(transport: str) -> tuple[str, str]:
    return RECV.get(transport, (f"{transport}_RECV_START", f"{transport}_RECV_END"))


def _send(transport: str) -> tuple[str, str]:
    return SEND.get(transport, (f"{transport}_SEND_START", f"{transport}_SEND_END"))


@dataclass
class Trace:
    id: int
    model: str
    transport: str  # HTTP, GRPC, ZMQ
    parent: TraceParent | None
    tensors_on: bool = False  # level TENSORS
    request_id: str = ""
    model_version: str = "1"
    timestamps: list[tuple[str, float]] = field(default_factory=list)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    wall_offset_ns: int = field(default_factory=lambda: time.time_ns() - time.perf_counter_ns())

    def mark(self, name: str, at: float) -> None:
        self.timestamps.append((name, at))

    def received(self, start: float, end: float, request_id: str | None) -> None:
        first, last = _recv(self.transport)
        self.mark(first, start)
        self.mark(last, end)
        self.mark("REQUEST_START", end)
        self.request_id = request_id or ""

    def queued(self, at: float, feeds: Mapping[str, np.ndarray], names: Mapping[str, str]) -> None:
        """In the queue at `at`; level TENSORS: its inputs (`names`: numpy dtype name ->
        the protocol's datatype)."""
        self.mark("QUEUE_START", at)
        if self.tensors_on:
            for name, array in feeds.items():
                self.tensor("TENSOR_QUEUE_INPUT", name, array, names)

    def sending(self, at: float) -> None:
        self.mark("REQUEST_END", at)
        self.mark(_send(self.transport)[0], at)

    def sent(self, at: float) -> None:
        self.mark(_send(self.transport)[1], at)

    def ran(
        self,
        timing: Any,
        variant: str,
        outputs: Mapping[str, np.ndarray],
        names: Mapping[str, str],
    ) -> None:
        """The batch it ran in: Triton's compute timestamps and what ran it; level TENSORS:
        the outputs the backend gave."""
        self.mark("COMPUTE_START", timing.compute_start)
        self.mark("COMPUTE_INPUT_END", timing.input_end)
        self.mark("COMPUTE_OUTPUT_START", timing.output_start)
        self.mark("COMPUTE_END", timing.compute_end)
        candidate = timing.ran
        self.attributes.update(
            {
                "edged.batch.requests": timing.batch_size,
                "edged.batch.samples": timing.samples,
                "edged.backend": candidate.backend if candidate else "",
                "edged.device": candidate.device if candidate else "",
                "edged.precision": candidate.precision if candidate else "",
                "edged.variant": variant,
            }
        )
        if self.tensors_on:
            for name, array in outputs.items():
                self.tensor("TENSOR_BACKEND_OUTPUT", name, array, names)

    def tensor(self, activity: str, name: str, array: np.ndarray, names: Mapping[str, str]) -> None:
        """Level TENSORS: a tensor as Triton writes it (values comma-separated)."""
        array = np.asarray(array)
        datatype = names.get(array.dtype.name, "BYTES" if array.dtype == object else "")
        flat = array.reshape(-1)
        data = ",".join(str(v) for v in flat.tolist())
        shape = ",".join(str(d) for d in np.shape(array))
        self.tensors.append(
            {
                "activity": activity,
                "tensor": {"name": name, "data": data, "shape": shape, "dtype": datatype},
            }
        )

    @staticmethod
    def ns(at: float) -> int:
        return int(at * 1e9)

    def wall_ns(self, at: float) -> int:
        return int(at * 1e9) + self.wall_offset_ns
