"""The MQTT topic tree: `edged/v1/<group>/<device>/<kind>` (payload schemas in docs/schema/).

The daemon's publisher (edged/telemetry/mqtt) writes these topics and `edgectl fleet`
(edged/fleet/) subscribes to them; both take the names from here so they cannot drift apart.
Also `json_type`, how both name a JSON value's type in error messages. Standard library only:
the fleet monitor and edgectl import it without loading paho or the publisher.
"""

from __future__ import annotations

from typing import Any

TOPIC_ROOT = "edged/v1"
KINDS = ("state", "telemetry", "event", "audit")  # what a device publishes under its base
COMMAND_PREFIX = "cmd/"  # under a device's base: the commands it subscribes to (`cmd/#`)
BAD_LEVEL = frozenset("/+#\0")  # a level holding one of these would change the topic's shape
# root levels + group + device + kind: what split_topic accepts
_TOPIC_LEVELS = TOPIC_ROOT.count("/") + 1 + 3


def is_level(value: object) -> bool:
    """A group or device name usable as one topic level: a non-empty string without '/',
    the wildcards '+' and '#', or NUL."""
    return isinstance(value, str) and bool(value) and not BAD_LEVEL & set(value)


def device_base(group: str, device: str) -> str:
    """`edged/v1/<group>/<device>/`: the prefix of every topic of one device. Wildcards are
    welcome here for subscriptions (`device_base("+", "+")`)."""
    return f"{TOPIC_ROOT}/{group}/{device}/"


def device_topic(group: str, device: str, kind: str) -> str:
    return f"{TOPIC_ROOT}/{group}/{device}/{kind}"


def split_topic(topic: str) -> tuple[str, str, str] | None:
    """(group, device, kind) of a device topic; None for a topic of any other shape. The
    root is not compared: a subscription under TOPIC_ROOT only delivers topics under it, and
    the fleet monitor calls this for every message."""
    parts = topic.split("/")
    if len(parts) != _TOPIC_LEVELS:
        return None
    return parts[-3], parts[-2], parts[-1]


def json_type(value: Any) -> str:
    """A JSON value's type as error messages name it ("an array", "null"): the daemon's
    command answers and the fleet's payload errors say it the same way."""
    return {
        list: "an array",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)
