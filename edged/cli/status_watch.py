"""`edgectl status --watch`: a live view for the person at the board. Every interval it
asks the daemon for its status and its /metrics, and shows what changed since the last
look: per model the request rate, p50 and p99 of that interval (from the latency
histogram's buckets: "<=" the bucket's bound), the queue, the latency outliers by cause,
the hottest temperature, and the interval's latency histogram drawn as bars.

On a terminal the view is redrawn in place; piped, each frame follows the last (a blank line
between). `--json`: one object per frame and line. `--count N` stops after N frames."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from edged.cli.common import or_dash

BAR = 40  # characters of the longest histogram bar


@dataclass
class Reading:
    at: float
    status: dict[str, Any]
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # cumulative
    outliers: dict[tuple[str, str], float] = field(default_factory=dict)
    temps: dict[str, float] = field(default_factory=dict)


def read(client) -> Reading:
    from prometheus_client.parser import text_string_to_metric_families

    status = client.status()
    text = client.get_text("/metrics?names=edged")
    reading = Reading(time.monotonic(), status)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name == "edged_request_duration_seconds" and s.name.endswith("_bucket"):
                if s.labels.get("phase") == "total":
                    reading.buckets.setdefault(s.labels["model"], []).append(
                        (float(s.labels["le"]), s.value)
                    )
            elif family.name == "edged_latency_outliers" and s.name.endswith("_total"):
                reading.outliers[(s.labels["model"], s.labels["cause"])] = s.value
            elif family.name == "edged_temperature_celsius":
                reading.temps[s.labels.get("type") or s.labels["zone"]] = s.value
    for rows in reading.buckets.values():
        rows.sort()
    return reading


def quantile_le(rows: list[tuple[float, float]], q: float) -> float | None:
    """The bound of the bucket holding quantile `q` of cumulative `rows` (None: empty)."""
    total = rows[-1][1] if rows else 0
    if not total:
        return None
    return next(le for le, count in rows if count >= q * total)


def frame(before: Reading, now: Reading) -> dict[str, Any]:
    """What happened between two readings, per model."""
    seconds = max(now.at - before.at, 1e-9)
    models = []
    for m in now.status.get("models", []):
        name = m["name"]
        old = dict(before.buckets.get(name, []))
        rows = [(le, count - old.get(le, 0.0)) for le, count in now.buckets.get(name, [])]
        requests = rows[-1][1] if rows else 0.0
        p50, p99 = quantile_le(rows, 0.5), quantile_le(rows, 0.99)
        outliers = {
            cause: count - before.outliers.get((model, cause), 0.0)
            for (model, cause), count in now.outliers.items()
            if model == name and count > before.outliers.get((model, cause), 0.0)
        }
        previous = 0.0
        histogram = []
        for le, count in rows:  # cumulative -> per bucket
            histogram.append({"le_ms": le * 1e3, "count": int(count - previous)})
            previous = count
        models.append(
            {
                "model": name,
                "backend": f"{m['backend']}:{m['device']}",
                "degraded": m.get("degraded", False),
                "rate_per_s": round(requests / seconds, 2),
                "requests": int(requests),
                "p50_ms_le": p50 * 1e3 if p50 is not None else None,
                "p99_ms_le": p99 * 1e3 if p99 is not None else None,
                "queue_depth": m.get("queue_depth", 0),
                "outliers": {k: int(v) for k, v in sorted(outliers.items())},
                "histogram": histogram,
            }
        )
    hottest = max(now.temps.items(), key=lambda kv: kv[1], default=None)
    return {
        "interval_s": round(seconds, 3),
        "models": models,
        "hottest": {"zone": hottest[0], "celsius": hottest[1]} if hottest else None,
    }


def render(view: dict[str, Any], address: str) -> str:
    hottest = view["hottest"]
    heat = f"{hottest['zone']} {hottest['celsius']:.1f} °C" if hottest else "no thermal zone"
    lines = [
        f"edged at {address}: last {view['interval_s']:.1f} s, hottest {heat}  "
        f"({time.strftime('%H:%M:%S')}, Ctrl-C to stop)",
        f"  {'model':14} {'backend':24} {'req/s':>8} {'p50 ms<=':>9} {'p99 ms<=':>9} "
        f"{'queue':>5}  outliers",
    ]
    for m in view["models"]:
        causes = ", ".join(f"{c} {n}" for c, n in m["outliers"].items()) or "-"
        flag = " DEGRADED" if m["degraded"] else ""
        lines.append(
            f"  {m['model']:14} {m['backend'] + flag:24} {m['rate_per_s']:>8.1f} "
            f"{or_dash(m['p50_ms_le'], '.3f'):>9} {or_dash(m['p99_ms_le'], '.3f'):>9} "
            f"{m['queue_depth']:>5}  {causes}"
        )
    for m in view["models"]:
        rows = m["histogram"]
        used = [i for i, r in enumerate(rows) if r["count"]]
        if not used:
            continue
        lines.append(f"  {m['model']}: latency in the last {view['interval_s']:.1f} s")
        top = max(r["count"] for r in rows)
        for r in rows[used[0] : used[-1] + 1]:
            bound = "+Inf" if r["le_ms"] == float("inf") else f"{r['le_ms']:g}"
            bar = "#" * max(1 if r["count"] else 0, round(BAR * r["count"] / top))
            lines.append(f"    <= {bound:>7} ms |{bar:<{BAR}} {r['count']}")
    return "\n".join(lines)


def watch(client, address: str, interval_s: float, count: int | None, as_json: bool) -> None:
    """Frames until `count` (None: until Ctrl-C)."""
    tty = sys.stdout.isatty() and not as_json
    before = read(client)
    shown = 0
    while count is None or shown < count:
        time.sleep(interval_s)
        now = read(client)
        view = frame(before, now)
        before = now
        if as_json:
            print(json.dumps(view), flush=True)
        elif tty:
            print("\x1b[H\x1b[2J" + render(view, address), flush=True)
        else:
            print(("\n" if shown else "") + render(view, address), flush=True)
        shown += 1
