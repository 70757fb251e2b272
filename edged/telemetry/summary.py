"""The batching summary in the log: every SUMMARY_S, one event per model that served, with
its requests, how many ran in a batch on average, and its worst window's p99 and queue-wait
p99 since the last summary (what the batching settings did, for `journalctl EVENT=batching`;
the full figures are in telemetry). Fed by the telemetry loop with each window."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from edged.logs import event

SUMMARY_S = 60.0  # how often the batching summary is logged
log = logging.getLogger("edged.telemetry")


class BatchingSummary:
    def __init__(self, interval_s: float) -> None:
        self._every = max(1, round(SUMMARY_S / interval_s))  # windows per summary
        self._windows = 0
        # per model since the last summary: requests, batches, worst p99, worst queue p99
        self._acc: dict[str, list[float]] = {}
        self._batches_seen: dict[str, int] = {}

    def add(self, models: Mapping[str, Any], served: Mapping[str, Any]) -> None:
        """One telemetry window's per-model stats; `served`: the models, whose workers
        count the batches they ran."""
        for name, stats in models.items():
            worker = served[name].worker if name in served else None
            batches = getattr(worker, "batches_run", 0)
            ran = batches - self._batches_seen.get(name, batches)
            self._batches_seen[name] = batches
            acc = self._acc.setdefault(name, [0, 0, 0.0, 0.0])
            acc[0] += stats.get("count") or 0
            acc[1] += max(0, ran)
            acc[2] = max(acc[2], stats.get("p99_ms") or 0.0)
            acc[3] = max(acc[3], (stats.get("queue") or {}).get("p99_ms") or 0.0)
        self._windows += 1
        if self._windows % self._every == 0:
            self._log()

    def _log(self) -> None:
        for name, (requests, batches, p99, queue_p99) in sorted(self._acc.items()):
            if not requests:
                continue
            per_batch = requests / batches if batches else 0.0
            event(
                log,
                "batching",
                "model %s: %d requests in %d batches (%.2f a batch), p99 %.3f ms, "
                "queue wait p99 %.3f ms",
                name,
                requests,
                batches,
                per_batch,
                p99,
                queue_p99,
                model=name,
                requests=int(requests),
                batches=int(batches),
                requests_per_batch=round(per_batch, 3),
                p99_ms=p99,
                queue_p99_ms=queue_p99,
            )
        self._acc.clear()
