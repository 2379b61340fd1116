"""A private certificate authority and a server certificate, generated at run time.

The embedded S3 server (:mod:`s3ckpt.testing.local_s3`) serves HTTPS with these, so that
TLS is tested and benchmarked the way production endpoints are reached: a certificate
signed by a CA the client must be told about (``verify=`` the CA file, or
``AWS_CA_BUNDLE``), checked against the host name the client dialled. Nothing is
written to a shared location and no key ever leaves the directory it is written to
(files are created mode 0600).

The server certificate names ``localhost`` only (no IP address), so a client that dials
``127.0.0.1`` sees a host name mismatch: that is how the tests provoke one.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from s3ckpt._install import install_hint
from s3ckpt.errors import LocalServerError

TLS_HOST = "localhost"
_VALID_DAYS = 7


@dataclass(frozen=True)
class TlsFiles:
    """Where the PEM files are: the CA certificate (for clients), the server's chain and key."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def write_tls_files(directory: Path, hosts: tuple[str, ...] = (TLS_HOST,)) -> TlsFiles:
    """Generate a CA and a server certificate for ``hosts`` (DNS names) into ``directory``."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise LocalServerError(
            f"TLS for the local S3 server needs the 'cryptography' package, in {install_hint('test')}"
        ) from exc

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=_VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "s3ckpt local test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    _write(files.ca_file, ca_cert.public_bytes(pem))
    _write(files.cert_file, cert.public_bytes(pem) + ca_cert.public_bytes(pem))
    _write(
        files.key_file,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return files


def _write(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)
