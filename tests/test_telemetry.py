"""The telemetry loop on a real served model: one payload per interval with the latency
window, thermals and system load; a stop flushes the partial window."""

from __future__ import annotations

import json
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


@pytest.fixture
def served(models_dir: Path, tmp_path: Path):
    model = load_model("cls", models_dir / "ppocr_cls.onnx",
                       Policy(runs=10, warmup=1, time_budget_s=1.0, threads=1, shapes=CLS),
                       BatchingConfig(), probe(), tmp_path / "state")
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
