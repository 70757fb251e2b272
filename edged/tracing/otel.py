"""The OpenTelemetry mode: each finished trace as spans, sent over OTLP/HTTP by the SDK's
batch span processor (its own thread; the request never waits for the collector).

The spans, as Triton's (a top-level span, a model span, a compute span), with edged's steps
beside compute:

    InferRequest                 receive to sent (the caller's traceparent is its parent)
      <model>                    REQUEST_START to REQUEST_END
        decode                   REQUEST_START to QUEUE_START (decode, pictures, shapes)
        queue                    QUEUE_START to COMPUTE_START
        compute                  the batch it ran in; batch size, backend, device,
                                 precision and variant as attributes
        encode                   COMPUTE_END to REQUEST_END

Every Triton timestamp is also an event on the top span. The SDK is the optional extra
`edged[otel]`; `available()` says whether it is installed, and nothing here is imported
before the mode is on."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

from edged.tracing.record import Trace

log = logging.getLogger("edged.tracing")

NEEDS = "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http (pip install 'edged[otel]')"


def available() -> bool:
    return all(
        importlib.util.find_spec(name) is not None
        for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    )


class OtelSink:
    def __init__(self, url: str, resource: Mapping[str, str]):
        from opentelemetry import trace as api
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        # ALWAYS_ON: edged samples (rate, count, traceparent) before a trace exists; the
        # SDK's default would drop a request whose caller did not sample its own span.
        self._provider = TracerProvider(resource=Resource.create(dict(resource)), sampler=ALWAYS_ON)
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=5))
        )
        self._tracer = self._provider.get_tracer("edged")
        self._api = api

    def add(self, trace: Trace, log_frequency: int = 0, last: bool = False) -> None:
        api = self._api
        parent_ctx = None
        if trace.parent is not None:
            remote = api.SpanContext(
                trace_id=int(trace.parent.trace_id, 16),
                span_id=int(trace.parent.span_id, 16),
                is_remote=True,
                trace_flags=api.TraceFlags(trace.parent.flags),
            )
            parent_ctx = api.set_span_in_context(api.NonRecordingSpan(remote))
        times = dict(trace.timestamps)
        first = trace.timestamps[0][1]
        last_at = trace.timestamps[-1][1]
        wall = trace.wall_ns
        common: dict[str, Any] = {"model_name": trace.model, "model_version": trace.model_version}
        if trace.request_id:
            common["request_id"] = trace.request_id
        top = self._tracer.start_span(
            "InferRequest",
            context=parent_ctx,
            kind=api.SpanKind.SERVER,
            start_time=wall(first),
            attributes={**common, "edged.transport": trace.transport, "edged.status": trace.status},
        )
        for name, at in trace.timestamps:
            top.add_event(name, timestamp=wall(at))
        if trace.status != 200:
            top.set_status(api.Status(api.StatusCode.ERROR, f"status {trace.status}"))
        in_top = api.set_span_in_context(top)
        begin = times.get("REQUEST_START", first)
        end = times.get("REQUEST_END", last_at)
        model = self._tracer.start_span(
            trace.model, context=in_top, start_time=wall(begin), attributes=common
        )
        in_model = api.set_span_in_context(model)
        steps = [
            ("decode", "REQUEST_START", "QUEUE_START", {}),
            ("queue", "QUEUE_START", "COMPUTE_START", {}),
            ("compute", "COMPUTE_START", "COMPUTE_END", trace.attributes),
            ("encode", "COMPUTE_END", "REQUEST_END", {}),
        ]
        for name, start_name, end_name, attributes in steps:
            if start_name in times and end_name in times:
                span = self._tracer.start_span(
                    name,
                    context=in_model,
                    start_time=wall(times[start_name]),
                    attributes=attributes,
                )
                span.end(end_time=wall(times[end_name]))
        model.end(end_time=wall(end))
        top.end(end_time=wall(last_at))

    def close(self) -> None:
        try:
            self._provider.shutdown()  # sends what is batched (bounded by the export timeout)
        except Exception as exc:  # a collector gone at shutdown loses spans, not the daemon
            log.warning("traces not all sent at shutdown: %s", exc)
