"""Sigstore signatures checked offline against a local trust root: the real `sigstore`
verifier, through model-signing, on bundles issued by a private Sigstore instance made in
the test (tests/support/private_sigstore.py says what it issues and why by hand)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edged.cli.main import main
from edged.config import ConfigError, parse_config
from edged.trust.settings import SecurityConfig
from edged.trust.verify import ModelTrust, UntrustedModel
from tests.support.model_keys import flip_one_byte
from tests.support.private_sigstore import PrivateSigstore

WORKFLOW = "https://github.com/acme/models/.github/workflows/release.yml@refs/heads/main"
ACTIONS = "https://token.actions.githubusercontent.com"


@pytest.fixture
def signed(models_dir: Path, tmp_path: Path) -> tuple[Path, PrivateSigstore]:
    model = tmp_path / "cls.onnx"
    shutil.copyfile(models_dir / "ppocr_cls.onnx", model)
    instance = PrivateSigstore(tmp_path / "sigstore")
    instance.sign(model, tmp_path / "cls.onnx.sig", WORKFLOW, ACTIONS)
    return model, instance


def verify(capsys, model: Path, root: Path, identity: str, issuer: str) -> tuple[int, dict]:
    capsys.readouterr()
    flags = ["--sigstore-trust-root", str(root), "--identity", identity, "--issuer", issuer]
    code = main(["verify", str(model), *flags, "--json"])
    return code, json.loads(capsys.readouterr().out)["models"][0]


def test_a_sigstore_bundle_verifies_offline_for_its_signer_only(signed, tmp_path, capsys) -> None:
    model, instance = signed
    root = instance.trust_root()
    code, verdict = verify(capsys, model, root, WORKFLOW, ACTIONS)
    assert code == 0 and verdict["state"] == "verified" and verdict["signer"] == WORKFLOW
    # A client trust config wrapping the same root is taken as it is.
    code, verdict = verify(
        capsys, model, instance.trust_root(client_config=True), WORKFLOW, ACTIONS
    )
    assert code == 0 and verdict["state"] == "verified"
    code, verdict = verify(capsys, model, root, "https://github.com/evil/fork", ACTIONS)
    assert code == 1 and "SANs do not match https://github.com/evil/fork" in verdict["reason"]
    code, verdict = verify(capsys, model, root, WORKFLOW, "https://accounts.example.com")
    assert code == 1 and "OIDCIssuer does not match" in verdict["reason"]
    # Issued by another instance: its certificate does not chain to this root.
    stranger = PrivateSigstore(tmp_path / "stranger").trust_root()
    code, verdict = verify(capsys, model, stranger, WORKFLOW, ACTIONS)
    assert code == 1 and "certificate chain" in verdict["reason"]
    flip_one_byte(model)
    code, verdict = verify(capsys, model, root, WORKFLOW, ACTIONS)
    assert code == 1 and "not the one that was signed" in verdict["reason"]
    assert main(["verify", str(model), "--sigstore-trust-root", str(root)]) == 2
    assert (
        "Sigstore needs --sigstore-trust-root, --identity and --issuer" in capsys.readouterr().err
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --net needs root")
def test_the_check_needs_no_network(signed) -> None:
    model, instance = signed
    flags = ["--sigstore-trust-root", str(instance.trust_root())]
    flags += ["--identity", WORKFLOW, "--issuer", ACTIONS]
    run = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "edged.cli.main", "verify", str(model), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert f"VERIFIED by {WORKFLOW}" in run.stdout


def test_enforce_with_sigstore_signers(signed, tmp_path: Path) -> None:
    model, instance = signed
    root = instance.trust_root()
    signer = f'{{ identity = "{WORKFLOW}", issuer = "{ACTIONS}" }}'
    table = f'[security]\nmodels = "enforce"\nsigstore_trust_root = "{root}"\n'
    base = f'[[models]]\nname = "cls"\npath = "{model}"\n'
    config = parse_config(f"{table}sigstore_signers = [{signer}]\n{base}", tmp_path / "e.toml")
    assert config.security.sigstore == (root, ((WORKFLOW, ACTIONS),))  # no pin needed
    trust = ModelTrust(config.security)
    assert trust.require(model, what="model cls").signer == WORKFLOW
    other = ModelTrust(SecurityConfig("enforce", (), (), root, (("ci@acme.test", ACTIONS),)))
    with pytest.raises(UntrustedModel, match=r"sigstore ci@acme\.test .* SANs do not match"):
        other.require(model, what="model cls")

    def error(text: str) -> str:
        with pytest.raises(ConfigError) as info:
            parse_config(text + base, tmp_path / "e.toml")
        return str(info.value)

    assert "security.sigstore_signers: Sigstore needs a trust root and its signers" in error(table)
    not_root = tmp_path / "other.json"
    not_root.write_text('{"mediaType": "application/vnd.in-toto+json"}')
    assert "is neither a Sigstore trusted root nor a client trust config" in error(
        f'[security]\nsigstore_trust_root = "{not_root}"\nsigstore_signers = [{signer}]\n'
    )
    assert "security.sigstore_signers[0]: identity and issuer must both be given" in error(
        f'{table}sigstore_signers = [{{ identity = "", issuer = "{ACTIONS}" }}]\n'
    )
