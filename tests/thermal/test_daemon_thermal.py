"""[thermal] admission on a real daemon reading a fake board's thermal zone, under a steady
stream of requests: as the zone heats the model moves to its cheaper way to run (one thread
instead of two) before the trip, and back once it cools, without losing a request; past the
trip it sheds with 503 and Retry-After, and steps back down one step per hold. Every step is
an event (checked against the MQTT schema), in the status and on /metrics."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from tests.support.daemon_harness import CLS_BODY, Daemon, cls_table, get, write_config
from tests.support.schema import check
from tests.support.thermal_roots import thermal_root

pytestmark = pytest.mark.integration
TEMP = "sys/class/thermal/thermal_zone0/temp"


class Stream:
    """Requests one after another on one connection, every `gap_s`: (status, Retry-After)."""

    def __init__(self, daemon: Daemon, gap_s: float = 0.01) -> None:
        self.daemon, self.gap_s = daemon, gap_s
        self.answers: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.daemon.address, timeout=30)
        body, headers = CLS_BODY
        while not self._stop.is_set():
            conn.request("POST", "/v2/models/cls/infer", body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            self.answers.append((response.status, response.getheader("Retry-After")))
            time.sleep(self.gap_s)
        conn.close()

    def mark(self) -> int:
        return len(self.answers)

    def since(self, mark: int) -> list[tuple[int, str | None]]:
        return self.answers[mark:]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def status(daemon: Daemon) -> dict:
    return json.loads(get(daemon, "/edged/status")[1])


def wait_for(daemon: Daemon, what, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        doc = status(daemon)
        if what(doc):
            return doc
        assert time.monotonic() < deadline, json.dumps(doc.get("thermal"), indent=1)
        time.sleep(0.1)


def step_of(doc: dict) -> str | None:
    care = (doc.get("thermal") or {}).get("models", {}).get("cls")
    return care["step"] if care else None


def test_a_heating_board_moves_the_model_before_the_trip_and_back(
    models_dir: Path, tmp_path: Path
) -> None:
    board = thermal_root(tmp_path / "board", {"cpu-thermal": 40000, "gpu-thermal": 90000})
    # passive 70 °C, band 20: cheaper from 66 °C, limit from 68, shed from 70 (the trip)
    config = write_config(
        tmp_path,
        cls_table(models_dir).replace("threads = 1", "threads = 2")
        + f"""
[thermal]
admission = "on"
zones = ["cpu-thermal"]
root = "{board}"
interval_s = 0.2
hold_s = 1.0
retry_after_s = 3
""",
    )
    d = Daemon(config).wait_ready()
    stream = None
    try:
        wait_for(d, lambda s: step_of(s) == "normal")
        stream = Stream(d)
        time.sleep(0.5)
        start = stream.mark()
        (board / TEMP).write_text("67000\n")  # headroom 0.85: before the trip at 70 °C
        hot = wait_for(d, lambda s: s["models"][0]["cooling"] is not None)
        assert step_of(hot) == "cheaper"
        assert "on one thread instead of 2" in hot["models"][0]["cooling"]
        assert hot["thermal"]["headroom"]["device"] == pytest.approx(0.85)
        assert hot["thermal"]["headroom"]["zone"] == "cpu-thermal"  # gpu-thermal not watched
        time.sleep(0.5)
        (board / TEMP).write_text("45000\n")
        back = wait_for(d, lambda s: s["models"][0]["cooling"] is None and step_of(s) == "normal")
        assert back["models"][0]["standby"] is None and not back["models"][0]["degraded"]
        time.sleep(0.5)
        through = stream.since(start)
        assert len(through) > 50 and all(code == 200 for code, _ in through), through

        (board / TEMP).write_text("71000\n")  # past the trip: shed at once
        wait_for(d, lambda s: step_of(s) == "shed")
        time.sleep(0.5)
        shed = stream.since(stream.mark() - 5)
        assert shed and all(answer == (503, "3") for answer in shed), shed
        (board / TEMP).write_text("50000\n")  # cool: down one step per second's hold
        wait_for(d, lambda s: step_of(s) == "normal" and s["models"][0]["cooling"] is None)
        time.sleep(0.5)
        assert stream.since(stream.mark() - 5) == [(200, None)] * 5
        _, metrics = get(d, "/metrics")
    finally:
        if stream is not None:
            stream.stop()
        d.stop()
    text = metrics.decode()
    assert 'edged_thermal_step{model="cls"} 0.0' in text
    assert 'edged_thermal_headroom{type="cpu-thermal",zone="thermal_zone0"} 0.0' in text
    assert 'edged_thermal_refused_total{model="cls"}' in text
    events = [
        json.loads(line[line.index("{") :])
        for line in d.log_text().splitlines()
        if '"topic":"event"' in line and '"thermal_step"' in line
    ]
    for event in events:
        check("event", event)
    steps = [(e["previous"], e["step"]) for e in events]
    assert steps == [
        ("normal", "cheaper"),
        ("cheaper", "normal"),
        ("normal", "shed"),
        ("shed", "limit"),
        ("limit", "cheaper"),
        ("cheaper", "normal"),
    ]
    assert events[2]["zone"] == "cpu-thermal" and events[2]["temp_c"] == 71.0
    assert "refusing every request" in events[2]["action"]
