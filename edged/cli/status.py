"""`edgectl status`: ask the running daemon (its Unix socket, then TCP) for its models,
backends, queues, latency and threads."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from edged.cli.common import EXIT_FAILED, EXIT_OK, check_address, or_dash

ORDER = 30  # place in `edgectl --help`


def register(sub) -> None:
    status = sub.add_parser(
        "status", help="ask the running daemon: models, backends, queues, latency, threads"
    )
    status.add_argument(
        "--address",
        default=None,
        help="unix:/run/edged/edged.sock (default, then http://127.0.0.1:8000) or HOST:PORT",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--watch",
        nargs="?",
        type=_positive,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="live view, redrawn every SECONDS (default 2): per model rate, p50/p99, queue, "
        "outliers by cause, temperature and a latency histogram (Ctrl-C stops)",
    )
    status.add_argument(
        "--count", type=int, default=None, metavar="N", help="with --watch: stop after N views"
    )
    status.set_defaults(func=cmd_status)


def _positive(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be from 0.1 to 3600 seconds, got {text}")
    return value


def cmd_status(args) -> int:
    if args.address:
        check_address(args.address)
    from edged.client import Client, EdgedError  # imports numpy: after the usage checks

    addresses = [args.address] if args.address else ["unix:/run/edged/edged.sock", "127.0.0.1:8000"]
    errors = []
    for address in addresses:
        if args.watch is not None:
            try:
                with Client(address, timeout=10) as client:
                    from edged.cli.status_watch import watch

                    watch(client, address, args.watch, args.count, args.json)
                return EXIT_OK
            except KeyboardInterrupt:
                return EXIT_OK
            except (OSError, EdgedError) as exc:
                errors.append(f"{address}: {exc}")
                continue
        try:
            with Client(address, timeout=10) as client:
                status = client.status()
                metrics = client.get_text("/metrics?names=edged")  # whatever metrics_names says
        except (OSError, EdgedError) as exc:
            errors.append(f"{address}: {exc}")
            continue
        status["address"] = address
        status["latency_ms"] = latency_from_metrics(metrics)
        print(json.dumps(status, indent=2) if args.json else format_status(status))
        return EXIT_OK
    print(f"edgectl: error: no edged answers ({'; '.join(errors)})", file=sys.stderr)
    return EXIT_FAILED


def latency_from_metrics(text: str) -> dict[str, dict[str, float]]:
    """p50/p99 of total request time per model, estimated from the Prometheus histogram
    buckets (upper bound of the bucket the quantile falls in)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "edged_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("phase") == "total":
                buckets.setdefault(sample.labels["model"], []).append(
                    (float(sample.labels["le"]), sample.value)
                )
    result = {}
    for model, rows in buckets.items():
        rows.sort()
        total = rows[-1][1] if rows else 0
        if not total:
            continue
        result[model] = {"requests": total}
        for q in (0.5, 0.99):
            bound = next(le for le, count in rows if count >= q * total)
            result[model][f"p{int(q * 100)}_ms_le"] = bound * 1000  # s -> ms for people
    return result


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"edged {status['version']} (pid {status['pid']}) at {status['address']}, up "
        f"{status['uptime_s']} s, config {status['config']}, reloads {status['reloads']}"
    ]
    listening = status.get("listening") or {}
    for kind in ("http", "grpc"):
        if listening.get(kind):
            lines.append(f"  {kind} on {', '.join(listening[kind])}")
    if status.get("last_reload_error"):
        lines.append(f"  last reload: {status['last_reload_error']}")
    if status.get("restart_needed"):
        lines.append(
            f"  changed by a reload, takes a restart: {', '.join(status['restart_needed'])}"
        )
    lines.append(
        f"  {'model':14} {'backend':24} {'ran as':10} {'ready':6} {'queue':>5} "
        f"{'requests':>8} {'p50 ms<=':>9} {'p99 ms<=':>9} failovers"
    )
    for m in status["models"]:
        lat = status["latency_ms"].get(m["name"], {})
        backend = f"{m['backend']}:{m['device']}"
        lines.append(
            f"  {m['name']:14} {backend:24} {m['precision'] or '-':10} "
            f"{'yes' if m['ready'] else 'NO':6} {m['queue_depth']:>5} "
            f"{int(lat.get('requests', 0)):>8} {or_dash(lat.get('p50_ms_le'), '.3f'):>9} "
            f"{or_dash(lat.get('p99_ms_le'), '.3f'):>9} {m['failovers']}"
        )
    for m in status["models"]:  # what really runs it, fall-back and standby
        used = m.get("device_used")
        if used and used != m["device"]:
            lines.append(f"  {m['name']:14} runs on: {used}")
        if m.get("cooling"):  # [thermal] admission: a cheaper way to run it while it cools
            lines.append(f"  {m['name']:14} COOLING: serving on {m['cooling']}")
        admission = m.get("admission") or {}
        if admission.get("mode") not in (None, "open"):
            lines.append(f"  {m['name']:14} admission {admission['mode']}: {admission['reason']}")
        if m.get("degraded") and not m.get("cooling"):
            lines.append(
                f"  {m['name']:14} DEGRADED: serving on a fall-back; its pick {m['pick']} "
                + ("is being verified again" if m.get("recovering") else "is not serving")
                + (f" (last error: {m['last_error']})" if m.get("last_error") else "")
            )
        if m.get("standby"):
            lines.append(f"  {m['name']:14} standby: {m['standby']} (loaded, warm)")
        elif m.get("standby_note"):
            lines.append(f"  {m['name']:14} standby: {m['standby_note']}")
    for m in status["models"]:  # which file of the family is served, why, and the job
        if m.get("variants"):
            lines.append(
                f"  {m['name']:14} serves {Path(m['path']).name} (original "
                f"{Path(m['original']).name}, {len(m['variants'])} variant(s))"
            )
        if m.get("why"):
            lines.append(f"  {'':14} why: {m['why']}")
        job = m.get("variants_job")
        if job:
            peak = job.get("peak_rss_bytes")
            lines.append(
                f"  {'':14} variants job: {job['state']}"
                + (
                    f" {job['progress']}"
                    if job["state"] == "running" and job.get("progress")
                    else ""
                )
                + (f", {job['duration_s']} s" if job.get("duration_s") else "")
                + (f", peak {peak / 2**20:.0f} MiB" if peak else "")
                + (f": {job['error']}" if job.get("error") else "")
                + (f": {job['result']}" if job.get("result") else "")
            )
    for name, reason in status.get("failed", {}).items():
        lines.append(f"  {name:14} NOT LOADED: {reason}")
    if status.get("housekeeping_cpus"):
        lines.append(
            f"  housekeeping CPUs {status['housekeeping_cpus']}; memory locked: "
            f"{status.get('memory_locked')}"
        )
    lines.append(
        "  threads: "
        + ", ".join(
            f"{t['name']}[{t['tid']}]={t['cpus']}"
            + (f" {t['policy']}" if t.get("policy", "other") != "other" else "")
            for t in status.get("threads", [])
        )
    )
    return "\n".join(lines)
