"""Model files checked before they load (edged.trust): a real signature made by `edgectl
sign` with an elliptic-curve key (OpenSSF model-signing) on a real model, verified, and
refused once one byte changes, with another key, or against a wrong sha256 pin; digests are
computed once per change of the file; the [security] table's errors name the key."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from backends import probe_hardware
from edged.cli.main import main
from edged.config import ConfigError, parse_config
from edged.serving.model_set import load_models
from edged.trust.settings import SecurityConfig
from edged.trust.verify import ModelTrust, UntrustedModel, activate
from tests.support.model_keys import flip_one_byte, make_key


@pytest.fixture
def signed(models_dir: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the cls model, signed with `edgectl sign`: (model, private key, public key)."""
    model = tmp_path / "cls.onnx"
    shutil.copyfile(models_dir / "ppocr_cls.onnx", model)
    private, public = make_key(tmp_path, "ci")
    assert main(["sign", str(model), "--key", str(private)]) == 0
    assert (tmp_path / "cls.onnx.sig").is_file()
    return model, private, public


def verify(capsys, *args: str) -> tuple[int, dict]:
    code = main(["verify", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)["models"][0]


def test_sign_then_verify_and_what_fails(signed, tmp_path: Path, capsys) -> None:
    model, _, public = signed
    capsys.readouterr()
    code, verdict = verify(capsys, str(model), "--key", str(public))
    assert code == 0 and verdict["state"] == "verified" and verdict["signer"] == "ci.pub"
    assert len(verdict["sha256"]) == 64
    _, other = make_key(tmp_path, "other")
    code, verdict = verify(capsys, str(model), "--key", str(other))
    assert code == 1 and verdict["state"] == "failed"
    assert "key other.pub" in verdict["reason"] and "Key mismatch" in verdict["reason"]
    digest = verdict["sha256"]
    flip_one_byte(model)
    code, verdict = verify(capsys, str(model), "--key", str(public))
    assert code == 1 and verdict["state"] == "failed"
    assert "not the one that was signed" in verdict["reason"]
    assert verdict["sha256"] != digest
    # A pin alone: the signature file gone, the digest pinned.
    (tmp_path / "cls.onnx.sig").unlink()
    code, verdict = verify(capsys, str(model), "--sha256", verdict["sha256"])
    assert code == 0 and verdict["state"] == "pinned"
    code, verdict = verify(capsys, str(model), "--sha256", digest)
    assert code == 1 and "sha256 mismatch: the config pins" in verdict["reason"]
    code, verdict = verify(capsys, str(model), "--key", str(public))
    assert code == 1 and verdict["state"] == "unsigned"
    assert main(["verify", str(tmp_path / "none.onnx"), "--key", str(public)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_digests_once_per_change_and_the_policy(signed, caplog) -> None:
    model, _, public = signed
    trust = ModelTrust(SecurityConfig("enforce", (public,)))
    assert trust.require(model, what="model cls").state == "verified"
    assert trust.require(model).state == "verified" and trust.digests.hashed == 1
    flip_one_byte(model)
    with pytest.raises(UntrustedModel) as info:
        trust.require(model, what="model cls")
    assert str(model) in str(info.value) and "model cls" in str(info.value)
    assert trust.digests.hashed == 2
    with pytest.raises(UntrustedModel, match="not the one that was signed"):
        trust.recheck(model)  # a known file: checked as at its first load
    assert trust.recheck(model.with_name("made-on-device.onnx")) is None
    warn = ModelTrust(SecurityConfig("warn", (public,)))
    with caplog.at_level(logging.WARNING, "edged.trust"):
        assert warn.require(model).state == "failed"
        assert warn.require(model).state == "failed"
    assert len([r for r in caplog.records if "loading anyway" in r.message]) == 1
    assert ModelTrust().check(model).state == "off"  # off: nothing read


def test_the_security_table(signed, tmp_path: Path) -> None:
    model, _, public = signed
    base = f'[[models]]\nname = "cls"\npath = "{model}"\n'

    def error(text: str) -> str:
        with pytest.raises(ConfigError) as info:
            parse_config(text, tmp_path / "edged.toml")
        return str(info.value)

    assert "security.models: expected one of off, warn, enforce" in error(
        '[security]\nmodels = "strict"\n' + base
    )
    assert (
        "enforce with no trusted_keys, trusted_certificates or Sigstore signers needs a "
        "sha256 on every model; none on models[0] (cls)"
        in error('[security]\nmodels = "enforce"\n' + base)
    )
    assert "security.trusted_keys[0]: no such file" in error(
        '[security]\nmodels = "enforce"\ntrusted_keys = ["nope.pub"]\n' + base
    )
    assert "models[0].sha256: must be 64 hexadecimal digits" in error(base + 'sha256 = "abc"\n')
    config = parse_config(
        f'[security]\nmodels = "enforce"\ntrusted_keys = ["{public}"]\n'
        + base
        + f'sha256 = "{"A" * 64}"\nsignature = "elsewhere.sig"\n',
        tmp_path / "edged.toml",
    )
    assert config.security.trusted_keys == (public,)
    assert config.models[0].sha256 == "a" * 64
    assert config.models[0].signature == tmp_path / "elsewhere.sig"


def test_the_audit_says_which_model_files_are_not_trusted(signed, tmp_path: Path, capsys) -> None:
    """`edgectl audit --config` under warn: the signed file passes MDL-TRUST, an unsigned one
    warns and a changed one fails (the audit's exit 1); with models = off the check skips."""
    model, _, public = signed
    unsigned = tmp_path / "other.onnx"
    shutil.copyfile(model, unsigned)
    changed = tmp_path / "changed.onnx"
    shutil.copyfile(model, changed)
    shutil.copyfile(tmp_path / "cls.onnx.sig", tmp_path / "changed.onnx.sig")
    flip_one_byte(changed)
    models = "".join(
        f'[[models]]\nname = "{name}"\npath = "{path}"\n'
        for name, path in (("cls", model), ("other", unsigned), ("changed", changed))
    )
    config = tmp_path / "edged.toml"

    def audit(mode: str) -> tuple[int, dict]:
        config.write_text(f'[security]\nmodels = "{mode}"\ntrusted_keys = ["{public}"]\n{models}')
        capsys.readouterr()
        flags = ["--root", str(tmp_path), "--config", str(config), "--format", "json"]
        code = main(["audit", *flags, "--only", "MDL"])
        return code, json.loads(capsys.readouterr().out)

    code, report = audit("warn")
    found = {f["subject"]: f for f in report["findings"]}
    assert code == 1, report
    assert found[str(model)]["status"] == "pass" and "is verified" in found[str(model)]["title"]
    assert found[str(unsigned)]["status"] == "warn" and found[str(unsigned)]["severity"] == "warn"
    assert "loads unchecked (warn): unsigned" in found[str(unsigned)]["title"]
    assert "edgectl sign" in found[str(unsigned)]["remedy"]
    assert (found[str(changed)]["status"], found[str(changed)]["severity"]) == ("fail", "fail")
    assert "not the one that was signed" in found[str(changed)]["title"]
    code, report = audit("off")
    assert code == 0 and [f["status"] for f in report["findings"]] == ["skip"]


def test_enforce_reads_no_byte_of_an_untrusted_file(signed, tmp_path: Path) -> None:
    """Under enforce the config's checks (the model's header, its variants, pictures,
    detector) read a file only once it is trusted: a file that is not the one signed is
    left unread (a crafted one cannot reach a parser), and the daemon refuses it at load.
    Under warn the same file is read, and its garbage is the config's error."""
    model, _, public = signed
    signed_bytes = model.read_bytes()
    model.write_bytes(b"\x00garbage, not a model" * 64)  # no longer the signed file
    variant = tmp_path / "cls_int8.onnx"
    variant.write_bytes(b"not a model either")  # no signature at all
    table = f'[[models]]\nname = "cls"\npath = "{model}"\nvariants = ["{variant}"]\n'
    table += 'threads = 2\nserves_as = ["cls.onnx"]\n'

    def config(mode: str):
        text = f'[security]\nmodels = "{mode}"\ntrusted_keys = ["{public}"]\n{table}'
        return parse_config(text, tmp_path / "edged.toml")

    enforced = config("enforce").models[0]
    assert enforced.unread and enforced.variants == (variant,) and enforced.threads == 2
    assert enforced.serves_as == ("cls.onnx",)
    with pytest.raises(ConfigError, match=r"models\[0\]\.path"):
        config("warn")  # read, and it is not a model
    trust = ModelTrust(SecurityConfig("enforce", (public,)))
    with pytest.raises(UntrustedModel, match="not the one that was signed"):
        trust.require(model, what="model cls")
    # Trusted again after its config was read (put back before a load): still refused, as
    # nothing of it was checked; a reload reads the config, and so the file, again.
    unread = config("enforce")
    model.write_bytes(signed_bytes)
    variant.unlink()
    unread = replace(unread, models=(replace(unread.models[0], variants=()),))
    try:
        models, failed = load_models(unread, {}, probe_hardware(), lambda *a: None, lambda n: print)
    finally:  # load_models made enforce this process's policy: later tests load unsigned files
        activate(SecurityConfig())
    assert models == {} and "none was checked; reload (SIGHUP)" in failed["cls"]
    table = table.replace(f'variants = ["{variant}"]\n', "")
    assert not config("enforce").models[0].unread  # read and checked again: it is trusted
