"""Which requests are traced, and where a finished trace goes.

Sampling as Triton's: with a scope's level not OFF, one request in every `rate` is traced
while `count` lasts (-1: always); a request carrying a valid `traceparent` is always traced
(its caller asked for it), and not counted against the rate. A model's own settings
(the API's per-model scope) override the global ones key by key; clearing a key falls back
to the global value. With tracing off and no traceparent, `start` is one attribute read."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from edged.tracing import otel
from edged.tracing.context import parse_traceparent
from edged.tracing.record import Trace
from edged.tracing.settings import TraceConfig, TraceSetting, updated
from edged.tracing.trace_file import TraceFile

log = logging.getLogger("edged.tracing")


class Sink(Protocol):
    def add(self, trace: Trace, log_frequency: int, last: bool) -> None: ...

    def close(self) -> None: ...


class Tracer:
    def __init__(
        self,
        config: TraceConfig,
        state_dir: Path,
        device_id: str | None = None,
        group: str = "default",
        resource: Mapping[str, str] | None = None,
    ):
        self.device_id, self.group = device_id, group  # [telemetry.mqtt]'s, for the spans
        self.mode = config.mode
        self.file = config.file or state_dir / "trace.json"
        self._global = config.setting
        self._own: dict[str, dict[str, Any]] = {}  # model -> its own raw changes
        self._models: dict[str, TraceSetting] = {}  # model -> its effective settings
        self._seen: dict[str | None, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._sink: Sink | None = None
        self._sink_tried = False
        self._resource = {"service.name": "edged", **(resource or {}), **dict(config.resource)}
        self._url = config.url
        self._refresh()

    # -- settings (the trace extension) ------------------------------------------------------
    def setting(self, model: str | None = None) -> TraceSetting:
        return self._models.get(model, self._global) if model else self._global

    def response(self, model: str | None = None) -> dict[str, Any]:
        return self.setting(model).response(self.mode, self.file if self.mode == "triton" else None)

    def update(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the API's changes (TraceSettingError says what is wrong; nothing changes
        then) and answer the scope's settings."""
        with self._lock:
            if not model:
                self._global = updated(self._global, changes, self._global)
                for name, own in self._own.items():  # models follow the global where unset
                    self._models[name] = updated(self._global, own, self._global)
            else:
                own = dict(self._own.get(model, {}))
                for key, value in changes.items():
                    if value is None:
                        own.pop(key, None)  # cleared: the global value again
                    else:
                        own[key] = value
                self._models[model] = updated(self._global, own, self._global)  # checks all
                self._own[model] = own
                if not own:
                    del self._own[model]
                    del self._models[model]
            self._refresh()
        return self.response(model)

    def _refresh(self) -> None:
        self.any_on = self._global.on or any(s.on for s in self._models.values())

    # -- requests ---------------------------------------------------------------------------
    def start(self, model: str, transport: str, traceparent: Any = None) -> Trace | None:
        """A new trace for this request, or None when it is not sampled."""
        if not self.any_on:
            return None
        parent = parse_traceparent(traceparent) if traceparent else None
        with self._lock:
            scope = model if model in self._models else None
            setting = self._models[model] if scope else self._global
            if not setting.on:
                return None
            if parent is None:
                seen = self._seen.get(scope, 0) + 1
                self._seen[scope] = seen
                if seen % setting.rate:
                    return None
            if setting.count > 0:
                self._set(
                    scope,
                    TraceSetting(
                        setting.level, setting.rate, setting.count - 1, setting.log_frequency
                    ),
                )
            trace_id = next(self._ids)
        return Trace(trace_id, model, transport, parent, tensors_on="TENSORS" in setting.level)

    def _set(self, scope: str | None, setting: TraceSetting) -> None:
        if scope is None:
            self._global = setting
        else:
            self._models[scope] = setting
        self._refresh()

    def finish(self, trace: Trace) -> None:
        sink = self._sink if self._sink_tried else self._open_sink()
        if sink is None:
            return
        setting = self.setting(trace.model)
        try:
            sink.add(trace, setting.log_frequency, last=setting.count == 0)
        except Exception as exc:  # a trace is never worth a request or the daemon
            log.warning("trace %d of %s not recorded: %s", trace.id, trace.model, exc)

    def _open_sink(self) -> Sink | None:
        with self._lock:
            if not self._sink_tried:
                self._sink_tried = True
                self._sink = self._make_sink()
        return self._sink

    def _make_sink(self) -> Sink | None:
        if self.mode == "triton":
            return TraceFile(self.file)
        if not otel.available():
            log.warning('[trace] mode = "opentelemetry" needs %s: no spans are sent', otel.NEEDS)
            return None
        try:
            return otel.OtelSink(self._url, {**self._device(), **self._resource})
        except Exception as exc:
            log.warning("OpenTelemetry exporter not started (%s): no spans are sent", exc)
            return None

    def _device(self) -> dict[str, str]:
        """The device as the fleet knows it: the telemetry's device id and group (its MQTT
        topic levels), so a span found in a collector leads to the device's telemetry."""
        from edged.telemetry.mqtt.session import device_id_from

        device = self.device_id or device_id_from()
        return {"service.instance.id": device, "edged.device_id": device, "edged.group": self.group}

    def close(self) -> None:
        with self._lock:
            sink, self._sink, self._sink_tried = self._sink, None, True
        if sink is not None:
            sink.close()


def device_of(mqtt: Any) -> tuple[str | None, str]:
    """(device id, group) of [telemetry.mqtt] (an MqttSettings, or None without a broker)."""
    return (mqtt.device_id, mqtt.group) if mqtt is not None else (None, "default")
