"""`edgectl fleet`: the command line around the fleet monitor (edged/fleet/), which watches the
devices' MQTT topics. This module holds what only the command needs: the flags, their checks,
the one-shot `--once` run with its exit code. The store, the MQTT client and the exporter
are imported by the handler, so `edgectl --help` does not load orjson, paho or
prometheus_client.

Exit codes: 0 collected and no device breaches (--once) or stopped with Ctrl-C (live); 1 a
breach (--once) or the broker (or the --prometheus port) could not be used; 2 bad flags, a bad
broker URL or thresholds file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

# Standard library only behind these: the store (orjson), paho and prometheus_client are
# loaded by the handler.
from edged.fleet.exporter import DEFAULT_PROMETHEUS_ADDR
from edged.fleet.report import DEFAULT_STALE_FACTOR
from edged.fleet.thresholds import FleetError, Thresholds, load_thresholds
from edged.telemetry.topics import is_level

if TYPE_CHECKING:
    from edged.fleet.monitor import Monitor
    from edged.fleet.store import Fleet

ORDER = 90
EXIT_OK, EXIT_BREACH, EXIT_BAD_INPUT = 0, 1, 2
EXIT_FAILED = 1
DEFAULT_WAIT_S = 3.0

SHARE_HELP = (
    "MQTT 5 shared subscription $share/NAME/edged/v1/...: monitors with the same "
    "NAME split the messages between them. Retained messages are not delivered on "
    "shared subscriptions (this monitor also drops any a broker sends), so a "
    "device's online/offline comes from the state messages published while this "
    "runs (telemetry marks a device online). The split is per message, not per "
    "device: with K monitors raise --stale-factor to about 3*K"
)


def register(sub) -> None:
    """Add `fleet` and its flags to an argparse subparsers object."""
    p = sub.add_parser(
        "fleet",
        help="live table of every device's latency tail, thermals and state (MQTT)",
        description="Watch edged devices over MQTT: p50/p99/p99.9, jitter, top outlier cause, "
        "hottest zone, throttling and liveness per device, worst tail first. "
        "With --once, exit 1 when any device breaches a threshold.",
    )
    p.add_argument(
        "--broker", required=True, metavar="URL", help="mqtt://HOST[:1883] or mqtts://HOST[:8883]"
    )
    p.add_argument("--group", default=None, help="only this device group (default: all)")
    p.add_argument(
        "--json",
        action="store_true",
        help="a JSON list of device objects (live: one list per line each refresh)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="collect for --wait seconds, print once, exit 1 on any breach",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="S",
        help="with --once: seconds to collect after subscribing (default 3; use "
        "more than the devices' telemetry interval, 10 s by default, to see "
        "every device's figures)",
    )
    p.add_argument(
        "--refresh",
        type=float,
        default=1.0,
        metavar="S",
        help="live mode: seconds between redraws (default 1)",
    )
    p.add_argument(
        "--prometheus",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the fleet as Prometheus metrics on PORT (of --prometheus-addr)",
    )
    p.add_argument(
        "--prometheus-addr",
        default=DEFAULT_PROMETHEUS_ADDR,
        metavar="ADDR",
        help="IP address the --prometheus server binds to (default 127.0.0.1, "
        "this host only; 0.0.0.0 or :: for every interface, so a Prometheus "
        "elsewhere can scrape it)",
    )
    p.add_argument(
        "--thresholds",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML (or .json) with max_p99_ms, max_p999_ms, max_jitter_ms, "
        "max_temp_c, allow_offline; flags override it",
    )
    p.add_argument(
        "--max-p99-ms",
        type=float,
        default=None,
        metavar="X",
        help="breach when any model's p99 of the last window is above X ms",
    )
    p.add_argument(
        "--max-p999-ms", type=float, default=None, metavar="X", help="... p99.9 above X ms"
    )
    p.add_argument(
        "--max-jitter-ms",
        type=float,
        default=None,
        metavar="X",
        help="... jitter (p99 - p50) above X ms",
    )
    p.add_argument(
        "--max-temp-c",
        type=float,
        default=None,
        metavar="X",
        help="breach when the hottest thermal reading is above X °C",
    )
    p.add_argument(
        "--allow-offline", action="store_true", help="offline and stale devices are not breaches"
    )
    p.add_argument(
        "--stale-factor",
        type=float,
        default=DEFAULT_STALE_FACTOR,
        metavar="N",
        help="stale after N telemetry intervals without telemetry (default 3; 0: never)",
    )
    p.add_argument("--share", default=None, metavar="NAME", help=SHARE_HELP)
    p.add_argument("--username", default=None)
    p.add_argument("--password-file", type=Path, default=None, metavar="FILE")
    p.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="CA for an mqtts:// broker (default: the system's)",
    )
    p.set_defaults(func=cmd_fleet)


def thresholds_from_args(args) -> Thresholds:
    base = load_thresholds(args.thresholds) if args.thresholds else Thresholds()
    return base.with_flags(
        max_p99_ms=args.max_p99_ms,
        max_p999_ms=args.max_p999_ms,
        max_jitter_ms=args.max_jitter_ms,
        max_temp_c=args.max_temp_c,
        allow_offline=args.allow_offline,
    )


def cmd_fleet(args, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Exit 0: collected, no device breaches (--once) or stopped with Ctrl-C (live); 1: a
    breach (--once) or the broker could not be used; 2: bad flags, URL or thresholds file."""
    from edged.fleet.exporter import FleetCollector, serve_prometheus
    from edged.fleet.monitor import Monitor, parse_broker, run_live
    from edged.fleet.store import Fleet

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        thresholds = thresholds_from_args(args)
        broker = parse_broker(args.broker)
        _check_level(args.group, "--group")
        _check_level(args.share, "--share")
        if not args.wait > 0 or not args.refresh > 0:
            raise FleetError("--wait and --refresh must be > 0 seconds")
        if args.stale_factor < 0:
            raise FleetError("--stale-factor must be >= 0")
        if args.prometheus is not None and not 1 <= args.prometheus <= 65535:
            raise FleetError(f"--prometheus: expected a port 1..65535, got {args.prometheus}")
        prometheus_addr = _listen_address(args.prometheus_addr)
        fleet = Fleet()
        monitor = Monitor(
            broker,
            fleet,
            group=args.group,
            share=args.share,
            username=args.username,
            password_file=args.password_file,
            ca_file=args.ca_file,
            err=err,
        )
    except FleetError as exc:
        print(f"edgectl: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    server = None
    if args.prometheus is not None:
        try:
            server = serve_prometheus(
                FleetCollector(fleet, thresholds, args.stale_factor),
                args.prometheus,
                prometheus_addr,
            )
        except OSError as exc:
            print(
                f"edgectl: error: --prometheus "
                f"{_host_port(prometheus_addr, args.prometheus)}: "
                f"{exc.strerror or exc}",
                file=err,
            )
            return EXIT_FAILED
    monitor.start()
    try:
        if args.once:
            return _once(args, monitor, fleet, thresholds, out, err)
        run_live(
            monitor,
            fleet,
            thresholds,
            out=out,
            err=err,
            refresh_s=args.refresh,
            as_json=args.json,
            stale_factor=args.stale_factor,
        )
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        monitor.stop()
        if server is not None:
            server.shutdown()
            server.server_close()


def _once(
    args, monitor: Monitor, fleet: Fleet, thresholds: Thresholds, out: TextIO, err: TextIO
) -> int:
    import orjson

    from edged.fleet.report import fleet_rows, format_table, summary

    connect_timeout = max(5.0, args.wait)
    if not monitor.subscribed.wait(connect_timeout):
        reason = monitor.failure or f"cannot reach {monitor.broker.url}"
        print(f"edgectl: error: {reason} (waited {connect_timeout:g} s)", file=err)
        return EXIT_FAILED
    time.sleep(args.wait)
    rows = fleet_rows(fleet, thresholds, stale_factor=args.stale_factor)
    if args.json:
        out.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        out.write(
            format_table(rows, title=f"edged fleet at {monitor.broker.url}: {summary(rows, fleet)}")
            + "\n"
        )
        for r in rows:
            for b in r["breaches"]:
                out.write(f"BREACH {r['group']}/{r['device']}: {b['text']}\n")
    if fleet.bad:
        print(
            f"edgectl fleet: ignored {fleet.bad} malformed message(s); last: {fleet.last_bad}",
            file=err,
        )
    out.flush()
    return EXIT_BREACH if any(r["breaches"] for r in rows) else EXIT_OK


def _check_level(value: str | None, flag: str) -> None:
    if value is not None and not is_level(value):
        raise FleetError(
            f"{flag}: must be a non-empty MQTT topic level (no '/', '+', '#'), got {value!r}"
        )


def _listen_address(addr: str) -> str:
    """An IP address to bind to (0.0.0.0 / :: for every interface); anything else is a
    FleetError naming the flag."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        raise FleetError(
            f"--prometheus-addr: expected an IP address such as 127.0.0.1, "
            f"0.0.0.0 or ::, got {addr!r}"
        ) from None


def _host_port(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
