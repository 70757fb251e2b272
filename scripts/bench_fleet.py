#!/usr/bin/env python3
"""Does `edgectl fleet` keep up with a fleet on one core? N simulated devices each publish
telemetry at R msg/s through a real mosquitto on loopback; the monitor runs in its own process
pinned to one CPU and is measured: messages received per second against published, lag
(receive time minus the payload's ts; both clocks are this machine's), CPU time, RSS, and the
cost of a redraw and of a Prometheus scrape with the whole fleet in it.

Processes: mosquitto (its own config: loopback, unlimited queue so a monitor that falls
behind shows up as lag rather than as broker drops, errors-only log), P publisher processes
(each one paho client, MQTT 5, QoS 1, publishing on behalf of its share of the devices, on
the devices' own topics), and the monitor: `Fleet` (edged.fleet.store) + `Monitor` +
`run_live` (edged.fleet.monitor), the code `edgectl fleet` runs, redrawing the full table
every second (to /dev/null: not a terminal, so every row is formatted), with thresholds that
some simulated devices breach (the alert lines go to a file) and `--prometheus` served and
scraped every 5 s by this script. The monitor is pinned with os.sched_setaffinity to one
CPU; mosquitto and the publishers to the others when there are any.

Payloads are shaped like the daemon's (docs/schema/telemetry.schema.json: one model with
total/queue/compute phases and outliers per cause, thermal zones with trips, cpufreq,
hottest, throttling, system), about 1.2 kB, each device's spread evenly over the second.
Counting window: from the first scheduled publish to the last; then the publishers stop and
the script waits for the monitor to drain. The monitor keeps every lag sample here (not the
last 10,000 as edgectl does), and sorts them at each redraw: a slightly heavier monitor than
the real one. Lag and publish-lateness percentiles follow edged.selection.bench's rule (linear
interpolation between ranks; this script used to take the sample at rank int(q * n)).

    .venv/bin/python scripts/bench_fleet.py [--devices N] [--seconds T] [--rate R]
                                            [--publishers P] [--cpu C] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import benchlib  # also: tests/support/broker.py (mosquitto's path, free ports)
import orjson

REPO = Path(__file__).resolve().parent.parent

MOSQUITTO_CONF = """\
listener {port} 127.0.0.1
allow_anonymous true
persistence false
max_queued_messages 0
log_dest file {log}
log_type error
log_type warning
{user}
"""


# -- payloads ---------------------------------------------------------------------------------


def _phase(p50: float, p99: float, p999: float, count: int) -> dict:
    return {
        "count": count,
        "p50_ms": p50,
        "p90_ms": round(p50 * 1.1, 3),
        "p99_ms": p99,
        "p999_ms": p999,
        "max_ms": round(p999 * 1.2, 3),
        "mean_ms": round(p50 * 1.05, 3),
        "stdev_ms": round((p99 - p50) / 3, 3),
        "jitter_ms": round(p99 - p50, 3),
    }


def make_payload(
    rng: random.Random, base_ms: float, temp_c: float, interval_s: float, seq: int
) -> dict:
    """One window of one device, keys as the daemon's TelemetryLoop.collect + envelope."""
    p50 = round(base_ms * rng.uniform(0.95, 1.05), 3)
    p99 = round(p50 * rng.uniform(1.2, 2.0), 3)
    p999 = round(p99 * rng.uniform(1.0, 1.8), 3)
    total = _phase(p50, p99, p999, 30)
    total["queue"] = _phase(0.02, 0.08, 0.2, 30)
    total["compute"] = _phase(round(p50 - 0.02, 3), round(p99 - 0.08, 3), round(p999 - 0.2, 3), 30)
    total["outlier_count"] = rng.randint(0, 3)
    total["outliers"] = {"irq": total["outlier_count"], "softirq:TIMER": rng.randint(0, 2)}
    total["backend"] = "openvino:CPU"
    total["queue_depth"] = 0
    temp = round(temp_c + rng.uniform(-0.5, 0.5), 1)
    zone = {
        "name": "thermal_zone0",
        "type": "cpu-thermal",
        "temp_c": temp,
        "state": "ok",
        "cooling_engaged": False,
        "policy": "step_wise",
        "trips": [{"type": "passive", "temp_c": 85.0, "cooled": True}],
    }
    return {
        "ts": time.time(),
        "seq": seq,
        "bdSeq": 1,
        "interval_s": interval_s,
        "models": {"detector": total},
        "thermal": {
            "zones": [zone],
            "cooling": [],
            "cpufreq": [
                {
                    "cpu": c,
                    "freq_hz": 1800000000,
                    "max_hz": 1800000000,
                    "scaling_max_hz": 1800000000,
                    "governor": "performance",
                    "capped": False,
                    "ratio": 1.0,
                }
                for c in range(2)
            ],
            "throttled": None,
            "sensors": {},
            "hottest": {"name": "cpu-thermal", "temp_c": temp},
            "thermally_capped_cpus": [],
            "throttling": False,
        },
        "system": {
            "cpu_percent": {"0": 31.5, "1": 88.0},
            "cpu_percent_mean": 59.75,
            "mem_total_bytes": 4024213504,
            "mem_available_bytes": 2811822080,
            "load_avg": [1.02, 0.97, 0.91],
            "rss_bytes": 96468992,
            "uptime_s": 86412.5,
        },
    }


