"""The [security] table (edged.trust's settings), checked against the models it covers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edged.config.checks import Checker, Table, show
from edged.trust.settings import MODES as SECURITY_MODES
from edged.trust.settings import SecurityConfig


def security(check: Checker, data: Mapping[str, Any], models: tuple) -> SecurityConfig:
    """[security]: which model files load (edged.trust). Under enforce, every model must be
    checkable: a trusted key or certificate chain, or its own sha256 pin."""
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
    if mode == "enforce" and not any(files.values()):
        unpinned = [f"models[{i}] ({m.name})" for i, m in enumerate(models) if m.sha256 is None]
        if unpinned:
            raise check.fail(
                "security.models",
                "enforce with no trusted_keys or trusted_certificates needs a sha256 on every "
                f"model; none on {', '.join(unpinned)}",
            )
    return SecurityConfig(mode, files["trusted_keys"], files["trusted_certificates"])
