"""Telemetry to the fleet over MQTT, with a durable store-and-forward spool behind it.

Topics, under `edged/v1/<group>/<device>/` (schemas in docs/schema/):

- `state`, retained, QoS 1: the birth `{"online": true, "ts", "seq", "bdSeq", "version",
  "hardware", "models"}` on every (re)connect and on `cmd/rebirth`; the Last Will, registered
  with each CONNECT, is the same topic retained `{"online": false, "ts", "seq", "bdSeq"}`, and
  a clean stop publishes that itself (a clean DISCONNECT suppresses the Will).
- `telemetry`, QoS 1 with an MQTT 5 message expiry; `event`, QoS 1. Both go through the spool.
- `audit`, retained, QoS 1: the latest audit summary.
- `cmd/rebirth`, `cmd/audit` (and `cmd/#`, so unknown commands get an answer): JSON objects.

Sequence numbers. `bdSeq` counts connections: it is in the Will registered with a CONNECT and
in the birth that follows it, so a dashboard can tell which death belongs to which birth; it is
kept in `<state_dir>/mqtt-bdseq` so it keeps counting across restarts. `seq` of telemetry and
event is the spool id: one sequence shared by both topics, persistent, gap-free, so a gap in
the merged telemetry+event stream is a loss (the `spool_dropped` event says how many; its
own seq follows the survivors). `seq` of audit only increases while the daemon runs. `seq`
of state is `bdSeq * STATE_SEQ_SPAN + n` for the n-th birth of a connection, and its Will
(and the offline state of a clean stop) carries `(bdSeq + 1) * STATE_SEQ_SPAN - 1`: above every
birth of its own connection, below the next connection's first birth, across restarts too
(bdSeq persists). So ordering state messages by seq puts a death after the birth it ends.
The Will's `ts` is when it was registered (at CONNECT): MQTT gives the broker no way to
stamp it at the death, so the offline time is when the broker publishes it.

Store-and-forward. `publish_telemetry` and `publish_event` commit the payload to the spool
(fsync'd) in the caller's thread and return its seq; the MQTT thread sends it and deletes it
on PUBACK. The stored payload carries neither `seq` nor `historical`: both are spliced into
the JSON when the item is sent (`{"seq":N,"historical":true,...`). An item is `historical`
when it was created before the CONNACK of the connection that sends it: produced while the
broker was away, or sent before a connection was lost and sent again. Deciding at send time
(not at creation) is what makes "replayed" exact: the producer cannot know whether the link
will hold until the PUBACK. After each CONNACK every pending item is sent again in id order,
at most `window` (and the broker's Receive Maximum) unacknowledged at once. Replayed
telemetry keeps the full expiry: it counts from when the broker receives it, and the spool has
its own age bound. A PUBACK with a failure reason code (not authorised, topic invalid,
payload invalid) deletes the item too, since sending it again would fail again, and counts it
as `rejected`; only "quota exceeded" keeps it for the next connection.

Threads. paho's Client is not safe to drive from several threads, so one thread (started by
`start()`) owns it: it connects, publishes, reads and reconnects. Other threads only append to
the spool (which has its own lock), set a few fields under a lock, and wake the owner through a
socket pair. The owner runs paho's external-loop API (`loop_read`/`loop_write`/`loop_misc`
around its own select()) rather than `loop_forever`/`loop_start`: the latter own the thread
and the reconnect, and paho replays its in-memory in-flight messages after an automatic
reconnect, which would duplicate the spool replay. A new Client is made for each connection
(fresh message ids, the Will with the new bdSeq), with the reconnect delay paho would use
(`reconnect_delay_set(1, 30)`): doubling from 1 s to at most 30 s, reset by a CONNACK.

MQTT 5 is the default; a broker that answers "unsupported protocol version" gets MQTT 3.1.1
from the next attempt on (no message expiry there). TLS (`mqtts://`, a CA, optionally a client
certificate) and a username with the password read from a file at each connect; the password
is never logged and is in no repr.

With no broker configured, `LogPublisher` writes the same payloads as JSON lines to the
`edged.telemetry.loop` logger.

The modules, by job: `session` (the paho client, CONNECT with its Will, bdSeq, reconnecting),
`outbox` (what is spooled, sent and acknowledged), `commands` (`cmd/...`), `ratelimit` (the
per-kind token buckets commands pass), `publisher` (the
three in the MQTT thread, and `open_publisher`), `log_publisher`, `payloads` (the JSON).
The settings are `edged.config.MqttSettings`, checked when the config is loaded; the topic
names come from `edged.telemetry.topics`.
"""