# -- publisher role ---------------------------------------------------------------------------


def run_publisher(args: argparse.Namespace) -> int:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    mine = list(range(args.index, args.devices, args.publishers))
    rng = random.Random(args.index)
    period = 1.0 / args.rate
    devices = []
    for i in mine:
        # a spread of tails and temperatures, so sorting and thresholds have work to do
        devices.append(
            (
                i,
                f"edged/v1/line-{i % 10}/dev-{i:05}/telemetry",
                rng.uniform(1.0, 8.0),
                rng.uniform(45.0, 82.0),
            )
        )
    acked = 0
    lock = threading.Lock()

    def on_publish(_c, _u, _mid, _rc, _props) -> None:
        nonlocal acked
        with lock:
            acked += 1

    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"bench-pub-{args.index}",
        protocol=MQTTProtocolVersion.MQTTv5,
    )
    client.max_inflight_messages_set(2000)
    client.on_publish = on_publish
    client.connect("127.0.0.1", args.port)
    client.loop_start()
    published = 0
    size = 0
    behind = []  # how late each publish was against its schedule
    t0 = args.t0
    end = t0 + args.seconds
    k = 0
    while True:
        cycle = t0 + k * period
        if cycle >= end:
            break
        for i, topic, base, temp in devices:
            due = cycle + period * i / args.devices
            if due >= end:
                break
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            else:
                behind.append(-wait)
            data = orjson.dumps(make_payload(rng, base, temp, period, k + 1))
            size += len(data)
            client.publish(topic, data, qos=1)
            published += 1
        k += 1
    deadline = time.monotonic() + 30
    while acked < published and time.monotonic() < deadline:
        time.sleep(0.01)
    client.disconnect()
    client.loop_stop()
    usage = resource.getrusage(resource.RUSAGE_SELF)  # before the percentile imports numpy
    late_p99_s = benchlib.latency_stats(behind).p99_ms / 1e3 if behind else 0.0
    print(
        json.dumps(
            {
                "published": published,
                "acked": acked,
                "bytes_mean": size / max(1, published),
                "late_publishes": len(behind),
                "late_p99_s": late_p99_s,
                "cpu_s": usage.ru_utime + usage.ru_stime,
            }
        ),
        flush=True,
    )
    return 0


# -- monitor role -----------------------------------------------------------------------------


