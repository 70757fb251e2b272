"""edged: the inference daemon.

Serving (Open Inference Protocol over HTTP and a Unix socket, dynamic batching, systemd) is
the next issue's work and is not here yet; until then this entry point says so plainly
instead of pretending to serve.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edged", description="edged inference daemon")
    parser.add_argument("--version", action="version", version="edged 0.1.0")
    parser.add_argument("--config", default="/etc/edged/edged.toml")
    parser.parse_args(argv)
    print("edged: the serving daemon is not built yet (see the README's status table); "
          "use `edgectl backends` and `edgectl bench`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
