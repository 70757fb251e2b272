"""The fleet as Prometheus metrics (`edgectl fleet --prometheus PORT`), served by
prometheus_client's own HTTP server."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from edged.fleet.report import fleet_rows

if TYPE_CHECKING:
    from edged.fleet.store import Fleet
    from edged.fleet.thresholds import Thresholds

QUANTILES = (("0.5", "p50_ms"), ("0.99", "p99_ms"), ("0.999", "p999_ms"))


class FleetCollector:
    """A custom collector: the families are built from a snapshot at each scrape, so the
    message path never touches prometheus_client."""

    def __init__(self, fleet: Fleet, thresholds: Thresholds, stale_factor: float) -> None:
        self.fleet = fleet
        self.thresholds = thresholds
        self.stale_factor = stale_factor

    def describe(self) -> list:
        return []  # unchecked collector: families vary with the fleet

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fleet = self.fleet
        rows = fleet_rows(fleet, self.thresholds, stale_factor=self.stale_factor)
        gd = ["group", "device"]
        up = GaugeMetricFamily(
            "edged_fleet_device_up",
            "1 when the device is online and its telemetry is not stale, else 0",
            labels=gd,
        )
        latency = GaugeMetricFamily(
            "edged_fleet_latency_seconds",
            "Request latency (queue + compute) quantiles of the device's last telemetry window",
            labels=[*gd, "model", "quantile"],
        )
        jitter = GaugeMetricFamily(
            "edged_fleet_jitter_seconds",
            "p99 minus p50 of the device's last telemetry window",
            labels=[*gd, "model"],
        )
        requests = GaugeMetricFamily(
            "edged_fleet_window_requests",
            "Requests in the device's last telemetry window",
            labels=[*gd, "model"],
        )
        temp = GaugeMetricFamily(
            "edged_fleet_temperature_celsius",
            "The device's hottest thermal reading",
            labels=[*gd, "zone"],
        )
        throttling = GaugeMetricFamily(
            "edged_fleet_throttling",
            "1 while the device reports thermal or power throttling",
            labels=gd,
        )
        outliers = GaugeMetricFamily(
            "edged_fleet_outliers",
            "Outliers (requests above the previous window's p99) "
            "each cause touched, in the device's last telemetry window only: a per-window "
            "count that is replaced, not a running total",
            labels=[*gd, "model", "cause"],
        )
        seen = GaugeMetricFamily(
            "edged_fleet_last_telemetry_timestamp_seconds",
            "The device's ts of its newest telemetry (device clock)",
            labels=gd,
        )
        breaching = GaugeMetricFamily(
            "edged_fleet_breaching",
            "Thresholds the device breaches now (edgectl fleet's own)",
            labels=gd,
        )
        for r in rows:
            key = [r["group"], r["device"]]
            up.add_metric(key, 1.0 if r["state"] == "online" else 0.0)
            breaching.add_metric(key, float(len(r["breaches"])))
            if r["throttling"] is not None:
                throttling.add_metric(key, 1.0 if r["throttling"] else 0.0)
            if r["hottest"] is not None:
                temp.add_metric([*key, r["hottest"]["name"]], r["hottest"]["temp_c"])
            if r["telemetry_ts"] is not None:
                seen.add_metric(key, r["telemetry_ts"])
            for model, m in r["models"].items():
                # payloads carry milliseconds; Prometheus wants seconds, the base unit
                for q, attr in QUANTILES:
                    if m[attr] is not None:
                        latency.add_metric([*key, model, q], m[attr] / 1e3)
                if m["jitter_ms"] is not None:
                    jitter.add_metric([*key, model], m["jitter_ms"] / 1e3)
                requests.add_metric([*key, model], float(m["count"]))
                for cause, n in m["outliers"].items():
                    outliers.add_metric([*key, model, cause], float(n))
        devices = GaugeMetricFamily(
            "edged_fleet_devices", "Devices known, by state", labels=["state"]
        )
        states = collections.Counter(r["state"] for r in rows)
        for s in ("online", "stale", "offline", "unknown"):
            devices.add_metric([s], float(states[s]))
        messages = CounterMetricFamily(
            "edged_fleet_messages", "Messages received and parsed, by topic kind", labels=["kind"]
        )
        for kind, n in fleet.counts.items():
            messages.add_metric([kind], float(n))
        bad = CounterMetricFamily(
            "edged_fleet_bad_payloads", "Messages ignored: not JSON, or fields of the wrong type"
        )
        bad.add_metric([], float(fleet.bad))
        lag = GaugeMetricFamily(
            "edged_fleet_telemetry_lag_seconds",
            "Receive time minus "
            "the payload's ts over the recent live telemetry (includes "
            "device clock offset)",
            labels=["quantile"],
        )
        lq = fleet.lag_quantiles()
        for q, k in (("0.5", "p50_s"), ("0.99", "p99_s")):
            if lq[k] is not None:
                lag.add_metric([q], lq[k])
        yield from (
            up,
            latency,
            jitter,
            requests,
            temp,
            throttling,
            outliers,
            seen,
            breaching,
            devices,
            messages,
            bad,
            lag,
        )


DEFAULT_PROMETHEUS_ADDR = "127.0.0.1"  # loopback: the fleet's figures are not for everyone


def serve_prometheus(collector: FleetCollector, port: int, addr: str = DEFAULT_PROMETHEUS_ADDR):
    """prometheus_client's own HTTP server on addr:port; returns the server."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
