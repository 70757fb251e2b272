"""Elliptic-curve key pairs as `edgectl sign --key` and [security] trusted_keys take them,
and the one-byte change that a signature must catch."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


def make_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A P-256 key pair: (folder/name.pem private, folder/name.pub public), PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.pem", folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def flip_one_byte(path: Path, offset: int = 100) -> None:
    """One bit of one byte changed, in place (same inode: the file's times change)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
