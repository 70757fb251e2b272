"""Latency, jitter and thermals, measured on the device and sent to the fleet: latency windows
with attributed outliers (`latency`, `attribution`, `batches`), the inference core's
counters (`sampler`), the loop that builds each payload (`loop`), the durable spool
(`spool`), the topic tree (`topics`), the MQTT publisher (`mqtt/`, its settings in
`settings`) and, from those settings, the daemon's publisher (`from_config`). Below config
and serving: it names what it reads of a served model rather than importing serving."""
