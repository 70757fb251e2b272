"""A short soak: scripts/bench_soak.py for under two minutes, everything it drives at once
(HTTP, gRPC, streams, shared memory, bad requests, a reload, repository churn, fleet commands)
against the real daemon and a real Mosquitto. Fails when a good request fails, the daemon
dies or stops uncleanly, or its descriptors or threads grow. RSS and latency need hours to
judge: the long run is in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.needs_broker]


def test_a_short_soak_grows_no_descriptors_or_threads_and_fails_no_request(test_data) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench_soak.py"),
            *("--duration-s", "100", "--warmup-s", "40", "--sample-s", "4", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["died"] is None, report["daemon_log_tail"]
    assert report["daemon_exit"] == 0, report["daemon_log_tail"]
    failed = {name: c["errors"] for name, c in report["counts"].items() if c["failed"]}
    assert not failed, failed
    for actor in ("http_infer", "grpc_infer", "grpc_stream", "shm", "repository", "commands"):
        assert report["counts"][actor]["ok"] > 0, f"{actor} never got an answer"
    assert report["counts"]["bad"]["refused"] > 0
    for resource in ("fds", "threads"):
        verdict = report["verdicts"][resource]
        assert not verdict["growing"], (resource, verdict, report["samples"])
    assert len(report["samples"]) >= 20
