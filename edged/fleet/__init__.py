"""What `edgectl fleet` does with what devices publish: parse the payloads (`payloads`),
keep the latest per device (`store`), judge them against thresholds (`thresholds`), show
them live (`monitor`), report them (`report`) and export them to Prometheus (`exporter`).
Reads the MQTT topics edged/telemetry writes; never imports the daemon."""
