"""`edgectl provision`: write the whole tuned configuration into an image root (never the
live system), through the root's own journal, so `edgectl revert --root` undoes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Through the module, not names bound at import: what tuning's functions are when provision
# runs is what runs (a test that stubs them out for a refused live apply covers provision too).
from edged.cli import tuning
from edged.cli.common import EXIT_OK, UsageError

ORDER = 70  # place in `edgectl --help`


def register(sub) -> None:
    provision = sub.add_parser(
        "provision",
        parents=[tuning.placement_options()],
        help="write the whole tuned configuration into an image root "
        "(plan --trim, sysctl.d, CPUAffinity, edged enabled)",
    )
    provision.add_argument(
        "--root", type=Path, default=None, help="the image root (required: never the live system)"
    )
    provision.add_argument("--json", action="store_true", help="machine-readable output")
    provision.set_defaults(func=cmd_provision)


def cmd_provision(args) -> int:
    """plan --trim plus the persistent configuration, applied through the root's journal."""
    from sysconf.provision import provision_plan

    if args.root is None:
        raise UsageError(
            "provision needs --root DIR (an image root; it never writes the live "
            "system: use edgectl apply there)"
        )
    root, cpus, keep, extra = tuning.placement(args)
    try:
        provisioned = provision_plan(
            root, cpus, keep, extra, realtime=tuning.uses_rt_priority(args)
        )
    except ValueError as exc:  # the root is the live system
        raise UsageError(str(exc)) from None
    journal = tuning.journals(root)
    report: dict[str, Any] = provisioned.to_dict()
    try:
        applied = journal.apply(provisioned.changes)
    except ValueError as exc:  # untrusted or corrupt journal: name it, change nothing
        raise UsageError(str(exc)) from None
    report.update(applied.to_dict())
    report["journal"] = str(journal.path)
    report["persistent_journal"] = str(journal.persistent.path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(tuning.format_plan(report, applied=True))
    return EXIT_OK
