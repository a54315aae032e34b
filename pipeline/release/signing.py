"""Ed25519 seals on manifests (docs/release.md, "Signing"): a bundle's manifest.json and a
release's release.json list every file with its sha256, so a signature over the manifest's
bytes covers every byte of the bundle. The signature is ``<manifest>.sig`` beside it: the
raw 64-byte Ed25519 signature, base64 on one line (OpenSSL verifies it too:
``openssl pkeyutl -verify -pubin -inkey key.pub -rawin -in manifest.json -sigfile <(base64 -d manifest.json.sig)``).
Keys are PEM files (PKCS#8 private, SubjectPublicKeyInfo public), as ``parity-bundle keygen``
or ``openssl genpkey -algorithm ed25519`` write them. Uses the maintained ``cryptography``
library; nothing here talks to a network."""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from typing import Tuple

from pipeline.errors import InputError

SUFFIX = ".sig"


def signature_path(manifest: Path) -> Path:
    return Path(manifest).with_name(Path(manifest).name + SUFFIX)


def generate(private_path: Path) -> Tuple[Path, Path]:
    """A new key pair: ``private_path`` (mode 0600, refused if it exists) and
    ``private_path``.pub; (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private_path, public_path = Path(private_path), Path(f"{private_path}.pub")
    if private_path.exists() or public_path.exists():
        raise InputError(f"keygen: {private_path} or {public_path} exists; choose another name")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    descriptor = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(pem)
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def check_private_key(private_path: Path) -> None:
    """InputError unless ``private_path`` is a readable Ed25519 private key."""
    _private_key(private_path)


def sign(manifest: Path, private_path: Path) -> Path:
    """Write ``manifest``.sig, the signature of the manifest's bytes; its path."""
    key = _private_key(private_path)
    signature = key.sign(Path(manifest).read_bytes())
    target = signature_path(manifest)
    target.write_text(base64.b64encode(signature).decode() + "\n")
    return target


def verify(manifest: Path, public_path: Path) -> None:
    """InputError unless ``manifest``.sig is a valid signature of the manifest by the key."""
    from cryptography.exceptions import InvalidSignature

    key = _public_key(public_path)
    target = signature_path(manifest)
    if not target.is_file():
        raise InputError(f"signature: {target.name} is missing: the bundle was not signed (parity-release --sign KEY)")
    try:
        key.verify(base64.b64decode(target.read_text().strip(), validate=True), Path(manifest).read_bytes())
    except (InvalidSignature, binascii.Error, ValueError) as err:
        raise InputError(f"signature: {Path(manifest).name} does not match {target.name} for key {public_path} "
                         "(changed after signing, or signed by another key)") from err


def _private_key(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = _load(path, lambda data: serialization.load_pem_private_key(data, password=None), "private")
    if not isinstance(key, Ed25519PrivateKey):
        raise InputError(f"signing key {path}: not an Ed25519 key (parity-bundle keygen, or "
                         "openssl genpkey -algorithm ed25519)")
    return key


def _public_key(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = _load(path, serialization.load_pem_public_key, "public")
    if not isinstance(key, Ed25519PublicKey):
        raise InputError(f"verify key {path}: not an Ed25519 public key")
    return key


def _load(path: Path, reader, kind: str):
    try:
        return reader(Path(path).read_bytes())
    except OSError as err:
        raise InputError(f"{kind} key {path} cannot be read ({err.strerror or err})") from err
    except (ValueError, TypeError) as err:
        raise InputError(f"{kind} key {path} is not a PEM {kind} key ({str(err).splitlines()[0]}); an encrypted "
                         "key is not supported: keep it in the CI's secret store instead") from err
