"""Request traces: Triton's trace extension (its settings, its timestamps and its JSON trace
file) and an OpenTelemetry mode that sends each sampled request as spans over OTLP/HTTP.

`settings` holds the [trace] table and the settings the API changes (global and per model),
`context` reads a caller's W3C `traceparent`, `record` is one request's trace, `tracer`
decides which requests are traced and hands finished ones on, `trace_file` writes Triton's
JSON file and `otel` the spans (the OpenTelemetry SDK is an optional extra, imported only
when that mode is on)."""
