"""`edgectl sign` and `edgectl verify`: a model file's signature, made in CI with a private
key and checked on a device with the same tool and the public key, as the daemon checks it
before every load ([security] models, edged.trust).

    edgectl sign MODEL [MODEL ...] --key PRIVATE.pem [--signature OUT] [--json]
    edgectl verify MODEL [MODEL ...] (--key PUBLIC.pem ... | --certificate CHAIN.pem ...
        | --sigstore-trust-root ROOT.json --identity ID --issuer URL)
        [--sha256 HEX] [--signature SIG] [--json]

A signature goes beside its model as `<model>.sig` (where the daemon looks by default);
`--signature` names another file (one model only). Keys are elliptic-curve PEM files
(`openssl ecparam -name prime256v1 -genkey -noout -out key.pem`, `openssl ec -in key.pem
-pubout -out key.pub`). A Sigstore bundle (signed in CI with `model_signing sign sigstore`)
is verified against a local trust root, offline, for the signer's identity and OIDC issuer.
Needs the optional library: pip install 'edged[signing]'.

Exit codes: 0 signed / every model verified (or pinned), 1 a model did not verify (each is
listed with why), 2 bad flags, a missing file, or the library is not installed."""

from __future__ import annotations

import json
from pathlib import Path

from edged.cli.common import EXIT_FAILED, EXIT_OK, UsageError

ORDER = 75  # place in `edgectl --help`: after tune and provision


def register(sub) -> None:
    sign = sub.add_parser("sign", help="sign model files with an elliptic-curve private key")
    sign.add_argument("models", nargs="+", type=Path, metavar="MODEL")
    sign.add_argument("--key", type=Path, required=True, help="private key, PEM")
    sign.add_argument("--signature", type=Path, help="where the signature goes (one model)")
    sign.add_argument("--json", action="store_true", help="machine-readable output")
    sign.set_defaults(func=cmd_sign, boot=False)

    verify = sub.add_parser(
        "verify", help="check model files as the daemon does before loading them"
    )
    verify.add_argument("models", nargs="+", type=Path, metavar="MODEL")
    verify.add_argument("--key", type=Path, action="append", default=[], help="public key")
    verify.add_argument(
        "--certificate", type=Path, action="append", default=[], help="certificate chain"
    )
    verify.add_argument(
        "--sigstore-trust-root",
        type=Path,
        metavar="ROOT.json",
        help="a Sigstore trusted_root.json (or client trust config), read locally",
    )
    verify.add_argument("--identity", help="Sigstore: the signer's identity (e-mail, URI)")
    verify.add_argument("--issuer", help="Sigstore: the identity's OIDC issuer")
    verify.add_argument("--sha256", help="the digest pinned for the model (one model)")
    verify.add_argument("--signature", type=Path, help="its signature file (one model)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(func=cmd_verify, boot=False)


def _check_files(args, paths: list[Path]) -> None:
    for path in paths:
        if not path.is_file():
            raise UsageError(f"{path}: no such file")
    if args.signature is not None and len(args.models) > 1:
        raise UsageError("--signature names one model's signature: give one MODEL with it")


def cmd_sign(args) -> int:
    from edged.trust.signatures import INSTALL_HINT, SignatureError, sign
    from edged.trust.verify import signature_of

    _check_files(args, [*args.models, args.key])
    signed = []
    for model in args.models:
        out = signature_of(model, args.signature)
        try:
            sign(model, out, args.key)
        except SignatureError as exc:
            if INSTALL_HINT in str(exc):
                raise UsageError(str(exc)) from None
            raise UsageError(f"{model}: {exc}") from None
        signed.append({"model": str(model), "signature": str(out)})
    if args.json:
        print(json.dumps({"signed": signed}, indent=2))
    else:
        for item in signed:
            print(f"signed {item['model']} -> {item['signature']}")
    return EXIT_OK


def cmd_verify(args) -> int:
    from edged.trust.settings import SecurityConfig
    from edged.trust.signatures import INSTALL_HINT
    from edged.trust.verify import ModelTrust

    root = args.sigstore_trust_root
    _check_files(args, [*args.models, *args.key, *args.certificate, *([root] if root else [])])
    if args.sha256 is not None and len(args.models) > 1:
        raise UsageError("--sha256 pins one model's digest: give one MODEL with it")
    sigstore = (root, args.identity, args.issuer)
    if any(sigstore) and not all(sigstore):
        raise UsageError("Sigstore needs --sigstore-trust-root, --identity and --issuer")
    signers = ((args.identity, args.issuer),) if root else ()
    config = SecurityConfig("enforce", tuple(args.key), tuple(args.certificate), root, signers)
    trust = ModelTrust(config)
    verdicts = [trust.check(m, args.sha256, args.signature) for m in args.models]
    for verdict in verdicts:
        if INSTALL_HINT in verdict.reason:
            raise UsageError(verdict.reason.removeprefix("signature: "))
    if args.json:
        print(json.dumps({"models": [v.to_dict() for v in verdicts]}, indent=2))
    else:
        for v in verdicts:
            who = f" by {v.signer}" if v.signer else ""
            print(f"{v.path}: {v.state.upper()}{who} (sha256 {v.sha256})")
            if v.reason and not v.trusted:
                print(f"  {v.reason}")
    return EXIT_OK if all(v.trusted for v in verdicts) else EXIT_FAILED
