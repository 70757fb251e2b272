"""What the table, the JSON and the alerts show: one row per device from a snapshot of the
store, with its state, its worst model's figures and the thresholds it breaches.

Staleness. A device whose telemetry stops for `stale_factor` (3) times its reported
`interval_s` (10 s, the daemon's default, when it has not reported one yet) is "stale",
counted from the last telemetry or, for a device not yet heard, from when the monitor
subscribed.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from edged.fleet.payloads import Device, Telemetry
from edged.fleet.thresholds import Thresholds

if TYPE_CHECKING:  # the store loads orjson; the rows need only its snapshot methods
    from edged.fleet.store import Fleet

DEFAULT_INTERVAL_S = 10.0  # the daemon's [telemetry] interval_s default
DEFAULT_STALE_FACTOR = 3.0


def device_row(
    d: Device,
    now: float,
    thresholds: Thresholds,
    *,
    started: float,
    stale_factor: float = DEFAULT_STALE_FACTOR,
) -> dict[str, Any]:
    """One device as a JSON object (the `--json` list holds these), breaches included."""
    t = d.telemetry
    interval = (t.interval_s if t is not None else None) or DEFAULT_INTERVAL_S
    heard = t.received if t is not None else started
    age = None if t is None else round(max(0.0, now - t.received), 3)
    silent = now - heard
    stale = stale_factor > 0 and silent > stale_factor * interval
    if d.state is not None and not d.state.online:
        state = "offline"
    elif stale and (d.state is not None or t is not None):
        state = "stale"
    elif d.state is not None or t is not None:
        state = "online"
    else:
        state = "unknown"  # only malformed messages so far
    worst = t.models[t.worst] if t is not None and t.worst is not None else None
    row: dict[str, Any] = {
        "group": d.group,
        "device": d.device,
        "state": state,
        "online": None if d.state is None and t is None else state in ("online", "stale"),
        "stale": stale and state == "stale",
        "bdSeq": d.state.bdseq if d.state is not None else (t.bdseq if t else None),
        "version": d.state.version if d.state is not None else None,
        "state_ts": d.state.ts if d.state is not None else None,
        "telemetry_ts": t.ts if t is not None else None,
        "seq": t.seq if t is not None else None,
        "age_s": age,
        "interval_s": t.interval_s if t is not None else None,
        "worst_model": t.worst if t is not None else None,
        "p50_ms": worst.p50_ms if worst else None,
        "p99_ms": worst.p99_ms if worst else None,
        "p999_ms": worst.p999_ms if worst else None,
        "jitter_ms": worst.jitter_ms if worst else None,
        "top_cause": (
            None
            if t is None or t.top_cause is None
            else {"cause": t.top_cause[0], "count": t.top_cause[1]}
        ),
        "hottest": (None if d.hottest is None else {"name": d.hottest[0], "temp_c": d.hottest[1]}),
        "throttling": d.throttling,
        "last_event": d.event,
        "models": {} if t is None else {n: m.to_json() for n, m in t.models.items()},
        "backends": d.state.backends if d.state is not None else {},
        "messages": d.messages,
        "bad_payloads": d.bad,
        "last_bad": d.last_bad,
    }
    row["breaches"] = breaches(row, t, thresholds, silent, interval)
    return row


def breaches(
    row: dict[str, Any], t: Telemetry | None, th: Thresholds, silent: float, interval: float
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not th.allow_offline:
        if row["state"] == "offline":
            out.append({"what": "offline", "text": "offline"})
        elif row["state"] == "stale":
            out.append(
                {
                    "what": "stale",
                    "text": f"stale: no telemetry for {silent:.0f} s (interval {interval:g} s)",
                }
            )
    if t is not None:
        for what, limit, attr, label in (
            ("p99", th.max_p99_ms, "p99_ms", "p99"),
            ("p999", th.max_p999_ms, "p999_ms", "p99.9"),
            ("jitter", th.max_jitter_ms, "jitter_ms", "jitter"),
        ):
            if limit is None:
                continue
            for name, m in sorted(t.models.items()):
                value = getattr(m, attr)
                if value is not None and value > limit:
                    out.append(
                        {
                            "what": what,
                            "model": name,
                            "value": value,
                            "limit": limit,
                            "text": f"{label} {value:g} ms > {limit:g} ms ({name})",
                        }
                    )
    hottest = row["hottest"]
    if th.max_temp_c is not None and hottest is not None and hottest["temp_c"] > th.max_temp_c:
        out.append(
            {
                "what": "temp",
                "zone": hottest["name"],
                "value": hottest["temp_c"],
                "limit": th.max_temp_c,
                "text": f"temp {hottest['temp_c']:g} °C > {th.max_temp_c:g} °C ({hottest['name']})",
            }
        )
    return out


def _sort_key(row: dict[str, Any]) -> tuple:
    p999, p99 = row["p999_ms"], row["p99_ms"]
    return (p999 is None, -(p999 or 0.0), p99 is None, -(p99 or 0.0), row["group"], row["device"])


def fleet_rows(
    fleet: Fleet, thresholds: Thresholds, *, stale_factor: float = DEFAULT_STALE_FACTOR
) -> list[dict[str, Any]]:
    """Every device, worst tail (p99.9, then p99) first; devices without figures last."""
    now = fleet.clock()
    rows = [
        device_row(d, now, thresholds, started=fleet.started, stale_factor=stale_factor)
        for d in fleet.devices()
    ]
    rows.sort(key=_sort_key)
    return rows


# -- the table --------------------------------------------------------------------------------

COLUMNS = (
    "",
    "DEVICE",
    "GROUP",
    "STATE",
    "MODEL",
    "P50",
    "P99",
    "P99.9",
    "JITTER",
    "TOP CAUSE",
    "HOTTEST",
    "THROTTLING",
    "AGE",
)
_RIGHT = frozenset({"P50", "P99", "P99.9", "JITTER", "AGE"})


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    cause = row["top_cause"]
    hottest = row["hottest"]
    throttling = row["throttling"]
    return (
        "!" if row["breaches"] else "",
        row["device"][:40],
        row["group"][:24],
        row["state"],
        (row["worst_model"] or "-")[:24],
        _ms(row["p50_ms"]),
        _ms(row["p99_ms"]),
        _ms(row["p999_ms"]),
        _ms(row["jitter_ms"]),
        "-" if cause is None else f"{cause['cause']} ({cause['count']})",
        "-" if hottest is None else f"{hottest['name']} {hottest['temp_c']:.1f}°C",
        "-" if throttling is None else ("yes" if throttling else "no"),
        "-" if row["age_s"] is None else f"{row['age_s']:.1f}s",
    )


def format_table(
    rows: list[dict[str, Any]],
    *,
    title: str = "",
    max_rows: int | None = None,
    footer: Iterable[str] = (),
) -> str:
    """The table, times in ms; `!` marks a row that breaches a threshold."""
    shown = rows if max_rows is None else rows[: max(0, max_rows)]
    cells = [_cells(r) for r in shown]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(COLUMNS)]
    lines = [title] if title else []

    def line(values: Sequence[str]) -> str:
        return " ".join(
            v.rjust(w) if COLUMNS[i] in _RIGHT else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    lines.append(line(COLUMNS))
    lines += [line(c) for c in cells]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more (smaller tails)")
    lines += list(footer)
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], fleet: Fleet) -> str:
    states = collections.Counter(r["state"] for r in rows)
    lag = fleet.lag_quantiles()
    lag_p50, lag_p99 = lag["p50_s"], lag["p99_s"]
    lag_text = (
        ""
        if lag_p50 is None or lag_p99 is None
        else f", lag p50 {lag_p50 * 1e3:.0f} ms p99 {lag_p99 * 1e3:.0f} ms"
    )
    parts = ", ".join(
        f"{states[s]} {s}" for s in ("online", "stale", "offline", "unknown") if states[s]
    )
    return (
        f"{len(rows)} devices ({parts or 'none'}), "
        f"{sum(1 for r in rows if r['breaches'])} breaching; "
        f"{sum(fleet.counts.values())} messages, {fleet.bad} malformed{lag_text}"
    )
