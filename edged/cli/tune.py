"""`edgectl tune`: from recorded telemetry to the changes that answer its latency outliers.

Reads telemetry payloads (a JSON document, or JSON lines as `[telemetry] payload_file`
writes them), ranks the causes of the outliers on the inference cores (most outliers
first), and asks the tuning actions (sysconf.actions, one module each) what would answer
each: the changes (path, old, new, why), or why none can. `--apply` applies them through the
same journal as `edgectl apply` (so `edgectl revert` restores the exact previous state),
on an image (`--root`) or, as root, the live system. What a board learned can so be
provisioned into the next board's image.

Exit codes: 0 proposals listed (or applied), 1 nothing could be applied (every change
refused), 2 bad flags or an unreadable telemetry file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edged.cli.common import EXIT_FAILED, EXIT_OK, UsageError

ORDER = 65  # place in `edgectl --help`: after plan, apply, revert


def register(sub) -> None:
    from edged.cli.tuning import placement_options

    tune = sub.add_parser(
        "tune",
        parents=[placement_options(isolation=False)],
        help="from recorded telemetry, the changes that answer its latency outliers",
    )
    tune.add_argument(
        "--telemetry",
        type=Path,
        required=True,
        help="telemetry payloads: a JSON document or JSON lines ([telemetry] payload_file)",
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
            Change(c["kind"], c["path"], c["old"], c["new"], c["reason"])
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
