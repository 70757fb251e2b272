"""The audit as edged's config sees it: the options its checks read from the config ([audit]
trim/keep, SCHED_FIFO models, the models' CPUs as the inference cores), and the short
summary the daemon publishes on the retained `audit` topic (what `edgectl audit --config`
reports, counted). Here, below the CLI and the daemon, because both run it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sysconf.audit import report, runner
from sysconf.audit.findings import AuditContext

if TYPE_CHECKING:
    from edged.config.schema import Config
    from sysconf.sysroot import SysRoot


def audit_options(config: Config) -> dict[str, Any]:
    """What the checks read from edged's config: [audit] trim/keep, whether a model runs
    SCHED_FIFO (KRN-SCHED-RT-RUNTIME), and each model file's trust verdict (MDL-TRUST)."""
    return {
        "trim": list(config.audit.trim),
        "keep": list(config.audit.keep),
        "realtime": any(mc.rt_priority for mc in config.models),
        "model_trust": model_trust(config),
    }


def model_trust(config: Config) -> dict[str, Any]:
    """[security] models and the verdict on every configured model file (edged.trust), as the
    MDL check reads them. In the daemon the active policy's cached verdicts answer (a stat per
    file); `edgectl audit --config` hashes each file once."""
    from edged.trust.verify import for_config

    security = config.security
    if not security.checking:
        return {"mode": security.models, "verdicts": []}
    trust = for_config(security)
    verdicts = []
    for mc in config.models:
        files = [(mc.path, mc.sha256, mc.signature), *((v, None, None) for v in mc.variants)]
        for path, pin, signature in files:
            verdict = trust.check(path, pin, signature)
            verdicts.append({"model": mc.name, **verdict.to_dict()})
        verdicts += [{"model": mc.name, **v.to_dict()} for v in trust.made_from(mc.path)]
    return {"mode": security.models, "verdicts": verdicts}


def model_cpus(config: Config) -> list[int]:
    return sorted({cpu for mc in config.models for cpu in (mc.cpus or ())})


def audit_summary(
    config: Config, root: SysRoot | None = None, with_model_cpus: bool = True
) -> dict[str, Any]:
    """What `edgectl audit --config` reports, as a short summary for the retained `audit`
    topic: counts by status and by level (the lesser of status and severity, as the audit's
    exit code counts), the ids failing and warning, when it ran. Read-only on `root`.
    `with_model_cpus`: the models' cpus are the inference cores (as with --config)."""
    from sysconf.sysroot import SysRoot

    root = root or SysRoot()
    options = audit_options(config)
    inference = model_cpus(config)
    if inference and with_model_cpus:
        options["inference_cpus"] = inference
    start = time.perf_counter()
    findings = runner.run(AuditContext(root=root, options=options)).findings
    levels = [report.level(f) for f in findings]
    return {
        "ts": round(time.time(), 3),
        "root": str(root.root),
        "findings": len(findings),
        "statuses": report.summary(findings),
        "levels": {name: levels.count(rank) for rank, name in enumerate(("ok", "warn", "fail"))},
        "failing": sorted({f.id for f, lv in zip(findings, levels, strict=True) if lv == 2}),
        "warning": sorted({f.id for f, lv in zip(findings, levels, strict=True) if lv == 1}),
        "duration_s": round(time.perf_counter() - start, 3),
    }
