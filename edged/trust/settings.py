"""[security]: which model files edged loads (edged.trust)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES = ("off", "warn", "enforce")
SIGNATURE_SUFFIX = ".sig"  # a model's signature by default: <model file>.sig beside it


@dataclass(frozen=True)
class SecurityConfig:
    # off: load any file; warn: check, load anyway, say what failed (log, status, audit);
    # enforce: load only a file whose signature verifies with a trusted key or certificate,
    # or whose sha256 is the one pinned for it ([[models]] sha256).
    models: str = "off"
    # Public keys (PEM, elliptic curve) whose signatures are trusted: `edgectl sign --key`'s
    # private halves.
    trusted_keys: tuple[Path, ...] = ()
    # Certificate chains (PEM) that signing certificates must lead to.
    trusted_certificates: tuple[Path, ...] = ()

    @property
    def checking(self) -> bool:
        return self.models != "off"
