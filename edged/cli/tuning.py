"""`edgectl plan`, `apply` and `revert`: the isolation changes for the inference cores, made
through the journal and undone exactly from it.

One module for the three: plan and apply are one command (apply is the plan written through
the journal) and revert is apply's inverse, so they share their options, where the journals
live and the refusal of the live system without root. `edgectl provision` reuses the
placement options, the journals and the plan's text from here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from edged.cli.common import EXIT_FAILED, EXIT_OK, UsageError, parse_cpu_list

ORDER = 40  # place in `edgectl --help`: plan, apply and revert take 40, 50 and 60
LIVE_TUNE_STATE_DIR = Path("/var/lib/edged-tune")
# A refusal for lack of permission, as sysconf.changes names it ("EACCES: ...").
_DENIED = ("EPERM:", "EACCES:", "EROFS:")


def placement_options(isolation: bool = True) -> argparse.ArgumentParser:
    """The parent parser of plan, apply and provision: where inference runs; `isolation`:
    with their --boot and --trim (tune takes only where inference runs)."""
    placement = argparse.ArgumentParser(add_help=False)
    placement.add_argument(
        "--config",
        type=Path,
        default=None,
        help="edged.toml: the models' cpus are the inference cores",
    )
    placement.add_argument(
        "--inference-cpus",
        default=None,
        help="inference cores, e.g. 2-3: overrides the rest (else: the "
        "kernel's isolated set, the config's model cpus, or the "
        "last core)",
    )
    placement.add_argument(
        "--dtb",
        type=Path,
        default=None,
        help="the board's device tree: its CPUs, for an image root that has no /sys",
    )
    if not isolation:
        return placement
    placement.add_argument(
        "--boot",
        action="store_true",
        help="on the live system, also edit the boot command line (with --root it always is)",
    )
    placement.add_argument(
        "--trim",
        action="store_true",
        help="also mask the services and timers that steal cores (with "
        "--root: the mask symlinks; live: as systemctl mask --now, "
        "and revert unmasks and restarts what ran); the config's "
        "[audit] trim/keep adjust the list",
    )
    return placement


def register(sub) -> None:
    tuning = argparse.ArgumentParser(add_help=False)
    tuning.add_argument(
        "--root",
        type=Path,
        default=None,
        help="an image or fixture root instead of the live system",
    )
    tuning.add_argument("--json", action="store_true", help="machine-readable output")
    placement = placement_options()
    plan = sub.add_parser(
        "plan",
        parents=[tuning, placement],
        help="list every isolation change: path, old, new, reason",
    )
    apply = sub.add_parser(
        "apply",
        parents=[tuning, placement],
        help="apply the plan through the journal (live: root only, else "
        "exit 1; journal in /var/lib/edged-tune, with --root in "
        "DIR/var/lib/edged)",
    )
    revert = sub.add_parser(
        "revert",
        parents=[tuning],
        help="restore what apply changed, exactly: the tuning and the "
        "persistent journal (live: root only, else exit 1)",
    )
    revert.add_argument(
        "--runtime",
        action="store_true",
        help="revert only the runtime tuning (the tuning journal, as "
        "edged-tune.service does at stop); keep what is meant to "
        "survive reboots: the boot command line, service masks and "
        "provisioned files",
    )
    plan.set_defaults(func=cmd_plan_apply)
    apply.set_defaults(func=cmd_plan_apply)
    revert.set_defaults(func=cmd_revert)


def _isolation_plan(args, placed=None):
    """The plan for `placed` (from `placement`; computed here when None)."""
    from sysconf.isolation import plan

    root, cpus, keep, extra = placed or placement(args)
    return root, plan(
        root,
        cpus,
        boot_on_live=args.boot,
        trim=getattr(args, "trim", False),
        keep=keep,
        extra=extra,
        realtime=uses_rt_priority(args),
    )


def uses_rt_priority(args) -> bool:
    """Whether a model of --config runs its worker SCHED_FIFO (`rt_priority`): only then does
    the plan turn RT throttling off (kernel.sched_rt_runtime_us=-1). `placement` has already
    loaded and validated the config, so this second load cannot fail differently."""
    if getattr(args, "config", None) is None:
        return False
    from edged.config import load_config

    return any(mc.rt_priority for mc in load_config(args.config, online_cpus=None).models)


def placement(args):
    """The root, its CPU plan and the [audit] keep/trim lists, from --root, --config and
    --inference-cpus. Precedence (sysconf.cpusets.decide): --inference-cpus (an explicit
    override), else the kernel's isolated set, else the config's model cpus, else the last
    core."""
    from sysconf import SysRoot
    from sysconf.cpusets import decide, read_cpusets

    root = SysRoot.at(args.root)
    configured = override = None
    config = None
    if args.config is not None:
        from edged.config import ConfigError, load_config

        try:
            config = load_config(args.config, online_cpus=None)  # checked against the root
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    if args.inference_cpus:
        override = parse_cpu_list(args.inference_cpus, "--inference-cpus")
        if not override:
            raise UsageError("--inference-cpus: empty CPU list")
    if config is not None:
        pinned = sorted({cpu for mc in config.models for cpu in (mc.cpus or ())})
        configured = pinned or None
    cpusets = read_cpusets(root)
    if not cpusets.online and getattr(args, "dtb", None) is not None:
        cpusets = replace(cpusets, online=dtb_cpus(args.dtb))
    if not cpusets.online:
        raise UsageError(
            f"{root.root}: no CPU information (no /sys/devices/system/cpu/online, "
            f"as in an image root); give the board's --dtb"
        )
    try:
        cpus = decide(cpusets, configured, override=override)
    except ValueError as exc:
        msg = str(exc)
        if "override" in msg:
            msg = "--inference-cpus: " + msg.replace("the override ", "").replace(
                "override inference CPUs", "inference CPUs"
            ).replace(" (override)", "")
        elif "configured" in msg and args.config is not None:
            msg = f"{args.config}: models.cpus: {msg}"
        raise UsageError(msg) from None
    keep, extra = (config.audit.keep, config.audit.trim) if config is not None else ((), ())
    return root, cpus, keep, extra


def dtb_cpus(path: Path) -> list[int]:
    """CPU numbers 0..n-1 for the board's /cpus/cpu@* nodes (what the kernel will bring up)."""
    from sysconf.cpusets import dt_cpu_count
    from sysconf.fdt import FdtError, load_fdt

    try:
        count = dt_cpu_count(load_fdt(path))
    except FdtError as exc:
        raise UsageError(str(exc)) from None
    if not count:
        raise UsageError(f'{path}: no /cpus/cpu@* nodes with device_type "cpu"')
    return list(range(count))


