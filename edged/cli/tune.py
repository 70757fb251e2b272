"""`edgectl tune`: the daemon's tuning loop's record, or, from recorded telemetry, the
changes that answer its latency outliers.

Without --telemetry it lists what the daemon's loop ([tuning] auto, edged.autotune) did:
its proposals, the changes it applied with their before/after figures and verdict, the ones
it reverted and why, and the causes no action answers (read from the daemon's state dir,
`tuning-loop.json`; no daemon call, no root needed).

With --telemetry it works offline:

Reads telemetry payloads (a JSON document, or JSON lines as `[telemetry] payload_file`
writes them), ranks the causes of the outliers on the inference cores (most outliers
first), and asks the tuning actions (sysconf.actions, one module each) what would answer
each: the changes (path, old, new, why), or why none can. `--apply` applies them through the
same journal as `edgectl apply` (so `edgectl revert` restores the exact previous state),
on an image (`--root`) or, as root, the live system. What a board learned can so be
provisioned into the next board's image.

Exit codes: 0 proposals or the record listed (or applied), 1 nothing could be applied (every
change refused) or no record of the loop, 2 bad flags or an unreadable telemetry file."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from edged.cli.common import EXIT_FAILED, EXIT_OK, UsageError

ORDER = 65  # place in `edgectl --help`: after plan, apply, revert


def register(sub) -> None:
    from edged.cli.tuning import placement_options

    tune = sub.add_parser(
        "tune",
        parents=[placement_options(isolation=False)],
        help="what the tuning loop did; or, from recorded telemetry, the changes that "
        "answer its latency outliers",
    )
    tune.add_argument(
        "--telemetry",
        type=Path,
        default=None,
        help="telemetry payloads: a JSON document or JSON lines ([telemetry] payload_file); "
        "without it, the daemon's loop's record is listed",
    )
    tune.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the daemon's state dir with the loop's record (default: [server] state_dir of "
        "--config, else /var/lib/edged)",
    )
    tune.add_argument("--root", type=Path, default=None, help="an image or fixture root")
    tune.add_argument(
        "--apply", action="store_true", help="apply the proposals through the journal"
    )
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    tune.set_defaults(func=cmd_tune, boot=False)


def read_payloads(path: Path) -> list[dict[str, Any]]:
    """Payloads from `path`: one JSON document (or a list of them), or JSON lines; errors
    name the file and the line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"--telemetry {path}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
        payloads = doc if isinstance(doc, list) else [doc]
    except ValueError:
        payloads = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                payloads.append(json.loads(line))
            except ValueError as exc:
                raise UsageError(f"--telemetry {path}: line {number}: not JSON ({exc})") from None
    bad = [i for i, p in enumerate(payloads) if not isinstance(p, dict) or "models" not in p]
    if bad or not payloads:
        raise UsageError(
            f"--telemetry {path}: not telemetry payloads (each needs a 'models' object; "
            f"docs/schema/telemetry.schema.json)"
        )
    return payloads


def cmd_tune(args) -> int:
    from edged.cli.tuning import _refuse_live_without_root, journals, placement
    from sysconf.actions import evidence_from_telemetry, propose_for

    if args.telemetry is None:
        return show_record(args)
    payloads = read_payloads(args.telemetry)
    root, plan, _, _ = placement(args)
    if args.apply and _refuse_live_without_root(root, "tune --apply"):
        return EXIT_FAILED
    evidence = evidence_from_telemetry(payloads)
    causes = propose_for(root, plan, evidence)
    report: dict[str, Any] = {
        "windows": len(payloads),
        "cpus": plan.to_dict(),
        "causes": causes,
    }
    code = EXIT_OK
    if args.apply:
        from sysconf.change_records import Change

        changes = [
            Change.from_dict(c)
            for cause in causes
            for p in cause["proposals"]
            for c in p["changes"]
        ]
        journal = journals(root)
        try:
            result = journal.apply(changes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        report.update(result.to_dict())
        report["journal"] = str(journal.path)
        if changes and not result.applied and not result.unchanged:
            code = EXIT_FAILED
    print(json.dumps(report, indent=2) if args.json else format_report(report, args.apply))
    return code


def format_report(report: dict[str, Any], applied: bool) -> str:
    cpus = report["cpus"]
    lines = [
        f"{report['windows']} telemetry window(s); inference CPUs {cpus['inference_list']}, "
        f"housekeeping {cpus['housekeeping_list']}"
    ]
    if not report["causes"]:
        lines.append("no latency outlier has a cause in this telemetry: nothing to tune")
    for cause in report["causes"]:
        lines.append(
            f"{cause['cause']}: {cause['outliers']} outlier(s) in {cause['windows']} window(s)"
        )
        for p in cause["proposals"]:
            if p["blocked"]:
                lines.append(
                    f"  {p['action']} ({p['risk']} risk): nothing to change: {p['blocked']}"
                )
                continue
            lines.append(f"  {p['action']} ({p['risk']} risk): {p['expected']}")
            for c in p["changes"]:
                lines.append(f"    {c['path']}: {c['old']!r} -> {c['new']!r}")
        if cause.get("why_none"):
            lines.append(f"  no action: {cause['why_none']}")
    if applied:
        lines.append(
            f"applied {len(report.get('applied', []))}, unchanged "
            f"{len(report.get('unchanged', []))}, refused {len(report.get('skipped', []))}; "
            f"journal {report.get('journal')} (edgectl revert restores)"
        )
    return "\n".join(lines)


# -- the daemon's loop's record ----------------------------------------------------------------


def show_record(args) -> int:
    from edged.autotune.ledger import LEDGER_NAME

    state_dir = args.state_dir
    if state_dir is None and args.config is not None:
        from edged.config import ConfigError, load_config

        try:
            state_dir = load_config(args.config, online_cpus=None).server.state_dir
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    path = (state_dir or Path("/var/lib/edged")) / LEDGER_NAME
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        print(
            f"edgectl: no record of the tuning loop at {path}: is [tuning] auto on "
            "(docs/TUNING.md)? Give --telemetry FILE for a proposal from recorded telemetry",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot be read: {exc}") from None
    print(json.dumps(record, indent=2) if args.json else format_record(record, path))
    return EXIT_OK


def format_record(record: dict[str, Any], path: Path) -> str:
    lines = [f"tuning loop: auto = {record.get('mode')}, {record.get('phase')} ({path})"]
    steps = record.get("steps") or []
    if not steps:
        lines.append("no change proposed yet")
    for step in steps:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(step.get("at", 0)))
        lines.append(
            f"#{step.get('id')} {when} {str(step.get('state')).upper()} {step.get('action')} "
            f"for {step.get('cause')} ({step.get('outliers')} outliers, {step.get('risk')} risk)"
        )
        for change in step.get("changes") or []:
            lines.append(f"    {change['path']}: {change['old']!r} -> {change['new']!r}")
        verdict = step.get("verdict")
        if verdict:
            was, now = verdict["before"], verdict["after"]
            lines.append(
                "    before -> after (medians of "
                f"{len(step.get('before_windows') or [])} windows): p50 {was['p50_ms']:g} -> "
                f"{now['p50_ms']:g}, p99 {was['p99_ms']:g} -> {now['p99_ms']:g}, p99.9 "
                f"{was['p999_ms']:g} -> {now['p999_ms']:g} ms; p = {verdict['p_value']:g}"
            )
        lines.append(f"    {step.get('reason')}")
    for cause in record.get("remaining") or []:
        lines.append(f"unanswered: {cause['cause']} ({cause['outliers']} outliers): {cause['why']}")
    return "\n".join(lines)