def run_monitor(args: argparse.Namespace) -> int:
    from edged.fleet.exporter import FleetCollector, serve_prometheus
    from edged.fleet.monitor import Monitor, parse_broker, run_live
    from edged.fleet.report import fleet_rows, format_table, summary
    from edged.fleet.store import Fleet
    from edged.fleet.thresholds import Thresholds

    os.sched_setaffinity(0, {args.cpu})
    fleet = Fleet()
    fleet.lag = collections.deque()  # keep every sample for the benchmark
    thresholds = Thresholds(max_p99_ms=14.0, max_temp_c=80.0)
    alerts = open(args.alerts, "w")  # noqa: SIM115 - open for the whole run
    monitor = Monitor(parse_broker(f"mqtt://127.0.0.1:{args.port}"), fleet, err=alerts)
    server = serve_prometheus(FleetCollector(fleet, thresholds, 3.0), args.prometheus)
    monitor.start()
    if not monitor.subscribed.wait(10):
        print(json.dumps({"error": "not subscribed"}), flush=True)
        return 1
    marks: dict[str, dict] = {}
    stop = threading.Event()

    def snapshot() -> dict:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "wall": time.monotonic(),
            "cpu": u.ru_utime + u.ru_stime,
            "telemetry": fleet.counts["telemetry"],
            "lag_n": len(fleet.lag),
        }

    def commands() -> None:
        for line in sys.stdin:
            word = line.strip()
            if word == "STOP":
                break
            marks[word] = snapshot()
            print(json.dumps({"mark": word, "telemetry": marks[word]["telemetry"]}), flush=True)
        stop.set()

    print(json.dumps({"ready": True}), flush=True)
    threading.Thread(target=commands, daemon=True).start()
    with open(os.devnull, "w") as null:
        run_live(monitor, fleet, thresholds, out=null, err=alerts, refresh_s=1.0, until=stop.is_set)
    # One more redraw and scrape-sized render with the whole fleet, timed on the pinned core.
    start = time.perf_counter()
    rows = fleet_rows(fleet, thresholds)
    table = format_table(rows, title=summary(rows, fleet))
    render_s = time.perf_counter() - start
    monitor.stop()
    server.shutdown()
    alerts.close()
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Fleet.handle alone (parse + store, no paho), on the same core, over fresh devices.
    rng = random.Random(7)
    samples = [
        (
            f"edged/v1/micro/dev-{i % 1000:05}/telemetry",
            orjson.dumps(make_payload(rng, 3.0, 60.0, 1.0, i)),
        )
        for i in range(20000)
    ]
    micro = Fleet()
    start = time.perf_counter()
    for topic, data in samples:
        micro.handle(topic, data)
    handle_us = (time.perf_counter() - start) / len(samples) * 1e6
    start_mark, end_mark = marks.get("START"), marks.get("END")
    lags = list(fleet.lag)
    window = lags[start_mark["lag_n"] : end_mark["lag_n"]] if start_mark and end_mark else lags
    result = {
        "telemetry_total": fleet.counts["telemetry"],
        "bad_payloads": fleet.bad,
        "devices_seen": len(rows),
        "table_lines": table.count("\n") + 1,
        "render_s": render_s,
        "handle_us": handle_us,
        "rss_bytes": rss_peak,  # peak, before the Fleet.handle micro-benchmark
        "lag_window": lag_figures(window),
        "lag_all": lag_figures(lags),
    }
    if start_mark and end_mark:
        wall = end_mark["wall"] - start_mark["wall"]
        received = end_mark["telemetry"] - start_mark["telemetry"]
        cpu = end_mark["cpu"] - start_mark["cpu"]
        result.update(
            window_s=wall,
            received_window=received,
            received_per_s=received / wall,
            cpu_s=cpu,
            cpu_fraction=cpu / wall,
            cpu_us_per_msg=cpu / received * 1e6 if received else None,
        )
    print(json.dumps(result), flush=True)
    return 0


