"""`edgectl reload`: make the running daemon re-read its config, as `systemctl reload` does
(over the Unix socket only: the daemon takes a reload there alone, where the socket's file
mode decides who may)."""

from __future__ import annotations

import sys

from edged.cli.common import EXIT_FAILED, EXIT_OK, check_address

ORDER = 110  # place in `edgectl --help`


def register(sub) -> None:
    reload = sub.add_parser(
        "reload",
        help="make the running daemon re-read its config (like systemctl reload; Unix socket only)",
    )
    reload.add_argument(
        "--address",
        default="unix:/run/edged/edged.sock",
        help="the daemon's Unix socket (unix:PATH)",
    )
    reload.set_defaults(func=cmd_reload)


def cmd_reload(args) -> int:
    check_address(args.address, unix_only=True)
    from edged.client import Client, EdgedError  # imports numpy: after the usage check

    try:
        with Client(args.address, timeout=10) as client:
            client.reload()
    except (OSError, EdgedError) as exc:
        print(f"edgectl: error: {args.address}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"edgectl: reload started ({args.address}); `edgectl status` shows the outcome")
    return EXIT_OK
