"""`edgectl audit`: what on this system (or an image root) will hurt inference latency.

Runs every registered check (sysconf.hostchecks, sysconf.dtcheck) and renders the findings as
grouped text, JSON, JUnit XML or SARIF 2.1.0.

Exit codes: 0 nothing at or above --fail-on, 1 findings at or above it, 2 usage/input error.
A finding's level is the lesser of its status and its severity: an `info` finding never fails
the audit, a `fail`-severity check that only warns counts as warn. A check that crashed
(status `error`) counts as fail: the audit is incomplete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.config import Config
    from sysconf.sysroot import SysRoot

from sysconf.findings import REGISTRY, STATUSES, AuditContext, Finding, run_checks, summary

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
FORMATS = ("text", "json", "junit", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_RANK = {"info": 0, "pass": 0, "skip": 0, "warn": 1, "fail": 2, "error": 2}
_SARIF_LEVEL = {"info": "note", "warn": "warning", "fail": "error"}
GROUP_ORDER = ("ISO", "IRQ", "SVC", "KRN", "DT", "THM")  # text report sections, in this order
_COLOURS = {"pass": "32", "warn": "33", "fail": "31", "skip": "2", "error": "35"}


def load_checks() -> None:
    """Importing a check module registers its checks."""
    import sysconf.dtcheck  # registers devicetree
    import sysconf.hostchecks  # registers isolation, thermal
    import sysconf.services  # noqa: F401  (registers services)


def add_audit_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("audit", help="what on this system will hurt inference latency",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=None,
                   help="audit an image/fixture root instead of the live system")
    p.add_argument("--dtb", action="append", default=[], metavar="FILE",
                   help="a flattened device tree to check (repeatable)")
    p.add_argument("--inference-cpus", default=None, metavar="LIST",
                   help="the inference cores, e.g. 2-3 (default: isolated, else the last)")
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="edged's TOML config: [audit] trim/keep and the models' cpus (the "
                        "inference cores, unless --inference-cpus is given)")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--output", type=Path, default=None, metavar="FILE",
                   help="write the report here instead of stdout")
    p.add_argument("--only", action="append", default=[], metavar="PREFIX",
                   help="only findings whose id starts with PREFIX (repeatable)")
    p.add_argument("--skip", action="append", default=[], metavar="PREFIX",
                   help="leave out findings whose id starts with PREFIX (repeatable)")
    p.add_argument("--fail-on", choices=("warn", "fail"), default="fail",
                   help="exit 1 when a finding is at or above this level (default: fail)")
    p.set_defaults(func=cmd_audit)
    return p


class _InputError(Exception):
    pass


def cmd_audit(args) -> int:
    try:
        ctx = _context(args)
    except _InputError as exc:
        print(f"edgectl: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    findings = collect(ctx, args.only, args.skip)
    colour = args.output is None and args.format == "text" and sys.stdout.isatty()
    text = render(findings, args.format, colour=colour)
    if args.output is not None:
        try:
            args.output.write_text(text)
        except OSError as exc:
            print(f"edgectl: error: {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    else:
        sys.stdout.write(text)
    return exit_code(findings, args.fail_on)


def _context(args) -> AuditContext:
    from sysconf.cpulist import parse_cpulist
    from sysconf.cpusets import decide, read_cpusets_for
    from sysconf.fdt import FdtError, load_fdt
    from sysconf.sysroot import SysRoot

    if args.root is not None and not Path(args.root).is_dir():
        raise _InputError(f"{args.root}: --root is not a directory")
    root = SysRoot.at(args.root)
    dtbs = []
    for path in args.dtb:
        try:
            dtbs.append((str(path), load_fdt(path)))
        except FdtError as exc:
            msg = str(exc)
            raise _InputError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    # An image root has no /sys: the board's device tree says which CPUs it will have.
    cpusets = read_cpusets_for(root, [tree for _, tree in dtbs])
    options: dict[str, Any] = {}
    config_cpus = None
    if getattr(args, "config", None) is not None:
        from edged.config import ConfigError, load_config

        try:
            config = load_config(args.config, online_cpus=None)  # checked against the root
        except ConfigError as exc:
            raise _InputError(str(exc)) from None
        options["trim"] = list(config.audit.trim)
        options["keep"] = list(config.audit.keep)
        options["realtime"] = any(mc.rt_priority for mc in config.models)
        config_cpus = sorted({cpu for mc in config.models for cpu in (mc.cpus or ())}) or None
    if config_cpus:
        try:
            decide(cpusets, config_cpus)
        except ValueError as exc:
            raise _InputError(f"{args.config}: models.cpus: {exc}") from None
        options["inference_cpus"] = config_cpus
    if args.inference_cpus:
        try:
            cpus = parse_cpulist(args.inference_cpus)
        except ValueError as exc:
            raise _InputError(f"--inference-cpus: {exc}") from None
        if not cpus:
            raise _InputError("--inference-cpus: empty CPU list")
        try:
            decide(cpusets, override=cpus)
        except ValueError as exc:
            raise _InputError(f"--inference-cpus: {exc}") from None
        # The flag is the operator's override, as for `edgectl apply`: it wins over the
        # isolated set, which wins over the models' cpus (sysconf.cpusets.decide).
        options["inference_override"] = cpus
    load_checks()
    return AuditContext(root=root, dtbs=dtbs, options=options)


def collect(ctx: AuditContext, only: Sequence[str] = (), skip: Sequence[str] = ()
            ) -> list[Finding]:
    """Findings filtered by id prefix. A check may yield ids of other prefixes than its own
    (isolation yields IRQ-/KRN-), so with --only every default check runs and the findings
    are filtered by id; a crashed check's error finding is always kept."""
    only = tuple(p.upper() for p in only)
    skip = tuple(p.upper() for p in skip)
    if not only:
        return list(run_checks(ctx, skip=skip))
    selected = only + tuple(c.prefix for c in REGISTRY.values() if c.default_on)
    return [f for f in run_checks(ctx, only=selected, skip=skip)
            if f.id.startswith(only) or f.status == "error"]


