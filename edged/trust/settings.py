"""[security]: which model files edged loads (edged.trust)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES = ("off", "warn", "enforce")
SIGNATURE_SUFFIX = ".sig"  # a model's signature by default: <model file>.sig beside it


@dataclass(frozen=True)
class SecurityConfig:
    # off: load any file; warn: check, load anyway, say what failed (log, status, audit);
    # enforce: load only a file whose signature verifies with a trusted key, certificate
    # or Sigstore signer, or whose sha256 is the one pinned for it ([[models]] sha256).
    models: str = "off"
    # Public keys (PEM, elliptic curve) whose signatures are trusted: `edgectl sign --key`'s
    # private halves.
    trusted_keys: tuple[Path, ...] = ()
    # Certificate chains (PEM) that signing certificates must lead to.
    trusted_certificates: tuple[Path, ...] = ()
    # Sigstore, offline: a local trust root (trusted_root.json, or a client trust config
    # wrapping one: the public instance's or an organisation's own), and the signers accepted
    # from it, each (identity, OIDC issuer): a CI workflow's URI or an e-mail address.
    sigstore_trust_root: Path | None = None
    sigstore_signers: tuple[tuple[str, str], ...] = ()

    @property
    def sigstore(self) -> tuple[Path, tuple[tuple[str, str], ...]] | None:
        if self.sigstore_trust_root is None or not self.sigstore_signers:
            return None
        return self.sigstore_trust_root, self.sigstore_signers

    @property
    def signers(self) -> bool:
        """Some signature can be checked: a key, a certificate chain or Sigstore."""
        return bool(self.trusted_keys or self.trusted_certificates or self.sigstore)

    @property
    def checking(self) -> bool:
        return self.models != "off"