def journals(root):
    """Both journals (sysconf.journals.Journals: tuning and persistent) in one state dir."""
    from sysconf.journals import Journals

    # With --root the journals live inside that root (an image carries its own journals).
    return Journals(root, "/var/lib/edged" if not root.is_live else str(_live_state_dir()))


def _live_state_dir() -> Path:
    """The live journals' folder: root-only (StateDirectory=edged-tune in
    edged-tune.service), never the daemon's /var/lib/edged, which the unprivileged edged user
    owns: root's revert writes whatever the journal says, so the daemon must not be able to
    rewrite it. $EDGED_TUNE_STATE_DIR overrides it (not $EDGED_STATE_DIR, the daemon's)."""
    return Path(os.environ.get("EDGED_TUNE_STATE_DIR") or LIVE_TUNE_STATE_DIR)


def _refuse_live_without_root(root, what: str) -> bool:
    """apply/revert on the live system without root would be refused write by write (EPERM),
    which looks like success; say so up front instead (exit 1)."""
    if not root.is_live or os.geteuid() == 0:
        return False
    print(
        f"edgectl: error: {what} on the live system needs root (it writes /proc, /sys, "
        f"/etc and the journal in {_live_state_dir()}); nothing was changed. Run it as "
        f"root, or give --root DIR for an image",
        file=sys.stderr,
    )
    return True


