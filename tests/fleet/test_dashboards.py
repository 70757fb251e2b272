"""The Grafana dashboards and alert rules in docs/dashboards/ against a real Prometheus
(Debian's, fetched by `make data`, never installed as a service) scraping a real daemon
under load (in edged's names and, as a second job, in Triton's) and a real
`edgectl fleet --prometheus` fed by that daemon's MQTT telemetry through a real Mosquitto.

Every panel's every query is evaluated: it must not fail, and it must return data whenever
a metric it reads exists for that job (a renamed metric or a wrong label fails here, not on
an operator's screen). The rules pass `promtool check rules`, Prometheus evaluates them
without error, and each reads only metrics that exist."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from scripts.fetch_test_data import tools_dir
from tests.support.broker import Broker, free_port, wait_port
from tests.support.daemon_harness import REPO, Daemon, cls_input, cls_table, write_config

TOOLS = tools_dir()
PROMETHEUS = TOOLS / "prometheus" / "prometheus"
PROMTOOL = TOOLS / "prometheus" / "promtool"
DASHBOARDS = REPO / "docs" / "dashboards"
RULES = DASHBOARDS / "edged-alerts.yml"

pytestmark = [
    pytest.mark.needs_broker,
    pytest.mark.slow,
    pytest.mark.skipif(
        not PROMETHEUS.exists(), reason="prometheus not fetched (make data; amd64 only)"
    ),
]
METRIC = re.compile(r"\b((?:edged|nv)_[a-z0-9_]+)\b")


def queries(dashboard: str) -> list[tuple[str, str]]:
    doc = json.loads((DASHBOARDS / dashboard).read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p["targets"]]


class Prometheus:
    def __init__(self, folder: Path, targets: dict[str, tuple[str, dict[str, list[str]]]]):
        self.port = free_port()
        jobs = [
            {
                "job_name": job,
                "scrape_interval": "1s",
                "static_configs": [{"targets": [address]}],
                **({"params": params} if params else {}),
            }
            for job, (address, params) in targets.items()
        ]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": jobs,
        }
        (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_port(self.port, 30)
        deadline = time.monotonic() + 30
        while True:  # the port opens before the TSDB and rules are loaded (503 until then)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())

    def query(self, expr: str) -> list:
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def exists(self, metric: str, job: str, offset: str = "") -> bool:
        """The metric has a sample now, or `offset` ago (an instant query: a gauge a scrape
        stopped carrying, such as the fleet's outliers of a window without any, is stale and
        absent)."""
        at = f" offset {offset}" if offset else ""
        return bool(self.query(f'count({{__name__="{metric}", job=~"{job}"}}{at})'))

    def known(self, metric: str) -> bool:
        """The metric was scraped at some point (the rules' check: they read real metrics)."""
        return bool(self.api("series", **{"match[]": f'{{__name__="{metric}"}}'})["data"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture
def broker(tmp_path: Path):
    with Broker(tmp_path / "broker") as b:
        yield b


def load(daemon: Daemon, stop: threading.Event) -> None:
    """About 20 requests a second, and a bad one now and then (400s for the error panel)."""
    import http.client

    x = cls_input()
    good = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    )
    bad = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]})
    n = 0
    while not stop.is_set():
        conn = http.client.HTTPConnection(daemon.address, timeout=10)
        conn.request("POST", "/v2/models/cls/infer", bad if n % 10 == 9 else good)
        conn.getresponse().read()
        conn.close()
        n += 1
        stop.wait(0.05)


def test_every_panel_and_rule_against_a_real_prometheus(
    models_dir: Path, tmp_path: Path, broker: Broker
) -> None:
    rules = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert rules.returncode == 0, rules.stdout + rules.stderr
    telemetry = (
        f'\n[telemetry]\ninterval_s = 1\n[telemetry.mqtt]\nurl = "{broker.url}"\n'
        f'device_id = "cam-1"\ngroup = "lab"\n'
    )
    daemon = Daemon(write_config(tmp_path, cls_table(models_dir) + telemetry)).wait_ready()
    fleet_port = free_port()
    fleet = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edged.cli.main",
            "fleet",
            "--broker",
            broker.url,
            "--prometheus",
            str(fleet_port),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "fleet.log").open("w"),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    stop = threading.Event()
    traffic = threading.Thread(target=load, args=(daemon, stop), daemon=True)
    traffic.start()
    prometheus = None
    try:
        wait_port(fleet_port, 30)
        prometheus = Prometheus(
            tmp_path,
            {
                "edged": (daemon.address, {}),
                "edged-triton": (daemon.address, {"names": ["triton"]}),
                "edged-fleet": (f"127.0.0.1:{fleet_port}", {}),
            },
        )
        # Every job up, the fleet seeing the device, and enough samples for the rates.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            up = prometheus.query("up")
            device = prometheus.query('edged_fleet_window_requests{device="cam-1"} > 0')
            if len(up) == 3 and all(r["value"][1] == "1" for r in up) and device:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(
                f"not scraped: {up}; fleet log: {(tmp_path / 'fleet.log').read_text()}"
            )
        time.sleep(6)

        checked = skipped = 0
        cases = [("edged-device.json", "edged"), ("edged-device.json", "edged-triton")]
        cases.append(("edged-fleet.json", "edged-fleet"))
        for dashboard, job in cases:
            for title, expr in queries(dashboard):
                concrete = (
                    expr.replace("$__rate_interval", "10s")
                    .replace("$job", job)
                    .replace("$model", ".*")
                    .replace("$group", ".*")
                    .replace("$device", ".*")
                )
                assert "$" not in concrete, (title, concrete)
                names = set(METRIC.findall(expr))
                # There 3 s ago as well (three scrapes): a rate over a series that appeared
                # since (an outlier cause seen for the first time) has no two samples yet.
                before = {
                    name
                    for name in names
                    if prometheus.exists(name, job) and prometheus.exists(name, job, "3s")
                }
                result = prometheus.query(concrete)  # fails on any query error
                # Data is owed when a metric it reads was there before and after the query
                # (a series may come or go between scrapes).
                if before & {name for name in names if prometheus.exists(name, job)}:
                    assert result, f"{dashboard} [{job}] {title!r}: no data from {concrete}"
                    checked += 1
                else:
                    skipped += 1  # e.g. temperatures on a machine with no thermal zone
        print(f"dashboards: {checked} queries checked, {skipped} with no metric here")
        assert checked >= 30, (checked, skipped)

        # The rules: evaluated by Prometheus without error, and reading real metrics.
        groups = prometheus.api("rules")["data"]["groups"]
        evaluated = [r for g in groups for r in g["rules"]]
        assert len(evaluated) == 11
        for rule in evaluated:
            assert rule["health"] != "err", (rule["name"], rule.get("lastError"))
            prometheus.query(rule["query"])
            names = set(METRIC.findall(rule["query"]))
            missing = [n for n in names if not prometheus.known(n)]
            optional = (
                {"edged_thermal_throttling"} if rule["name"] == "EdgedThermalThrottling" else set()
            )
            assert not set(missing) - optional, (rule["name"], missing)
    finally:
        stop.set()
        traffic.join(10)
        if prometheus is not None:
            prometheus.stop()
        fleet.send_signal(signal.SIGINT)
        fleet.wait(30)
        assert daemon.stop() == 0, daemon.log_text()