def lag_figures(lags: list[float]) -> dict[str, float | None]:
    """Count, p50, p99, p99.9 and max of lag samples, in seconds (None without samples).
    Called after the RSS and CPU figures are taken: the percentile imports numpy."""
    if not lags:
        return {"n": 0, "p50_s": None, "p99_s": None, "p999_s": None, "max_s": None}
    stats = benchlib.latency_stats(lags)
    return {
        "n": len(lags),
        "p50_s": stats.p50_ms / 1e3,
        "p99_s": stats.p99_ms / 1e3,
        "p999_s": stats.p999_ms / 1e3,
        "max_s": max(lags),
    }


# -- the orchestra ----------------------------------------------------------------------------


def _child(role: str, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, *args],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _read_json(proc: subprocess.Popen[str], timeout: float) -> dict:
    result: list[dict] = []

    def read() -> None:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line:
            result.append(json.loads(line))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise RuntimeError(f"{proc.args[3]} said nothing in {timeout} s")
    return result[0]


def run(args: argparse.Namespace) -> dict:
    from tests.support.broker import MOSQUITTO, free_port, wait_port

    cpus = sorted(os.sched_getaffinity(0))
    monitor_cpu = args.cpu if args.cpu is not None else cpus[-1]
    others = [c for c in cpus if c != monitor_cpu] or [monitor_cpu]
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    port, prom = free_port(), free_port()
    conf = tmp / "mosquitto.conf"
    conf.write_text(
        MOSQUITTO_CONF.format(
            port=port, log=tmp / "mosquitto.log", user="user root" if os.geteuid() == 0 else ""
        )
    )
    broker = subprocess.Popen(
        [MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    procs: list[subprocess.Popen] = [broker]
    try:
        wait_port(port)
        os.sched_setaffinity(broker.pid, set(others))
        load_before = os.getloadavg()
        mon = _child(
            "monitor",
            "--port",
            str(port),
            "--cpu",
            str(monitor_cpu),
            "--prometheus",
            str(prom),
            "--alerts",
            str(tmp / "alerts.txt"),
            stdin=True,
        )
        procs.append(mon)
        assert _read_json(mon, 30).get("ready"), "monitor not ready"
        t0 = time.time() + 1.0
        pubs = [
            _child(
                "publisher",
                "--port",
                str(port),
                "--devices",
                str(args.devices),
                "--rate",
                str(args.rate),
                "--seconds",
                str(args.seconds),
                "--publishers",
                str(args.publishers),
                "--index",
                str(i),
                "--t0",
                repr(t0),
                "--cpus",
                ",".join(map(str, others)),
            )
            for i in range(args.publishers)
        ]
        procs += pubs
        time.sleep(max(0.0, t0 - time.time()))
        mon.stdin.write("START\n")  # type: ignore[union-attr]
        mon.stdin.flush()  # type: ignore[union-attr]
        _read_json(mon, 10)
        scrapes = []
        while time.time() < t0 + args.seconds:
            time.sleep(min(5.0, max(0.0, t0 + args.seconds - time.time())))
            if time.time() >= t0 + args.seconds:
                break
            start = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=10) as r:
                body = r.read()
            scrapes.append((time.perf_counter() - start, len(body)))
        mon.stdin.write("END\n")  # type: ignore[union-attr]
        mon.stdin.flush()  # type: ignore[union-attr]
        _read_json(mon, 10)
        published = [_read_json(p, args.seconds + 60) for p in pubs]
        total_published = sum(p["published"] for p in published)
        # drain: until the monitor has every message, or 30 s
        drain_start = time.monotonic()
        drained = None
        while time.monotonic() - drain_start < 30:
            mon.stdin.write("DRAIN\n")  # type: ignore[union-attr]
            mon.stdin.flush()  # type: ignore[union-attr]
            if _read_json(mon, 10)["telemetry"] >= total_published:
                drained = time.monotonic() - drain_start
                break
            time.sleep(0.1)
        mon.stdin.write("STOP\n")  # type: ignore[union-attr]
        mon.stdin.flush()  # type: ignore[union-attr]
        monitor = _read_json(mon, 30)
        alerts = (tmp / "alerts.txt").read_text().count(" ALERT ")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    return {
        "devices": args.devices,
        "rate_per_device": args.rate,
        "seconds": args.seconds,
        "publishers": args.publishers,
        "monitor_cpu": monitor_cpu,
        "other_cpus": others,
        "payload_bytes_mean": round(sum(p["bytes_mean"] for p in published) / len(published)),
        "published": total_published,
        "acked": sum(p["acked"] for p in published),
        "published_per_s": total_published / args.seconds,
        "publisher_late_p99_s": max(p["late_p99_s"] for p in published),
        "publisher_cpu_s": sum(p["cpu_s"] for p in published),
        "received_total": monitor["telemetry_total"],
        "lost": total_published - monitor["telemetry_total"],
        "drain_s": drained,
        "prometheus_scrape_s": max((s for s, _ in scrapes), default=None),
        "prometheus_bytes": max((b for _, b in scrapes), default=None),
        "alerts": alerts,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "monitor": monitor,
    }


def report(r: dict) -> str:
    m = r["monitor"]
    lag = m["lag_window"]
    ok = (
        r["lost"] == 0
        and m["received_per_s"] >= 0.99 * r["published_per_s"]
        and lag["p99_s"] is not None
        and lag["p99_s"] < 1.0
        and m["cpu_fraction"] < 1.0
    )
    rows = [
        (
            "devices × rate",
            f"{r['devices']} × {r['rate_per_device']:g} msg/s, "
            f"{r['seconds']} s, payload {r['payload_bytes_mean']} B",
        ),
        (
            "published / s",
            f"{r['published_per_s']:.1f} ({r['published']} total, {r['acked']} acked)",
        ),
        ("received / s (window)", f"{m['received_per_s']:.1f}"),
        (
            "received total / lost",
            f"{r['received_total']} / {r['lost']} "
            f"(drained {r['drain_s'] or 0:.2f} s after the last)",
        ),
        (
            "lag p50 / p99 / p99.9 / max (ms)",
            " / ".join(
                "-" if lag[k] is None else f"{lag[k] * 1e3:.1f}"
                for k in ("p50_s", "p99_s", "p999_s", "max_s")
            ),
        ),
        (
            "monitor CPU (one core)",
            f"{m['cpu_fraction'] * 100:.1f} % ({m['cpu_us_per_msg']:.0f} µs a message, all in)",
        ),
        ("Fleet.handle alone", f"{m['handle_us']:.0f} µs a message (parse + store)"),
        ("monitor peak RSS", f"{m['rss_bytes'] / 2**20:.0f} MiB"),
        (
            "redraw of the full table",
            f"{m['render_s'] * 1e3:.1f} ms for {m['devices_seen']} devices",
        ),
        (
            "Prometheus scrape",
            "-"
            if r["prometheus_scrape_s"] is None
            else (
                f"{r['prometheus_scrape_s'] * 1e3:.0f} ms max, {r['prometheus_bytes'] / 1e3:.0f} kB"
            ),
        ),
        ("bad payloads / alerts", f"{m['bad_payloads']} / {r['alerts']}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"keeps up on one core: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1.0, help="msg/s per device")
    parser.add_argument("--publishers", type=int, default=2, help="publisher processes")
    parser.add_argument(
        "--cpu", type=int, default=None, help="the monitor's CPU (default: the last one allowed)"
    )
    parser.add_argument("--json", action="store_true")
    # internal: the child processes
    parser.add_argument("--role", choices=("monitor", "publisher"), help=argparse.SUPPRESS)
    for name in ("--port", "--prometheus", "--index"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--alerts", "--cpus"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "monitor":
        return run_monitor(args)
    if args.role == "publisher":
        return run_publisher(args)
    result = {**benchlib.report_header("fleet"), **run(args)}
    if args.json:
        benchlib.write_json(result)
    else:
        print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
