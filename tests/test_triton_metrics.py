"""`[server] metrics_names = "triton"`: /metrics under Triton's names, labels and units, read
from the statistics extension's counters (so the two can never disagree)."""

from __future__ import annotations

import re
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from edged.serving.inference import Statistics
from edged.serving.metrics import TRITON_COUNTERS, triton_metrics_text
from edged.serving.requests import Timing


def _answer(queue_s: float, compute_s: float, batch: int, samples: int = 1):
    return SimpleNamespace(
        timing=Timing(queue_s, compute_s, batch), input_s=0.0001, output_s=0.0002, samples=samples
    )


def test_triton_names_labels_and_microseconds() -> None:
    stats = Statistics()
    stats.succeeded("cls", _answer(0.001, 0.002, 1), 0.004)
    stats.succeeded("cls", _answer(0.003, 0.004, 2, samples=2), 0.008)
    stats.succeeded("cls", _answer(0.003, 0.004, 2, samples=2), 0.008)
    stats.failed("cls", 0.5)
    rows = lambda: [stats.model("cls").to_dict("cls")]  # noqa: E731
    text = triton_metrics_text(rows(), {"cls": 3}).decode()
    assert "_total" not in text  # Triton's counters carry no suffix
    assert "# TYPE nv_inference_request_success counter" in text
    # Prometheus' parser reads it (it would name counter samples `_total`; the text does not).
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["nv_inference_request_success"] == "counter"
    assert families["nv_inference_pending_request_count"] == "gauge"
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r'(\w+)\{model="(\w+)",version="(\d+)"\} (\S+)', line)
        if match:
            name, model, version, value = match.groups()
            samples[name] = ({"model": model, "version": version}, float(value))
    labels = {"model": "cls", "version": "1"}
    assert samples["nv_inference_request_success"] == (labels, 3.0)
    assert samples["nv_inference_request_failure"] == (labels, 1.0)
    assert samples["nv_inference_count"] == (labels, 5.0)  # batches of two count two
    assert samples["nv_inference_exec_count"] == (labels, 2.0)  # one single, one pair
    assert samples["nv_inference_request_duration_us"][1] == 20_000.0
    assert samples["nv_inference_queue_duration_us"][1] == 7_000.0
    assert samples["nv_inference_compute_infer_duration_us"][1] == 10_000.0
    assert samples["nv_inference_compute_input_duration_us"][1] == 300.0
    assert samples["nv_inference_compute_output_duration_us"][1] == 600.0
    assert samples["nv_inference_pending_request_count"] == (labels, 3.0)
    assert {name for name, *_ in TRITON_COUNTERS} <= set(samples)


def test_the_key_is_checked(tmp_path) -> None:
    import pytest

    from edged.config import ConfigError, load_config

    config = tmp_path / "edged.toml"
    config.write_text('[server]\nmetrics_names = "nvidia"\n')
    with pytest.raises(ConfigError, match=r'server\.metrics_names: must be "edged" or "triton"'):
        load_config(config)