def cmd_plan_apply(args) -> int:
    """plan: print the changes. apply: refuse the live system without root (exit 1); retire a
    journal from an older boot (before planning, so the plan sees the restored files), apply
    through the journal, and exit 1 when every change was refused for lack of permission."""
    from sysconf import SysRoot

    applying = args.command == "apply"
    if applying and _refuse_live_without_root(SysRoot.at(args.root), "apply"):
        return EXIT_FAILED
    placed = placement(args)  # bad input fails before anything is written
    root = placed[0]
    notes = list(placed[1].notes)
    stale: list[tuple[str, str]] = []
    journal = journals(root)
    if applying:
        try:
            stale = journal.retire_stale()
        except ValueError as exc:  # untrusted or corrupt journal: name it, change nothing
            raise UsageError(str(exc)) from None
        if stale:
            notes.append(
                f"the journal was from an older boot: its file changes were reverted "
                f"and its /proc and /sys values dropped ({len(stale)} records)"
            )
    root, isolation = _isolation_plan(args, placed)
    notes.extend(f"left out of the plan: {why}" for why in dict.fromkeys(root.refused))
    report: dict[str, Any] = isolation.to_dict()
    code = EXIT_OK
    if applying:
        try:
            result = journal.apply(isolation.changes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        result.stale = stale + result.stale
        report.update(result.to_dict())
        report["journal"] = str(journal.path)
        report["persistent_journal"] = str(journal.persistent.path)
        if root.is_live and any(c.kind == "irqbalance" for c in result.applied):
            notes.append(
                "irqbalance reads its defaults file only at start: edged-tune.service "
                "restarts it; by hand: systemctl try-restart irqbalance"
            )
        if (
            result.skipped
            and not result.applied
            and all(any(name in why for name in _DENIED) for _, why in result.skipped)
        ):
            print(
                "edgectl: error: every change was refused for lack of permission "
                "(EPERM/EACCES/EROFS); nothing was applied",
                file=sys.stderr,
            )
            code = EXIT_FAILED
    report["notes"] = notes
    if applying:
        _tuning_events("tuning_apply", report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_plan(report, applied=applying))
        for note in notes:
            print(f"note: {note}")
    return code


def _tuning_events(kind: str, report: dict[str, Any]) -> None:
    """Under systemd (edged-tune.service), each change is also a journal event with its
    fields: `journalctl EVENT=tuning_apply PATH=/proc/irq/24/smp_affinity_list`."""
    from edged import logs

    logger = logs.journal_logger("edgectl.tuning")
    if logger is None:
        return
    for change in report.get("applied", []):
        logs.event(
            logger,
            kind,
            "%s: %s -> %s (%s)",
            change["path"],
            change["old"],
            change["new"],
            change["reason"],
            path=change["path"],
            change_kind=change["kind"],
            old=change["old"],
            new=change["new"],
            reason=change["reason"],
        )
    for change in report.get("skipped", []):
        logs.event(
            logger,
            kind + "_skipped",
            "%s not changed: %s",
            change["path"],
            change["why"],
            level=logging.WARNING,
            path=change["path"],
            change_kind=change["kind"],
            reason=change["why"],
        )
    for item in report.get("reverted", []):
        logs.event(
            logger,
            kind,
            "%s %s",
            item["action"],
            item["path"],
            path=item["path"],
            action=item["action"],
        )


def format_plan(report: dict[str, Any], applied: bool) -> str:
    cpus = report["cpus"]
    lines = [
        f"inference CPUs {cpus['inference_list']}, housekeeping {cpus['housekeeping_list']}"
        f" (from {cpus['source']})"
    ]
    if applied:
        lines.append(
            f"applied {len(report['applied'])}, already so {len(report['unchanged'])}, "
            f"refused {len(report['skipped'])} (journal {report['journal']})"
        )
        rows = [(c, "applied") for c in report["applied"]] + [
            (c, f"REFUSED: {c['why']}") for c in report["skipped"]
        ]
    else:
        rows = [(c, "") for c in report["changes"]]
        if not rows:
            lines.append("nothing to change")
    for change, outcome in rows:
        old = (change["old"] or "(absent)").strip().replace("\n", " ")[:40]
        new = change["new"].strip().replace("\n", " ")[:40]
        lines.append(
            f"  {change['kind']:11} {change['path']}: {old!r} -> {new!r}"
            f"{'  ' + outcome if outcome else ''}"
        )
        lines.append(f"              {change['reason']}")
    for item in report["unmovable"]:
        lines.append(
            f"  cannot move IRQ {item['irq']} ({item['name']}): {item['why']}; "
            f"remedy: {item['remedy']}"
        )
    return "\n".join(lines)


def cmd_revert(args) -> int:
    """Both journals, or with --runtime only the tuning journal (edged-tune.service's stop:
    the boot command line and masks must survive the reboot that follows)."""
    from sysconf import SysRoot

    root = SysRoot.at(args.root)
    if _refuse_live_without_root(root, "revert"):
        return EXIT_FAILED
    journal = journals(root)
    runtime_only = getattr(args, "runtime", False)
    try:
        restored = journal.revert(runtime_only=runtime_only)
        kept = runtime_only and journal.persistent.pending()
    except ValueError as exc:  # corrupt or untrusted journal: say where, change nothing
        raise UsageError(str(exc)) from None
    failed = [(path, what) for path, what in restored if what.startswith("failed")]
    _tuning_events("tuning_revert", {"reverted": [{"path": p, "action": a} for p, a in restored]})
    if args.json:
        print(
            json.dumps(
                {
                    "reverted": [{"path": p, "action": a} for p, a in restored],
                    "kept_persistent": bool(kept),
                },
                indent=2,
            )
        )
    else:
        if not restored:
            print("nothing to revert")
        for path, action in restored:
            print(f"  {action:9} {path}")
        if kept:
            print(
                f"note: kept the persistent changes (boot command line, masks) in "
                f"{journal.persistent.path}; `edgectl revert` without --runtime restores "
                f"them"
            )
    return EXIT_FAILED if failed else EXIT_OK
