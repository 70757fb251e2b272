"""The verdict on one model file, and the policy that acts on it.

A file is **verified** when its signature (by default `<file>.sig` beside it) verifies with a
trusted key, certificate chain or Sigstore signer, **pinned** when it has no signature but
its sha256 is the one the config pins for it, **unsigned** when it has neither, and
**failed** when the pin or the signature says it is not the file that was signed (or it
cannot be read). Under "enforce" only verified and pinned files load; under "warn" every
file loads and the others are said (log, status); "off" checks nothing.

`ModelTrust` keeps each file's verdict with the file's identity (sysconf-free: dev, inode,
size, times) and the signature's, so a verdict is computed once per change of either file:
every load asks again (start, reload, repository load, fail-over, switch-back, standby),
which costs a stat when nothing changed. The daemon sets the active policy (`activate`) at
start and on each reload; the loading code calls `active().require(...)`."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.errors import ModelError
from edged.trust.digests import Digests, identity
from edged.trust.settings import SIGNATURE_SUFFIX, SecurityConfig
from edged.trust.signatures import SignatureError, verify

log = logging.getLogger("edged.trust")
TRUSTED = ("verified", "pinned", "derived")


class UntrustedModel(ModelError):
    """Under enforce: this file is not to be loaded (the message names it and why). A
    ModelError, so every load path treats it as the model file's fault."""


@dataclass(frozen=True)
class Verdict:
    path: str
    state: str  # "verified", "pinned", "derived", "unsigned", "failed" ("off": not checked)
    sha256: str | None = None
    signer: str | None = None
    signature: str | None = None
    reason: str = ""

    @property
    def trusted(self) -> bool:
        return self.state in TRUSTED

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "state": self.state,
            "sha256": self.sha256,
            "signer": self.signer,
            "signature": self.signature,
            "reason": self.reason or None,
        }


def signature_of(model: Path, configured: Path | None = None) -> Path:
    return configured or model.with_name(model.name + SIGNATURE_SUFFIX)


def _id(path: Path) -> tuple | None:
    try:
        return identity(path)
    except OSError:
        return None


