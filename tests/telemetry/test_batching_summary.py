"""The batching summary: one `batching` event per model that served, every SUMMARY_S worth
of telemetry windows, with its requests, batches and worst tails since the last one."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from edged.logs import FIELDS
from edged.telemetry.summary import BatchingSummary


def test_one_event_a_minute_per_model_that_served(caplog) -> None:
    caplog.set_level(logging.INFO, "edged.telemetry")
    worker = SimpleNamespace(batches_run=0)
    served = {"det": SimpleNamespace(worker=worker), "idle": SimpleNamespace(worker=worker)}
    summary = BatchingSummary(interval_s=20.0)  # a summary every 3 windows
    windows = [(40, 10, 5.0, 1.0), (20, 5, 9.0, 2.5), (60, 15, 4.0, 0.5)]
    for i, (count, batches, p99, queue_p99) in enumerate(windows):
        worker.batches_run += batches
        stats = {"count": count, "p99_ms": p99, "queue": {"p99_ms": queue_p99}}
        summary.add({"det": stats, "idle": {"count": 0}}, served)
        assert bool(caplog.records) == (i == 2)
    (record,) = caplog.records
    fields = getattr(record, FIELDS)
    # The first window's batches are the baseline (the worker ran before telemetry looked).
    assert fields == {
        "event": "batching",
        "model": "det",
        "requests": 120,
        "batches": 20,
        "requests_per_batch": 6.0,
        "p99_ms": 9.0,
        "queue_p99_ms": 2.5,
    }
    assert record.getMessage().startswith("model det: 120 requests in 20 batches (6.00 a batch)")