def level(finding: Finding) -> int:
    """0 ok/info, 1 warn, 2 fail: the lesser of status and severity (error counts as fail)."""
    if finding.status == "error":
        return 2
    return min(_RANK[finding.status], _RANK[finding.severity])


def exit_code(findings: Sequence[Finding], fail_on: str = "fail") -> int:
    threshold = _RANK[fail_on]
    return EXIT_FAILED if any(level(f) >= threshold for f in findings) else EXIT_OK


def render(findings: Sequence[Finding], fmt: str, colour: bool = False) -> str:
    if fmt == "json":
        return render_json(findings)
    if fmt == "junit":
        return render_junit(findings)
    if fmt == "sarif":
        return render_sarif(findings)
    return render_text(findings, colour)


def _prefix(finding: Finding) -> str:
    return finding.id.split("-", 1)[0]


def render_text(findings: Sequence[Finding], colour: bool = False) -> str:
    def tag(status: str) -> str:
        word = f"[{status.upper():5}]"
        return f"\033[{_COLOURS[status]}m{word}\033[0m" if colour else word

    groups: dict[str, list[Finding]] = {}
    for f in findings:
        groups.setdefault(_prefix(f), []).append(f)
    order = {p: i for i, p in enumerate(GROUP_ORDER)}
    lines: list[str] = []
    for prefix, items in sorted(groups.items(), key=lambda g: order.get(g[0], len(order))):
        lines.append(f"{prefix}")
        for f in items:
            subject = f" [{f.subject}]" if f.subject else ""
            lines.append(f"  {tag(f.status)} {f.id}{subject}: {f.title}")
            if f.status in ("pass", "skip"):
                continue
            for e in f.evidence:
                lines.append(f"          {e.path}: {e.observed!r}, expected {e.expected!r}")
            if f.remedy:
                fix = " (fixable by edgectl apply)" if f.fixable else ""
                lines.append(f"          remedy{fix}: {f.remedy}")
        lines.append("")
    counts = summary(findings)
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES))
    return "\n".join(lines) + "\n"


def render_json(findings: Sequence[Finding]) -> str:
    return json.dumps({"findings": [f.to_dict() for f in findings],
                       "summary": summary(findings)}, indent=2) + "\n"


def _case_name(f: Finding) -> str:
    return f"{f.id}[{f.subject}]" if f.subject else f.id


def _detail(f: Finding) -> str:
    lines = [f"{e.path}: observed {e.observed!r}, expected {e.expected!r}" for e in f.evidence]
    if f.remedy:
        lines.append(f"remedy: {f.remedy}")
    return "\n".join(lines)


