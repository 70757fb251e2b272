"""`edgectl audit`: what on this system (or an image root) will hurt inference latency.

The subcommand: its arguments, and the `AuditContext` built from them and edged's config. The
checks, the runner and the reports are `sysconf.audit` (stdlib only, nothing of inference);
exit codes and levels are documented in `sysconf.audit.report`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.cli.common import EXIT_BAD_INPUT, UsageError
from sysconf.audit import report, runner
from sysconf.audit.findings import AuditContext

if TYPE_CHECKING:
    pass

ORDER = 80  # place in `edgectl --help`


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "audit",
        help="what on this system will hurt inference latency",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="audit an image/fixture root instead of the live system",
    )
    p.add_argument(
        "--dtb",
        action="append",
        default=[],
        metavar="FILE",
        help="a flattened device tree to check (repeatable)",
    )
    p.add_argument(
        "--inference-cpus",
        default=None,
        metavar="LIST",
        help="the inference cores, e.g. 2-3 (default: isolated, else the last)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="edged's TOML config: [audit] trim/keep and the models' cpus (the "
        "inference cores, unless --inference-cpus is given)",
    )
    p.add_argument("--format", choices=report.FORMATS, default="text")
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the report here instead of stdout",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PREFIX",
        help="only findings whose id starts with PREFIX (repeatable)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PREFIX",
        help="leave out findings whose id starts with PREFIX (repeatable)",
    )
    p.add_argument(
        "--fail-on",
        choices=("warn", "fail"),
        default="fail",
        help="exit 1 when a finding is at or above this level (default: fail)",
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help="how each check ran (ok, seconds, findings): a table on stderr, or "
        'with --format json a "checks" list in the report',
    )
    p.set_defaults(func=cmd_audit)
    return p


def cmd_audit(args) -> int:
    try:
        ctx = _context(args)
    except UsageError as exc:
        print(f"edgectl: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = runner.run(ctx, args.only, args.skip)
    stats = result.checks if args.stats else None
    colour = args.output is None and args.format == "text" and sys.stdout.isatty()
    text = report.render(
        result.findings, args.format, colour=colour, sections=runner.sections(), stats=stats
    )
    if args.output is not None:
        try:
            args.output.write_text(text)
        except OSError as exc:
            print(f"edgectl: error: {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    else:
        sys.stdout.write(text)
    if stats is not None and args.format != "json":
        sys.stderr.write(report.render_stats(stats))
    return report.exit_code(result.findings, args.fail_on)


def _context(args) -> AuditContext:
    from sysconf.cpulist import parse_cpulist
    from sysconf.cpusets import decide, read_cpusets_for
    from sysconf.fdt import FdtError, load_fdt
    from sysconf.sysroot import SysRoot

    if args.root is not None and not Path(args.root).is_dir():
        raise UsageError(f"{args.root}: --root is not a directory")
    root = SysRoot.at(args.root)
    dtbs = []
    for path in args.dtb:
        try:
            dtbs.append((str(path), load_fdt(path)))
        except FdtError as exc:
            msg = str(exc)
            raise UsageError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    # An image root has no /sys: the board's device tree says which CPUs it will have.
    cpusets = read_cpusets_for(root, [tree for _, tree in dtbs])
    options: dict[str, Any] = {}
    config_cpus = None
    if getattr(args, "config", None) is not None:
        from edged.config import ConfigError, load_config
        from edged.config.audit import audit_options, model_cpus

        try:
            config = load_config(args.config, online_cpus=None)  # checked against the root
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        options.update(audit_options(config))
        config_cpus = model_cpus(config) or None
    if config_cpus:
        try:
            decide(cpusets, config_cpus)
        except ValueError as exc:
            raise UsageError(f"{args.config}: models.cpus: {exc}") from None
        options["inference_cpus"] = config_cpus
    if args.inference_cpus:
        try:
            cpus = parse_cpulist(args.inference_cpus)
        except ValueError as exc:
            raise UsageError(f"--inference-cpus: {exc}") from None
        if not cpus:
            raise UsageError("--inference-cpus: empty CPU list")
        try:
            decide(cpusets, override=cpus)
        except ValueError as exc:
            raise UsageError(f"--inference-cpus: {exc}") from None
        # The flag is the operator's override, as for `edgectl apply`: it wins over the
        # isolated set, which wins over the models' cpus (sysconf.cpusets.decide).
        options["inference_override"] = cpus
    return AuditContext(root=root, dtbs=dtbs, options=options)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m edged.cli.audit audit ...`: the subcommand alone."""
    parser = argparse.ArgumentParser(prog="edgectl")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
