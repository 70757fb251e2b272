"""The device's own families on /metrics, beside the request metrics: temperatures and
throttling, latency outliers by cause, each model's standby and its files' trust verdicts,
and the telemetry spool's backlog, so one Prometheus scrape of a device feeds its dashboard
(docs/dashboards/).

Read at scrape time from what the daemon already holds (the telemetry loop's last thermal
reading and its outlier counts, the publisher's spool figures): a scrape never reads a slow
sensor on the event loop. Without telemetry, temperatures are read here (sysfs only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from edged.thermal.ladder import STEPS


class DeviceCollector:
    def __init__(
        self,
        models: Callable[[], Mapping[str, Any]],
        telemetry: Callable[[], Any],
        publisher: Callable[[], Any],
        thermal: Callable[[], Any] = lambda: None,
    ) -> None:
        self._models = models
        self._thermal = thermal  # edged.serving.thermal_admission.ThermalGovernor, or None
        self._telemetry = telemetry  # the TelemetryLoop, or None
        self._publisher = publisher  # the MQTT publisher, or None

    def _admission(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Thermal admission's headroom and each model's step, while it is on."""
        governor = self._thermal()
        if governor is None or governor.last is None:
            return
        headroom = GaugeMetricFamily(
            "edged_thermal_headroom",
            "How near a watched zone is to its first throttling trip (1.0: at it)",
            labels=["zone", "type"],
        )
        for zone in governor.last.zones:
            if zone.headroom is not None:
                headroom.add_metric([zone.zone, zone.type], zone.headroom)
        yield headroom
        step = GaugeMetricFamily(
            "edged_thermal_step",
            "A model's step on the thermal ladder: 0 normal, 1 cheaper, 2 limit, 3 shed",
            labels=["model"],
        )
        refused = CounterMetricFamily(
            "edged_thermal_refused",
            "Requests refused (503, Retry-After) while the device cools",
            labels=["model"],
        )
        for name, care in sorted(governor.cares.items()):
            step.add_metric([name], float(STEPS.index(care.ladder.name)))
            refused.add_metric([name], float(care.gate.refused))
        yield step
        yield refused

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loop = self._telemetry()
        thermal = loop.last_thermal if loop is not None else None
        if thermal is None:  # telemetry off: read now
            from sysconf import SysRoot
            from sysconf.thermal import read_thermal

            thermal = read_thermal(SysRoot()).to_dict()
        temps = GaugeMetricFamily(
            "edged_temperature_celsius", "Thermal zone temperature", labels=["zone", "type"]
        )
        for zone in thermal.get("zones") or ():
            if zone.get("temp_c") is not None:
                temps.add_metric([zone["name"], zone.get("type") or ""], zone["temp_c"])
        yield temps
        yield GaugeMetricFamily(
            "edged_thermal_throttling",
            "1 while the CPU is held below its maximum by heat",
            value=1.0 if thermal.get("throttling") else 0.0,
        )
        yield from _energy(loop)
        outliers = CounterMetricFamily(
            "edged_latency_outliers",
            "Latency outliers on the inference cores, by the cause telemetry attributed",
            labels=["model", "cause"],
        )
        for (model, cause), count in sorted((loop.outliers_total if loop else {}).items()):
            outliers.add_metric([model, cause], count)
        yield outliers
        standby = GaugeMetricFamily(
            "edged_model_standby", "1 while a warm standby backend is loaded", labels=["model"]
        )
        for name, served in sorted(self._models().items()):
            standby.add_metric([name], 1.0 if served.worker.standby is not None else 0.0)
        yield standby
        trust = GaugeMetricFamily(
            "edged_model_file_trust",
            "1 for each served model file, labelled with its [security] verdict",
            labels=["model", "file", "state"],
        )
        for name, served in sorted(self._models().items()):
            for verdict in served.trust:
                trust.add_metric([name, verdict["path"], verdict["state"]], 1.0)
        yield trust
        yield from self._admission()
        publisher = self._publisher()
        if publisher is not None and hasattr(publisher, "spool"):
            stats = publisher.stats()
            spool = stats.get("spool") or {}
            yield GaugeMetricFamily(
                "edged_telemetry_connected",
                "1 while the MQTT broker is connected",
                value=1.0 if stats.get("connected") else 0.0,
            )
            yield GaugeMetricFamily(
                "edged_telemetry_spool_messages",
                "Telemetry messages spooled, not yet acknowledged by the broker",
                value=float(spool.get("count") or 0),
            )
            yield GaugeMetricFamily(
                "edged_telemetry_spool_bytes",
                "Bytes of spooled telemetry",
                value=float(spool.get("bytes") or 0),
            )
            yield CounterMetricFamily(
                "edged_telemetry_spool_dropped",
                "Spooled messages dropped to keep the spool in its size or age",
                value=float(spool.get("dropped_total") or 0),
            )


def register_collectors(
    registry: Any, models: Callable[[], Mapping[str, Any]], daemon: Any
) -> None:
    """The scrape-time families of a running daemon: the inference cores' intrusions
    (edged.serving.metrics.IntrusionCollector) and the device's (DeviceCollector).
    `daemon()` gives the object holding `telemetry` and `publisher` (either may be None)."""
    from edged.serving.metrics import IntrusionCollector

    registry.register(
        IntrusionCollector(
            lambda: {cpu for m in models().values() for cpu in (m.worker.cpus or ())},
            lambda: {name: m.worker.native_id for name, m in models().items()},
        )
    )
    registry.register(
        DeviceCollector(
            models,
            lambda: daemon().telemetry,
            lambda: daemon().publisher,
            lambda: getattr(daemon(), "thermal", None),
        )
    )


def _energy(loop: Any) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """What the board's own meters measured (sysconf.energy, read by the telemetry loop):
    joules per domain, the last window's watts, and the joules attributed to each model's
    inferences (rate(...) over rate(nv_inference_count) is energy per inference)."""
    if loop is None or not loop.energy_domains:
        return
    joules = CounterMetricFamily(
        "edged_energy_joules", "Energy the board measured, per domain", labels=["domain", "source"]
    )
    watts = GaugeMetricFamily(
        "edged_power_watts",
        "Mean power over the last window, per domain",
        labels=["domain", "source"],
    )
    for domain in loop.energy_domains:
        joules.add_metric([domain.name, domain.source], domain.joules)
        if domain.watts is not None:
            watts.add_metric([domain.name, domain.source], domain.watts)
    yield joules
    yield watts
    by_model = CounterMetricFamily(
        "edged_inference_energy_joules",
        "The device's energy attributed to a model's inferences by its compute time",
        labels=["model"],
    )
    for name, value in sorted(loop.energy_by_model.items()):
        by_model.add_metric([name], value)
    yield by_model
