"""Triton's JSON trace file: a list with, per trace, an entry naming its model, one entry
per timestamp and one per tensor (level TENSORS), as `docs/user_guide/trace.md` of Triton
shows and its trace_summary.py reads.

When it is written, as Triton does: with log_frequency 0, all traces at shutdown to the
file itself; with log_frequency N, every N traces to `<file>.0`, `<file>.1`, ...; and when
trace_count runs out, what is collected goes to the next indexed file. The writes happen on
one background thread: never on the event loop that finished the request."""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edged.tracing.record import Trace

log = logging.getLogger("edged.tracing")

MAX_PENDING = 10_000  # traces held in memory before they are written whatever the settings
MAX_PENDING_BYTES = 64 * 2**20


def entries(trace: Trace) -> list[dict[str, Any]]:
    """One trace's entries in Triton's format."""
    head: dict[str, Any] = {
        "id": trace.id,
        "model_name": trace.model,
        "model_version": int(trace.model_version) if trace.model_version.isdigit() else 1,
    }
    if trace.request_id:
        head["request_id"] = trace.request_id
    if trace.parent is not None:
        head["traceparent"] = trace.parent.header  # edged's addition: the caller's trace
    out = [head]
    out += [
        {"id": trace.id, "timestamps": [{"name": n, "ns": Trace.ns(t)}]}
        for n, t in trace.timestamps
    ]
    out += [{"id": trace.id, **tensor} for tensor in trace.tensors]
    return out


class TraceFile:
    def __init__(self, path: Path):
        self.path = path
        self._pending: list[Trace] = []
        self._bytes = 0  # an estimate of what the pending traces hold
        self._said_full = False
        self._index = 0
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edged-trace-file")

    def add(self, trace: Trace, log_frequency: int, last: bool) -> None:
        """A finished trace; `last`: trace_count ran out with it (write what is collected).
        Past MAX_PENDING traces or MAX_PENDING_BYTES of them in memory (log_frequency 0 and
        no count: Triton would hold them all until shutdown) they go to the next indexed
        file all the same: a daemon left tracing for weeks must not grow without bound."""
        with self._lock:
            self._pending.append(trace)
            self._bytes += 64 * len(trace.timestamps) + sum(
                len(t["tensor"]["data"]) for t in trace.tensors
            )
            full = len(self._pending) >= MAX_PENDING or self._bytes >= MAX_PENDING_BYTES
            if not (last or full or (log_frequency and len(self._pending) >= log_frequency)):
                return
            if full and not self._said_full:
                self._said_full = True
                log.warning(
                    "%d traces (%d MiB) held for %s: written to indexed files from now on "
                    "(set [trace] log_frequency or count to choose when)",
                    len(self._pending),
                    self._bytes // 2**20,
                    self.path,
                )
            batch, self._pending, self._bytes = self._pending, [], 0
            target = self.path.with_name(f"{self.path.name}.{self._index}")
            self._index += 1
        self._writer.submit(self._write, target, batch)

    def close(self) -> None:
        """At shutdown: what is left goes to the file itself (or the next indexed one when
        indexed files were written), and the writer thread ends."""
        with self._lock:
            batch, self._pending = self._pending, []
            target = (
                self.path
                if self._index == 0
                else self.path.with_name(f"{self.path.name}.{self._index}")
            )
        if batch:
            self._writer.submit(self._write, target, batch)
        self._writer.shutdown(wait=True)

    @staticmethod
    def _write(target: Path, traces: list[Trace]) -> None:
        doc = [entry for trace in traces for entry in entries(trace)]
        tmp = target.with_name(target.name + ".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
            os.replace(tmp, target)
        except OSError as exc:
            log.error("trace file %s not written (%d traces lost): %s", target, len(traces), exc)
