"""Audit reports: grouped text, JSON, JUnit XML, SARIF 2.1.0, the per-check stats, and the
exit code CI keys on.

Exit codes: 0 nothing at or above the threshold (--fail-on), 1 findings at or above it (2, a
usage or input error, is the caller's). A finding's level is the lesser of its status and its
severity: an `info` finding never fails the audit, a `fail`-severity check that only warns
counts as warn. A check that crashed (status `error`) counts as fail: the audit is incomplete.
"""

from __future__ import annotations

import hashlib
import json
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from sysconf.audit.findings import STATUSES, Finding
from sysconf.audit.runner import CheckStats

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
FORMATS = ("text", "json", "junit", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_RANK = {"info": 0, "pass": 0, "skip": 0, "warn": 1, "fail": 2, "error": 2}
_SARIF_LEVEL = {"info": "note", "warn": "warning", "fail": "error"}
_COLOURS = {"pass": "32", "warn": "33", "fail": "31", "skip": "2", "error": "35"}


def summary(findings: Iterable[Finding]) -> dict[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for finding in findings:
        counts[finding.status] += 1
    return counts


def level(finding: Finding) -> int:
    """0 ok/info, 1 warn, 2 fail: the lesser of status and severity (error counts as fail)."""
    if finding.status == "error":
        return 2
    return min(_RANK[finding.status], _RANK[finding.severity])


def exit_code(findings: Sequence[Finding], fail_on: str = "fail") -> int:
    threshold = _RANK[fail_on]
    return EXIT_FAILED if any(level(f) >= threshold for f in findings) else EXIT_OK


def render(
    findings: Sequence[Finding],
    fmt: str,
    colour: bool = False,
    sections: Mapping[str, int] | None = None,
    stats: Sequence[CheckStats] | None = None,
) -> str:
    """`sections`: the text report's section order (`runner.sections()`); `stats`: put into
    the JSON report as "checks" (the other formats leave them to `render_stats`)."""
    if fmt == "json":
        return render_json(findings, stats)
    if fmt == "junit":
        return render_junit(findings)
    if fmt == "sarif":
        return render_sarif(findings)
    return render_text(findings, colour, sections)


def _prefix(finding: Finding) -> str:
    return finding.id.split("-", 1)[0]


def render_text(
    findings: Sequence[Finding], colour: bool = False, sections: Mapping[str, int] | None = None
) -> str:
    """Findings grouped by id prefix, the groups in `sections` order (others after them, in
    the order they come)."""

    def tag(status: str) -> str:
        word = f"[{status.upper():5}]"
        return f"\033[{_COLOURS[status]}m{word}\033[0m" if colour else word

    groups: dict[str, list[Finding]] = {}
    for f in findings:
        groups.setdefault(_prefix(f), []).append(f)
    order = sections or {}
    lines: list[str] = []
    for prefix, items in sorted(groups.items(), key=lambda g: order.get(g[0], float("inf"))):
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


def _stats_dict(stats: CheckStats) -> dict[str, Any]:
    data = asdict(stats)
    data["seconds"] = round(stats.seconds, 6)
    return data


def render_json(findings: Sequence[Finding], stats: Sequence[CheckStats] | None = None) -> str:
    report: dict[str, Any] = {
        "findings": [f.to_dict() for f in findings],
        "summary": summary(findings),
    }
    if stats is not None:
        report["checks"] = [_stats_dict(s) for s in stats]
    return json.dumps(report, indent=2) + "\n"


def render_stats(stats: Sequence[CheckStats]) -> str:
    """One row per check run: its name, whether it ran to its end, seconds, findings."""
    width = max([len("check"), *(len(s.check) for s in stats)])
    lines = [f"{'check':<{width}}  ok    seconds  findings"]
    lines += [
        f"{s.check:<{width}}  {'yes' if s.ok else 'no':3}  {s.seconds:8.6f}  {s.findings:8d}"
        for s in stats
    ]
    return "\n".join(lines) + "\n"


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
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="edgectl audit",
        tests=str(len(findings)),
        failures=str(counts["warn"] + counts["fail"]),
        errors=str(counts["error"]),
        skipped=str(counts["skip"]),
    )
    for f in findings:
        case = ET.SubElement(
            suite, "testcase", classname=f"edgectl.audit.{_prefix(f)}", name=_case_name(f)
        )
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
        rules.append(
            {
                "id": f.id,
                "name": f.id.title().replace("-", ""),
                "shortDescription": {"text": f.title if not f.subject else f.id},
                "defaultConfiguration": {"level": _SARIF_LEVEL[f.severity]},
                "properties": {"fixable": f.fixable},
            }
        )
    results = []
    for f in findings:
        if f.status not in ("warn", "fail"):
            continue
        result: dict[str, Any] = {
            "ruleId": f.id,
            "ruleIndex": index[f.id],
            "level": "error" if f.status == "fail" else "warning",
            "message": {"text": f.title + (f"\n{_detail(f)}" if f.evidence or f.remedy else "")},
            "partialFingerprints": {"edgedFindingHash/v1": fingerprint(f)},
            "properties": {"subject": f.subject, "fixable": f.fixable, "remedy": f.remedy},
        }
        if f.evidence:
            result["locations"] = [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": e.path.lstrip("/") or ".", "uriBaseId": "ROOT"}
                    },
                    "message": {"text": f"observed {e.observed!r}, expected {e.expected!r}"},
                }
                for e in f.evidence
            ]
        results.append(result)
    errors = [f for f in findings if f.status == "error"]
    sarif = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": "edgectl audit", "rules": rules}},
                "invocations": [
                    {
                        "executionSuccessful": not errors,
                        "toolExecutionNotifications": [
                            {
                                "level": "error",
                                "message": {"text": f.title},
                                "descriptor": {"id": f.id},
                            }
                            for f in errors
                        ],
                    }
                ],
                "results": results,
            }
        ],
    }
    return json.dumps(sarif, indent=2) + "\n"
