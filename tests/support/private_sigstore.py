"""A private Sigstore instance, made in the test: a Fulcio-like certificate authority, a CT
log and a Rekor-like transparency log, each just a key, and a trust root naming them.

What a device meets when its models are signed by an organisation's own Sigstore (or by the
public one, whose trust root it holds locally): a bundle with a short-lived signing
certificate for a CI identity, its SCT, and one log entry with an inclusion proof, a signed
checkpoint and a signed entry timestamp. Here they are issued by hand (there is no network
to reach a real Fulcio and Rekor), in the formats those services write, so the real
`sigstore` verifier that model-signing calls checks every one of them: the chain, the SCT,
the identity and issuer, the inclusion proof, the checkpoint, the inclusion promise and the
DSSE signature. The envelope itself is made by model-signing (key mode, with the
certificate's key), so its payload is the library's own manifest of the model.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import struct
from pathlib import Path

import rfc8785
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

from edged.trust.signatures import VERIFY_ONLY_SIGNING_CONFIG

ISSUER_OID = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")  # Fulcio's OIDC issuer (raw text)
SCT_LIST_OID = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")  # RFC 6962 embedded SCTs
ORIGIN = "rekor.edged.test - 1"  # the checkpoint's origin line: the log's name and tree id
LOG_NAME = "rekor.edged.test"  # the name its signature line carries (no spaces)
START = "2020-01-01T00:00:00Z"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _spki(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _key_id(key: ec.EllipticCurvePrivateKey) -> bytes:
    return hashlib.sha256(_spki(key)).digest()


def _sign(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def _der_octet_string(data: bytes) -> bytes:
    n = len(data)
    if n < 0x80:
        return b"\x04" + bytes([n]) + data
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return b"\x04" + bytes([0x80 | len(size)]) + size + data


def _key_usage(certificate_authority: bool) -> x509.KeyUsage:
    """A CA signs certificates (and CRLs); a signing certificate signs, nothing else."""
    return x509.KeyUsage(
        digital_signature=not certificate_authority,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=certificate_authority,
        crl_sign=certificate_authority,
        encipher_only=False,
        decipher_only=False,
    )


def _u24(n: int) -> bytes:
    return n.to_bytes(3, "big")


class PrivateSigstore:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ct_key = ec.generate_private_key(ec.SECP256R1())
        self.rekor_key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "edged test"),
                x509.NameAttribute(NameOID.COMMON_NAME, "edged test fulcio"),
            ]
        )
        public = self.ca_key.public_key()
        self.ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(certificate_authority=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self.ca_key, hashes.SHA256())
        )

    def trust_root(self, client_config: bool = False) -> Path:
        """The trust root naming this instance's CA, CT log and transparency log: a
        trusted_root.json, or (`client_config`) a client trust config wrapping it."""

        def log(key: ec.EllipticCurvePrivateKey, url: str) -> dict:
            return {
                "baseUrl": url,
                "hashAlgorithm": "SHA2_256",
                "publicKey": {
                    "rawBytes": _b64(_spki(key)),
                    "keyDetails": "PKIX_ECDSA_P256_SHA_256",
                    "validFor": {"start": START},
                },
                "logId": {"keyId": _b64(_key_id(key))},
            }

        ca_der = self.ca_cert.public_bytes(serialization.Encoding.DER)
        root = {
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            "tlogs": [log(self.rekor_key, "https://rekor.edged.test")],
            "certificateAuthorities": [
                {
                    "subject": {"organization": "edged test", "commonName": "edged test fulcio"},
                    "uri": "https://fulcio.edged.test",
                    "certChain": {"certificates": [{"rawBytes": _b64(ca_der)}]},
                    "validFor": {"start": START},
                }
            ],
            "ctlogs": [log(self.ct_key, "https://ctfe.edged.test")],
            "timestampAuthorities": [],
        }
        if not client_config:
            path = self.folder / "trusted_root.json"
            path.write_text(json.dumps(root, indent=2))
            return path
        path = self.folder / "trust_config.json"
        path.write_text(
            json.dumps(
                {
                    "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
                    "trustedRoot": root,
                    "signingConfig": VERIFY_ONLY_SIGNING_CONFIG,
                },
                indent=2,
            )
        )
        return path

    def certificate(
        self, key: ec.EllipticCurvePrivateKey, identity: str, issuer: str
    ) -> x509.Certificate:
        """A Fulcio-style signing certificate for `identity` (an e-mail or a URI, as a CI
        workflow's), valid ten minutes, with one embedded SCT from the CT log."""
        now = dt.datetime.now(dt.UTC).replace(microsecond=0)
        san = (
            x509.UniformResourceIdentifier(identity)
            if "://" in identity
            else x509.RFC822Name(identity)
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(minutes=10))
            .add_extension(_key_usage(certificate_authority=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                False,
            )
            .add_extension(x509.SubjectAlternativeName([san]), critical=True)
            .add_extension(x509.UnrecognizedExtension(ISSUER_OID, issuer.encode()), False)
        )
        # The precertificate the CT log timestamps is this certificate without the SCT list
        # (RFC 6962 3.2): its TBS is what the SCT's signature covers.
        pre = builder.sign(self.ca_key, hashes.SHA256())
        millis = int(now.timestamp() * 1000)
        signed_entry = _key_id(self.ca_key) + _u24(len(pre.tbs_certificate_bytes))
        signed_entry += pre.tbs_certificate_bytes
        digitally_signed = struct.pack("!BBQH", 0, 0, millis, 1) + signed_entry + b"\x00\x00"
        signature = _sign(self.ct_key, digitally_signed)
        sct = (
            b"\x00"
            + _key_id(self.ct_key)
            + struct.pack("!Q", millis)
            + b"\x00\x00"  # no extensions
            + b"\x04\x03"  # sha256, ecdsa
            + struct.pack("!H", len(signature))
            + signature
        )
        sct_list = struct.pack("!H", len(sct) + 2) + struct.pack("!H", len(sct)) + sct
        extension = x509.UnrecognizedExtension(SCT_LIST_OID, _der_octet_string(sct_list))
        return builder.add_extension(extension, critical=False).sign(self.ca_key, hashes.SHA256())

    def sign(self, model: Path, signature: Path, identity: str, issuer: str) -> None:
        """Sign `model` into a Sigstore bundle at `signature`, as `identity` from `issuer`."""
        from model_signing import signing

        key = ec.generate_private_key(ec.SECP256R1())
        key_file = self.folder / "ephemeral.pem"
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        signing.Config().use_elliptic_key_signer(private_key=key_file).sign(model, signature)
        key_file.unlink()  # ephemeral, as Fulcio's signing keys are
        envelope = json.loads(signature.read_text())["dsseEnvelope"]
        cert = self.certificate(key, identity, issuer)
        payload = base64.b64decode(envelope["payload"])
        pem = cert.public_bytes(serialization.Encoding.PEM)
        body = rfc8785.dumps(
            {
                "apiVersion": "0.0.1",
                "kind": "dsse",
                "spec": {
                    "envelopeHash": {
                        "algorithm": "sha256",
                        "value": hashlib.sha256(json.dumps(envelope).encode()).hexdigest(),
                    },
                    "payloadHash": {
                        "algorithm": "sha256",
                        "value": hashlib.sha256(payload).hexdigest(),
                    },
                    "signatures": [
                        {"signature": s["sig"], "verifier": _b64(pem)}
                        for s in envelope["signatures"]
                    ],
                },
            }
        )
        integrated = int(dt.datetime.now(dt.UTC).timestamp())
        log_id = _key_id(self.rekor_key)
        # A log of one entry: the root is the leaf's hash (RFC 6962 2.1) and the proof empty.
        root = hashlib.sha256(b"\x00" + body).digest()
        note = f"{ORIGIN}\n1\n{_b64(root)}\n"
        signed = _b64(log_id[:4] + _sign(self.rekor_key, note.encode()))
        checkpoint = f"{note}\n\u2014 {LOG_NAME} {signed}\n"
        promise = rfc8785.dumps(
            {
                "body": _b64(body),
                "integratedTime": integrated,
                "logID": log_id.hex(),
                "logIndex": 0,
            }
        )
        bundle = {
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {
                "certificate": {"rawBytes": _b64(cert.public_bytes(serialization.Encoding.DER))},
                "tlogEntries": [
                    {
                        "logIndex": "0",
                        "logId": {"keyId": _b64(log_id)},
                        "kindVersion": {"kind": "dsse", "version": "0.0.1"},
                        "integratedTime": str(integrated),
                        "inclusionPromise": {
                            "signedEntryTimestamp": _b64(_sign(self.rekor_key, promise))
                        },
                        "inclusionProof": {
                            "logIndex": "0",
                            "rootHash": _b64(root),
                            "treeSize": "1",
                            "hashes": [],
                            "checkpoint": {"envelope": checkpoint},
                        },
                        "canonicalizedBody": _b64(body),
                    }
                ],
            },
            "dsseEnvelope": envelope,
        }
        signature.write_text(json.dumps(bundle))
