"""MDL: whether each model file edged serves is one it can trust ([security] models).

The verdicts are edged's (edged.trust, which checks digests and signatures): the caller puts
them in `AuditContext.options["model_trust"]` as plain data, `{"mode": "off"|"warn"|"enforce",
"verdicts": [{"model", "path", "state", "reason"}, ...]}`, so this check knows nothing of
inference. Without it (`edgectl audit` with no --config) the check says it was not asked.
"""

from __future__ import annotations

from collections.abc import Iterator

from sysconf.audit.findings import AuditContext, Catalogue, Evidence, Finding, Rule, register

CATALOGUE = Catalogue(
    prefix="MDL",
    sections={"MDL": 70},
    rules={
        # unsigned under warn: it loads, nobody vouches for it; failed: the file is not the
        # one that was signed or pinned (it loads under warn, is refused under enforce)
        "MDL-TRUST": Rule("warn", "every model file is signed or pinned", escalated="fail"),
    },
)
_finding = CATALOGUE.finding
_TRUSTED = ("verified", "pinned", "derived")
_SIGN = "sign it in CI (edgectl sign MODEL --key KEY) or pin its sha256 in [[models]]"


@register("models", CATALOGUE, order=50)
def check_models(ctx: AuditContext) -> Iterator[Finding]:
    trust = ctx.options.get("model_trust")
    if trust is None:
        yield _finding("MDL-TRUST", "skip", "no edged config given (--config): models not checked")
        return
    mode = trust.get("mode", "off")
    if mode == "off":
        yield _finding(
            "MDL-TRUST",
            "skip",
            "[security] models = off: model files are loaded unchecked",
            evidence=(Evidence("[security] models", "off", "warn or enforce"),),
            remedy='set [security] models = "warn" (then "enforce" once every model is signed)',
        )
        return
    for verdict in trust.get("verdicts", ()):
        state, path = verdict["state"], verdict["path"]
        label = f"model {verdict['model']}: {path}"
        if state in _TRUSTED:
            yield _finding(
                "MDL-TRUST",
                "pass",
                f"{label} is {state}",
                evidence=(Evidence(path, state, "verified, pinned or derived"),),
                subject=path,
            )
            continue
        refused = mode == "enforce"
        what = "is refused (enforce)" if refused else "loads unchecked (warn)"
        yield _finding(
            "MDL-TRUST",
            "fail" if state == "failed" or refused else "warn",
            f"{label} {what}: {state}: {verdict.get('reason') or ''}".rstrip(": "),
            escalated=state == "failed" or refused,
            evidence=(Evidence(path, f"{state}: {verdict.get('reason') or ''}", "trusted"),),
            remedy=_SIGN
            if state == "unsigned"
            else f"replace {path} with the signed file, "
            "or sign this one again if the change is meant",
            subject=path,
        )
