"""`edgectl status --watch`: the interval's figures from two readings (rates, bucket
quantiles, outliers by cause, the histogram's bars), and the command against a real daemon
under load, as text frames and as JSON lines."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
from pathlib import Path

import pytest

from edged.cli.status_watch import Reading, frame, quantile_le, render
from tests.support.daemon_harness import (
    REPO,
    Daemon,
    binary_request,
    cls_input,
    cls_table,
    post,
    python_argv,
    write_config,
)

STATUS = {"models": [{"name": "det", "backend": "rknn", "device": "NPU", "queue_depth": 3}]}


def reading(at: float, cumulative: list[float], outliers: float) -> Reading:
    bounds = [0.001, 0.0025, 0.005, float("inf")]
    return Reading(
        at,
        STATUS,
        {"det": list(zip(bounds, cumulative, strict=True))},
        {("det", "irq"): outliers, ("det", "preempted"): 1.0},
        {"npu-thermal": 61.5, "cpu-thermal": 58.0},
    )


def test_a_frame_is_what_happened_between_two_readings() -> None:
    before = reading(10.0, [100, 150, 160, 160], 2)
    now = reading(12.0, [100, 240, 259, 260], 5)  # 100 more: 0, 90 in <=2.5, 9, 1
    view = frame(before, now)
    det = view["models"][0]
    assert det["requests"] == 100 and det["rate_per_s"] == 50.0
    assert det["p50_ms_le"] == 2.5 and det["p99_ms_le"] == 5.0
    assert det["outliers"] == {"irq": 3}  # preempted did not change
    assert [r["count"] for r in det["histogram"]] == [0, 90, 9, 1]
    assert view["hottest"] == {"zone": "npu-thermal", "celsius": 61.5}
    text = render(view, "unix:/run/edged/edged.sock")
    assert "npu-thermal 61.5 °C" in text and "irq 3" in text
    bars = [line for line in text.splitlines() if "ms |" in line]
    assert len(bars) == 3 and bars[0].count("#") == 40 and bars[-1].startswith("    <=    +Inf")
    assert quantile_le([], 0.5) is None


@pytest.mark.integration
def test_watch_a_loaded_daemon(models_dir: Path, tmp_path: Path) -> None:
    daemon = Daemon(write_config(tmp_path, cls_table(models_dir))).wait_ready()
    stop = threading.Event()
    request = binary_request(cls_input())

    def load() -> None:
        conn = http.client.HTTPConnection(daemon.address, timeout=30)
        while not stop.is_set():
            assert post(conn, "cls", request)[0] == 200
            stop.wait(0.02)
        conn.close()

    traffic = threading.Thread(target=load, daemon=True)
    traffic.start()
    socket = f"unix:{tmp_path / 'edged.sock'}"
    try:
        cmd = [*python_argv(), "-m", "edged.cli.main", "status", "--address", socket]
        text = subprocess.run(
            [*cmd, "--watch", "1", "--count", "2"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        lines = subprocess.run(
            [*cmd, "--watch", "0.5", "--count", "2", "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
    finally:
        stop.set()
        traffic.join(10)
        assert daemon.stop() == 0, daemon.log_text()
    assert text.returncode == 0, text.stderr
    frames = text.stdout.split("\n\n")  # piped: frames one after another
    assert len(frames) == 2 and all(f.startswith(f"edged at {socket}") for f in frames)
    assert "cls: latency in the last" in frames[1] and " ms |#" in frames[1]
    views = [json.loads(line) for line in lines.stdout.splitlines()]
    assert len(views) == 2 and lines.returncode == 0
    cls = views[1]["models"][0]
    assert cls["model"] == "cls" and cls["rate_per_s"] > 1 and cls["p99_ms_le"] > 0
    assert sum(r["count"] for r in cls["histogram"]) == cls["requests"]
