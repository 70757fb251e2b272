"""The [security] table (edged.trust's settings), checked against the models it covers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edged.config.checks import Checker, Table, show
from edged.trust.settings import MODES as SECURITY_MODES
from edged.trust.settings import SecurityConfig


def security(check: Checker, data: Mapping[str, Any]) -> SecurityConfig:
    """[security]: which model files load (edged.trust); `checkable` then holds the models
    to it. Read before the models, so that under enforce their checks read no byte of a
    file that is not trusted (`Checker.may_read`, set by `gate`)."""
    t = Table(check, data, "security", SecurityConfig)
    mode = t.string("models")
    if mode not in SECURITY_MODES:
        raise check.fail(
            "security.models", f"expected one of {', '.join(SECURITY_MODES)}, got {show(mode)}"
        )
    files = {}
    for key in ("trusted_keys", "trusted_certificates"):
        value = t.get(key)
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise check.fail(f"security.{key}", "must be a list of PEM file paths")
        paths = []
        for index, raw in enumerate(value):
            path = check.path(raw, f"security.{key}[{index}]")
            if not path.is_file():
                raise check.fail(f"security.{key}[{index}]", f"no such file: {path}")
            paths.append(path)
        files[key] = tuple(paths)
    sigstore_root, signers = _sigstore(check, t)
    return SecurityConfig(
        mode, files["trusted_keys"], files["trusted_certificates"], sigstore_root, signers
    )


def gate(check: Checker, config: SecurityConfig) -> None:
    """Under enforce, the model checks read a file only once it is trusted (verified,
    pinned): an untrusted one is left unread, and refused when the daemon loads it."""
    if config.models != "enforce":
        return
    from edged.trust.verify import for_config

    trust = for_config(config)
    check.may_read = lambda path, pin, signature: trust.check(path, pin, signature).trusted


def checkable(check: Checker, config: SecurityConfig, models: tuple) -> None:
    """Under enforce, every model must be checkable: a trusted key, certificate chain or
    Sigstore signer, or its own sha256 pin."""
    if config.models == "enforce" and not config.signers:
        unpinned = [f"models[{i}] ({m.name})" for i, m in enumerate(models) if m.sha256 is None]
        if unpinned:
            raise check.fail(
                "security.models",
                "enforce with no trusted_keys, trusted_certificates or Sigstore signers needs "
                f"a sha256 on every model; none on {', '.join(unpinned)}",
            )


TRUST_ROOT_TYPES = (
    "application/vnd.dev.sigstore.trustedroot+json",
    "application/vnd.dev.sigstore.clienttrustconfig",
)


def _sigstore(check: Checker, t: Table) -> tuple[Path | None, tuple[tuple[str, str], ...]]:
    """sigstore_trust_root (a trusted_root.json or a client trust config: its media type is
    checked here, its keys by the verifier) and sigstore_signers ([{identity, issuer}]):
    both or neither."""
    raw_root, raw_signers = t.get("sigstore_trust_root"), t.get("sigstore_signers")
    if raw_root is None and not raw_signers:
        return None, ()
    if raw_root is None or not raw_signers:
        missing = "sigstore_signers" if raw_root is not None else "sigstore_trust_root"
        raise check.fail(f"security.{missing}", "Sigstore needs a trust root and its signers")
    key = "security.sigstore_trust_root"
    root = check.path(check.string(raw_root, key), key)
    try:
        media = json.loads(root.read_text()).get("mediaType", "")
    except (OSError, ValueError, AttributeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a JSON object"
        raise check.fail(key, f"{root}: {why}") from None
    if not str(media).startswith(TRUST_ROOT_TYPES):
        raise check.fail(
            key,
            f"{root}: mediaType {show(media)} is neither a Sigstore trusted root nor a client "
            "trust config",
        )
    if not isinstance(raw_signers, list | tuple):
        raise check.fail("security.sigstore_signers", "must be a list of {identity, issuer}")
    signers = []
    for index, entry in enumerate(raw_signers):
        key = f"security.sigstore_signers[{index}]"
        if not isinstance(entry, Mapping):
            raise check.fail(key, 'expected { identity = "...", issuer = "https://..." }')
        check.keys(entry, key, ("identity", "issuer"))
        identity = check.string(entry.get("identity"), f"{key}.identity")
        issuer = check.string(entry.get("issuer"), f"{key}.issuer")
        if not identity or not issuer:
            raise check.fail(key, "identity and issuer must both be given")
        signers.append((identity, issuer))
    return root, tuple(signers)
