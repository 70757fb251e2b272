"""`[server] metrics_names = "triton"`: /metrics under Triton's names, labels and units, read
from the statistics extension's counters (so the two can never disagree); then a real daemon
scraped under them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from edged.serving.metrics import TRITON_COUNTERS, triton_metrics_text
from edged.serving.requests import Timing
from edged.serving.statistics import Statistics
from tests.support import REPO
from tests.support.daemon_harness import (
    OUT,
    Daemon,
    cls_input,
    cls_table,
    get,
    grpc_port,
    write_config,
)


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
    from edged.config import ConfigError, load_config

    config = tmp_path / "edged.toml"
    config.write_text('[server]\nmetrics_names = "nvidia"\n')
    with pytest.raises(ConfigError, match=r'server\.metrics_names: must be "edged" or "triton"'):
        load_config(config)


# -- against the daemon ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("triton-metrics")
    config = write_config(folder, cls_table(models_dir), 'metrics_names = "triton"')
    d = Daemon(config).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def _samples(text: str, name: str) -> dict[str, float]:
    """model -> value of the family's samples (Triton's: labelled model and version "1")."""
    found = re.findall(rf'^{name}\{{model="(\w+)",version="1"\}} (\S+)$', text, re.MULTILINE)
    return {model: float(value) for model, value in found}


@pytest.mark.integration
def test_a_daemon_scraped_under_tritons_names(daemon: Daemon) -> None:
    """HTTP and gRPC requests, counted under Triton's names as the statistics extension
    counts them; edged's families without a Triton name stay; `?names=edged` gives edged's
    own for one scrape (what `edgectl status` reads, and it says where gRPC listens)."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    x = cls_input()
    http = th.InferenceServerClient(daemon.address)
    grpc_client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port(daemon)}")
    try:
        for lib, client in ((th, http), (tg, grpc_client), (tg, grpc_client)):
            item = lib.InferInput("x", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            assert client.infer("cls", [item]).as_numpy(OUT).shape == (1, 2)
        short = th.InferInput("x", [1, 3, 48, 24], "FP32")
        short.set_data_from_numpy(x[:, :, :, :24].copy())
        with pytest.raises(InferenceServerException):
            http.infer("cls", [short])
        [stats] = http.get_inference_statistics("cls")["model_stats"]
    finally:
        http.close()
        grpc_client.close()

    status, body = get(daemon, "/metrics")
    text = body.decode()
    assert status == 200
    assert _samples(text, "nv_inference_request_success") == {"cls": 3.0}
    assert _samples(text, "nv_inference_request_failure") == {"cls": 1.0}
    assert _samples(text, "nv_inference_count") == {"cls": float(stats["inference_count"])}
    queue_us = int(stats["inference_stats"]["queue"]["ns"]) / 1000
    assert _samples(text, "nv_inference_queue_duration_us")["cls"] == pytest.approx(queue_us)
    assert _samples(text, "nv_inference_pending_request_count") == {"cls": 0.0}
    assert "edged_requests_total" not in text and "edged_request_duration_seconds" not in text
    assert re.search(r'^edged_backend_info\{.*model="cls"', text, re.MULTILINE)
    assert re.search(r'^edged_model_degraded\{model="cls"\} 0\.0$', text, re.MULTILINE)
    families = {f.name for f in text_string_to_metric_families(text)}  # one valid text
    assert {"nv_inference_request_success", "edged_backend_info"} <= families

    own = get(daemon, "/metrics?names=edged")[1].decode()
    assert re.search(r'^edged_requests_total\{code="200",model="cls"\} 3\.0$', own, re.MULTILINE)
    assert "nv_inference" not in own
    status, body = get(daemon, "/metrics?names=nvidia")
    assert status == 400 and b"names is edged or triton" in body

    proc = subprocess.run(
        [sys.executable, "-m", "edged.cli.main", "status", "--address", daemon.address, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["latency_ms"]["cls"]["requests"] == 3  # the answered ones
    assert report["listening"]["grpc"][0] == f"127.0.0.1:{grpc_port(daemon)}"
    assert report["listening"]["grpc"][1] == f"unix:{daemon.config.parent / 'grpc.sock'}"
    assert f"http://{daemon.address}" in report["listening"]["http"]