class ModelTrust:
    def __init__(self, config: SecurityConfig | None = None) -> None:
        self.config = config or SecurityConfig()
        self.digests = Digests()
        self._verdicts: dict[tuple, Verdict] = {}
        self._said: set[Verdict] = set()  # warned about already (warn mode)
        # The configured files and what they are checked with (pin, signature), so a later
        # load of the same file (fail-over, switch-back, standby) is checked alike.
        self._files: dict[str, tuple[str | None, Path | None, str]] = {}
        # Variants made on the device: their original, and their last verdict (status).
        self._made: dict[str, tuple[Path, str]] = {}
        self.made_verdicts: dict[str, Verdict] = {}
        self._lock = threading.Lock()

    def check(
        self, path: Path, sha256: str | None = None, signature: Path | None = None
    ) -> Verdict:
        """The verdict on `path` (module docstring); computed again only when the file, its
        signature, the pin or the trusted keys changed."""
        if not self.config.checking:
            return Verdict(str(path), "off")
        sig = signature_of(path, signature)
        key = (str(path), _id(path), str(sig), _id(sig), sha256)
        with self._lock:
            known = self._verdicts.get(key)
        if known is not None:
            return known
        verdict = self._compute(path, sha256, sig)
        with self._lock:
            self._verdicts[key] = verdict
        return verdict

    def _compute(self, path: Path, pin: str | None, sig: Path) -> Verdict:
        try:
            digest = self.digests.sha256(path)
        except OSError as exc:
            return Verdict(str(path), "failed", reason=f"cannot be read: {exc.strerror or exc}")
        if pin is not None and digest != pin.lower():
            return Verdict(
                str(path),
                "failed",
                digest,
                reason=f"sha256 mismatch: the config pins {pin.lower()}, the file has {digest}",
            )
        if _id(sig) is not None:
            try:
                signer = verify(
                    path,
                    sig,
                    self.config.trusted_keys,
                    self.config.trusted_certificates,
                    self.config.sigstore,
                )
            except SignatureError as exc:
                return Verdict(str(path), "failed", digest, None, str(sig), f"signature: {exc}")
            return Verdict(str(path), "verified", digest, signer, str(sig))
        if pin is not None:
            return Verdict(str(path), "pinned", digest, reason="no signature; sha256 as pinned")
        return Verdict(
            str(path), "unsigned", digest, reason=f"no signature ({sig}) and no sha256 pin"
        )

    def require(
        self, path: Path, sha256: str | None = None, signature: Path | None = None, what: str = ""
    ) -> Verdict:
        """The verdict, acted on: UntrustedModel under enforce when the file is not trusted;
        a warning under warn (once per verdict)."""
        with self._lock:
            self._files[str(path)] = (sha256, signature, what)
        return self._act(self.check(path, sha256, signature), what)

    def require_made(self, path: Path, original: Path, what: str = "") -> Verdict:
        """A variant made on the device (edged.quantize.variants): "derived" while its
        manifest's provenance names the original as it is now, that original is trusted,
        and the file is the one the manifest recorded; acted on as `require`."""
        with self._lock:
            self._made[str(path)] = (original, what)
        verdict = self._made_verdict(path, original) if self.config.checking else None
        if verdict is None:
            return Verdict(str(path), "off")
        with self._lock:
            self.made_verdicts[str(path)] = verdict
        return self._act(verdict, what)

    def made_from(self, original: Path) -> list[Verdict]:
        """The last verdicts on the variants made on the device from `original`."""
        with self._lock:
            return [
                self.made_verdicts[path]
                for path, (source, _) in sorted(self._made.items())
                if source == original and path in self.made_verdicts
            ]

    def _made_verdict(self, path: Path, original: Path) -> Verdict:
        manifest = path.parent / "manifest.json"
        try:
            doc = json.loads(manifest.read_text())
            recorded = doc["sha256"][path.name]
            made_from = doc["provenance"]["original_sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            why = f"no provenance in {manifest} (remove {path.parent} to make it again)"
            return Verdict(str(path), "failed", reason=why)
        try:
            digest = self.digests.sha256(path)
            now = self.digests.sha256(original)
        except OSError as exc:
            return Verdict(str(path), "failed", reason=f"cannot be read: {exc.strerror or exc}")
        if digest != recorded:
            return Verdict(str(path), "failed", digest, reason="changed since it was made")
        if made_from != now:
            why = f"made from another original (sha256 {made_from}), not {original} as it is now"
            return Verdict(str(path), "failed", digest, reason=why)
        with self._lock:
            pin, signature, _ = self._files.get(str(original), (None, None, ""))
        source = self.check(original, pin, signature)
        if not source.trusted:
            why = f"its original {original} is not trusted: {source.state}: {source.reason}"
            return Verdict(str(path), "failed", digest, reason=why)
        by = f"made on this device from {original.name} ({source.state})"
        return Verdict(str(path), "derived", digest, by, str(manifest), "provenance checked")

    def _act(self, verdict: Verdict, what: str) -> Verdict:
        if verdict.state == "off" or verdict.trusted:
            return verdict
        path = verdict.path
        message = f"{what + ': ' if what else ''}{path}: {verdict.state}: {verdict.reason}"
        if self.config.models == "enforce":
            raise UntrustedModel(f"refused by [security] models = enforce: {message}")
        with self._lock:
            fresh = verdict not in self._said
            self._said.add(verdict)
        if fresh:
            log.warning("[security] models = warn: loading anyway: %s", message)
        return verdict

    def recheck(self, path: Path) -> Verdict | None:
        """Before a session of `path` is loaded again: the configured file checked as at its
        first load (a stat when unchanged), a variant made on the device by its provenance.
        None for a file neither names (a compiled cache the runtime keeps)."""
        with self._lock:
            known = self._files.get(str(path))
            made = self._made.get(str(path))
        if made is not None:
            return self.require_made(path, made[0], made[1])
        if known is None:
            return None
        return self.require(path, known[0], known[1], known[2])


_active = ModelTrust()


def active() -> ModelTrust:
    """The daemon's policy (off until `activate`)."""
    return _active


_prepared: ModelTrust | None = None  # the last `for_config` policy, for `activate`


def for_config(config: SecurityConfig) -> ModelTrust:
    """The policy `activate(config)` will make active: the active one when `config` is its
    own, else a new one sharing its digests (a file's digest does not depend on the
    policy). The config's checks ask it, so a file hashed and verified for them is not
    hashed nor verified again when the daemon loads it."""
    global _prepared
    if config == _active.config:
        return _active
    if _prepared is None or _prepared.config != config:
        _prepared = ModelTrust(config)
        _prepared.digests = _active.digests
    return _prepared


def activate(config: SecurityConfig) -> ModelTrust:
    """Make `config` the policy every load asks (at start and on each reload); verdicts and
    digests already computed are kept when the keys did not change."""
    global _active, _prepared
    if config != _active.config:
        fresh = for_config(config)
        fresh._files = dict(_active._files)
        fresh._made = dict(_active._made)
        _active, _prepared = fresh, None
    return _active
