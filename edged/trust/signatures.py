"""A model's signature checked with OpenSSF model-signing (PyPI `model-signing`, the extra
`edged[signing]`): key mode (elliptic-curve public keys), certificate mode (a chain) and
Sigstore against a local trust root (the bundle's certificate, SCT and log entry are checked
with the root's keys: no network). The library is imported here only, when a signature is
checked, so the core install and edgectl's light commands never load it (it pulls in
sigstore)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

INSTALL_HINT = "signature checks need the model-signing library: pip install 'edged[signing]'"


class SignatureError(Exception):
    """The signature does not verify (the reason, one line), or cannot be checked."""


def _library():
    try:
        from model_signing import signing, verifying
    except ImportError as exc:
        raise SignatureError(f"{INSTALL_HINT} ({exc})") from None
    return signing, verifying


def _reason(exc: BaseException) -> str:
    """The library's reason, said plainly where it is one of the usual ones (its own text
    for a changed file is a repr of digest bytes)."""
    text = str(exc)
    if "Hash mismatch" in text or "Signature mismatch" in text:
        return "the file is not the one that was signed (its content changed)"
    if "Key mismatch" in text:
        return "signed with another key (Key mismatch)"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first[:300] + ("..." if len(first) > 300 else "")


Signers = tuple[tuple[str, str], ...]  # Sigstore: (identity, OIDC issuer)


def verify(
    model: Path,
    signature: Path,
    keys: Sequence[Path],
    certificates: Sequence[Path],
    sigstore: tuple[Path, Signers] | None = None,
) -> str:
    """The signer (the trusted key's or chain's file name, or the Sigstore identity) whose
    signature `signature` is for this exact `model` file; SignatureError with the reason
    otherwise. `sigstore`: (local trust root, the signers accepted from it)."""
    if not keys and not certificates and sigstore is None:
        raise SignatureError(
            f"{signature} is there, but [security] names no trusted_keys, "
            "trusted_certificates or Sigstore signers to check it with"
        )
    _, verifying = _library()
    reasons = []
    for key in keys:
        try:
            verifying.Config().use_elliptic_key_verifier(public_key=key).verify(model, signature)
            return key.name
        except Exception as exc:  # the library raises ValueError and others: all are "no"
            reasons.append(f"key {key.name}: {_reason(exc)}")
    if certificates:
        try:
            config = verifying.Config().use_certificate_verifier(certificate_chain=certificates)
            config.verify(model, signature)
            return ", ".join(c.name for c in certificates)
        except Exception as exc:
            reasons.append(f"certificates: {_reason(exc)}")
    if sigstore is not None:
        root, signers = sigstore
        with tempfile.TemporaryDirectory(prefix="edged-sigstore-") as folder:
            trust_config = _client_trust_config(root, Path(folder))
            for identity, issuer in signers:
                try:
                    verifying.Config().use_sigstore_verifier(
                        identity=identity, oidc_issuer=issuer, trust_config=trust_config
                    ).verify(model, signature)
                    return identity
                except Exception as exc:
                    reasons.append(f"sigstore {identity} ({issuer}): {_reason(exc)}")
    raise SignatureError("; ".join(reasons))


# A client trust config that only verifies: the library reads the trust root from it, and
# its format requires a signing config (services to sign with), which a device never uses.
VERIFY_ONLY_SIGNING_CONFIG = {
    "mediaType": "application/vnd.dev.sigstore.signingconfig.v0.2+json",
    "caUrls": [],
    "oidcUrls": [],
    "rekorTlogUrls": [],
    "tsaUrls": [],
    "rekorTlogConfig": {"selector": "ANY"},
    "tsaConfig": {"selector": "ANY"},
}


def _client_trust_config(root: Path, folder: Path) -> Path:
    """`root` as model-signing takes it: a client trust config as it is, a bare trusted root
    (what Sigstore instances publish) wrapped in one, in `folder`."""
    try:
        doc = json.loads(root.read_text())
    except (OSError, ValueError) as exc:
        raise SignatureError(f"Sigstore trust root {root}: {exc}") from None
    if str(doc.get("mediaType", "")).startswith("application/vnd.dev.sigstore.clienttrust"):
        return root
    wrapped = folder / "trust_config.json"
    wrapped.write_text(
        json.dumps(
            {
                "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
                "trustedRoot": doc,
                "signingConfig": VERIFY_ONLY_SIGNING_CONFIG,
            }
        )
    )
    return wrapped


def sign(model: Path, signature: Path, private_key: Path, password: str | None = None) -> None:
    """Sign `model` with an elliptic-curve private key (PEM) into `signature`."""
    signing, _ = _library()
    try:
        signing.Config().use_elliptic_key_signer(private_key=private_key, password=password).sign(
            model, signature
        )
    except SignatureError:
        raise
    except Exception as exc:
        raise SignatureError(
            f"cannot sign {model} with {private_key}: {_first_line(exc)}"
        ) from None