def render_junit(findings: Sequence[Finding]) -> str:
    counts = summary(findings)
    suites = ET.Element("testsuites", name="edgectl audit")
    suite = ET.SubElement(suites, "testsuite", name="edgectl audit", tests=str(len(findings)),
                          failures=str(counts["warn"] + counts["fail"]),
                          errors=str(counts["error"]), skipped=str(counts["skip"]))
    for f in findings:
        case = ET.SubElement(suite, "testcase", classname=f"edgectl.audit.{_prefix(f)}",
                             name=_case_name(f))
        if f.status in ("warn", "fail"):
            node = ET.SubElement(case, "failure", message=f.title, type=f"{f.status}")
            node.text = _detail(f)
        elif f.status == "error":
            ET.SubElement(case, "error", message=f.title).text = _detail(f)
        elif f.status == "skip":
            ET.SubElement(case, "skipped", message=f.title)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def fingerprint(f: Finding) -> str:
    return hashlib.sha256(f"{f.id}\0{f.subject}".encode()).hexdigest()


def render_sarif(findings: Sequence[Finding]) -> str:
    rules: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for f in findings:
        if f.id in index:
            continue
        index[f.id] = len(rules)
        rules.append({
            "id": f.id,
            "name": f.id.title().replace("-", ""),
            "shortDescription": {"text": f.title if not f.subject else f.id},
            "defaultConfiguration": {"level": _SARIF_LEVEL[f.severity]},
            "properties": {"fixable": f.fixable},
        })
    results = []
    for f in findings:
        if f.status not in ("warn", "fail"):
            continue
        result: dict[str, Any] = {
            "ruleId": f.id,
            "ruleIndex": index[f.id],
            "level": "error" if f.status == "fail" else "warning",
            "message": {"text": f.title + (f"\n{_detail(f)}" if f.evidence or f.remedy
                                           else "")},
            "partialFingerprints": {"edgedFindingHash/v1": fingerprint(f)},
            "properties": {"subject": f.subject, "fixable": f.fixable, "remedy": f.remedy},
        }
        if f.evidence:
            result["locations"] = [{
                "physicalLocation": {"artifactLocation": {"uri": e.path.lstrip("/") or ".",
                                                          "uriBaseId": "ROOT"}},
                "message": {"text": f"observed {e.observed!r}, expected {e.expected!r}"},
            } for e in f.evidence]
        results.append(result)
    errors = [f for f in findings if f.status == "error"]
    sarif = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "edgectl audit", "rules": rules}},
            "invocations": [{
                "executionSuccessful": not errors,
                "toolExecutionNotifications": [
                    {"level": "error", "message": {"text": f.title},
                     "descriptor": {"id": f.id}} for f in errors],
            }],
            "results": results,
        }],
    }
    return json.dumps(sarif, indent=2) + "\n"


def audit_summary(config: Config, root: SysRoot | None = None,
                  with_model_cpus: bool = True) -> dict[str, Any]:
    """What `edgectl audit --config` reports, as a short summary for the retained `audit`
    topic: counts by status and by level (the lesser of status and severity, as the audit's
    exit code counts), the ids failing and warning, when it ran. Read-only on `root`.
    `with_model_cpus`: the models' cpus are the inference cores (as with --config)."""
    from sysconf.sysroot import SysRoot

    root = root or SysRoot()
    options: dict[str, Any] = {
        "trim": list(config.audit.trim), "keep": list(config.audit.keep),
        "realtime": any(mc.rt_priority for mc in config.models)}
    inference = sorted({cpu for mc in config.models for cpu in (mc.cpus or ())})
    if inference and with_model_cpus:
        options["inference_cpus"] = inference
    load_checks()
    start = time.perf_counter()
    findings = collect(AuditContext(root=root, options=options))
    levels = [level(f) for f in findings]
    return {
        "ts": round(time.time(), 3),
        "root": str(root.root),
        "findings": len(findings),
        "statuses": summary(findings),
        "levels": {name: levels.count(rank) for rank, name in enumerate(("ok", "warn", "fail"))},
        "failing": sorted({f.id for f, lv in zip(findings, levels, strict=True) if lv == 2}),
        "warning": sorted({f.id for f, lv in zip(findings, levels, strict=True) if lv == 1}),
        "duration_s": round(time.perf_counter() - start, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgectl")
    sub = parser.add_subparsers(dest="command", required=True)
    add_audit_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
