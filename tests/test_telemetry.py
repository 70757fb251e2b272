"""The telemetry loop on a real served model: one payload per interval with the latency
window, thermals and system load; a stop flushes the partial window."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edged.engine import BatchingConfig
from edged.latency import CoreSampler
from edged.selection import Policy
from edged.serving import load_model
from edged.telemetry import TelemetryLoop
from sysconf.hardware import probe

CLS = {"x": (1, 3, 48, 192)}


class Collect:
    """The sink side: what a publisher would get (the MQTT publisher has its own tests)."""

    def __init__(self) -> None:
        self.telemetry: list[dict] = []
        self.events: list[tuple[str, dict]] = []

    def publish_telemetry(self, payload: dict) -> None:
        self.telemetry.append(payload)

    def publish_event(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))


def _load(models_dir: Path, tmp_path: Path, cpus: tuple[int, ...] | None = None):
    return load_model("cls", models_dir / "ppocr_cls.onnx",
                      Policy(runs=10, warmup=1, time_budget_s=1.0, threads=1, shapes=CLS,
                             cpus=cpus),
                      BatchingConfig(), probe(), tmp_path / "state")


@pytest.fixture
def served(models_dir: Path, tmp_path: Path):
    model = _load(models_dir, tmp_path)
    yield model
    model.worker.stop(1.0)


def test_payload_per_interval(served) -> None:
    sink = Collect()
    loop = TelemetryLoop(0.3, lambda: {"cls": served}, sink,
                         sampler=CoreSampler(rate_hz=20))
    loop.start()
    feeds = {"x": np.zeros((1, 3, 48, 192), np.float32)}
    deadline = time.monotonic() + 1.0
    sent = 0
    while time.monotonic() < deadline:
        served.worker.submit(feeds, lambda *a: None)
        sent += 1
        time.sleep(0.01)
    time.sleep(0.1)
    loop.stop()
    assert len(sink.telemetry) >= 3
    total = sum(p["models"]["cls"]["count"] for p in sink.telemetry)
    assert total == sent  # nothing lost between windows, the partial one flushed at stop
    busy = [p for p in sink.telemetry if p["models"]["cls"]["count"]]
    model = busy[0]["models"]["cls"]
    assert model["p99_ms"] >= model["p50_ms"] > 0
    assert model["jitter_ms"] == pytest.approx(model["p99_ms"] - model["p50_ms"], abs=1e-6)
    assert set(model["queue"]) >= {"p50_ms", "p99_ms"} and model["backend"]
    assert isinstance(model["outliers"], dict)
    for payload in sink.telemetry:
        json.dumps(payload)  # plain JSON all the way down
        assert set(payload) >= {"models", "thermal", "system"}
        assert payload["system"]["mem_total_bytes"] > 0
        assert "throttling" in payload["thermal"]
    # Since start: every request so far, in each payload; the last one has them all.
    running = [p["models"]["cls"]["since_start"]["count"] for p in sink.telemetry]
    assert running == sorted(running) and running[-1] == sent
    assert running == list(np.cumsum([p["models"]["cls"]["count"] for p in sink.telemetry]))
    last = sink.telemetry[-1]["models"]["cls"]["since_start"]
    assert set(last) == {"count", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms",
                         "mean_ms", "stdev_ms", "jitter_ms"}
    assert last["p99_ms"] >= last["p50_ms"] > 0
    assert last["max_ms"] == max(p["models"]["cls"]["max_ms"] for p in busy)
    # Intrusions: unpinned model, so every CPU; rates from the sampler's counters.
    intrusions = sink.telemetry[-1]["system"]["intrusions"]
    assert intrusions["scope"] == "all" and intrusions["span_s"] > 0
    assert set(intrusions["cpus"]) == {str(c) for c in range(os.cpu_count() or 1)}
    assert all(r["interrupts_per_s"] >= 0 and r["softirqs_per_s"] >= 0
               for r in intrusions["cpus"].values())
    assert sum(r["interrupts_per_s"] for r in intrusions["cpus"].values()) > 0
    assert intrusions["workers"]["cls"]["involuntary_switches_per_s"] >= 0


def test_intrusion_rates_on_a_pinned_core_with_a_competing_thread(
        models_dir: Path, tmp_path: Path) -> None:
    """A thread spinning on the model's core preempts its worker: the payload shows
    involuntary switches of that worker and interrupts on that core only."""
    cpu = max(os.sched_getaffinity(0))
    model = _load(models_dir, tmp_path, cpus=(cpu,))
    sink = Collect()
    loop = TelemetryLoop(0.4, lambda: {"cls": model}, sink,
                         sampler=CoreSampler([cpu], rate_hz=20))
    stop = threading.Event()
    data = b"x" * (1 << 18)

    def hog() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        while not stop.is_set():
            hashlib.sha256(data).digest()  # releases the GIL: competes for the core itself

    competitor = threading.Thread(target=hog, daemon=True)
    try:
        loop.start()
        competitor.start()
        feeds = {"x": np.zeros((1, 3, 48, 192), np.float32)}
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            done = threading.Event()
            model.worker.submit(feeds, lambda *a, done=done: done.set())
            done.wait(5)
    finally:
        stop.set()
        competitor.join(5)
        loop.stop()
        model.worker.stop(1.0)
    rates = [p["system"]["intrusions"] for p in sink.telemetry]
    assert all(r["scope"] == "inference" and set(r["cpus"]) == {str(cpu)} for r in rates)
    switches = [r["workers"]["cls"]["involuntary_switches_per_s"] for r in rates]
    print(f"\nworker involuntary switches/s with a competitor on CPU {cpu}: {switches}")
    assert max(s for s in switches if s is not None) > 0
    assert max(r["cpus"][str(cpu)]["interrupts_per_s"] or 0 for r in rates) > 0
