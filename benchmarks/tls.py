"""The encryption floor of HTTPS: AES-GCM on one core, as TLS records use it.

TLS 1.3 between OpenSSL clients and Go servers (SeaweedFS among them) uses AES-128-GCM
(Go's preference; OpenSSL servers pick AES-256-GCM) in records of 16 KiB. Whatever the transport does, every byte is encrypted
once by the sender and decrypted once by the receiver, so this rate bounds how close
HTTPS can come to plain HTTP in CPU per byte. Measured with ``openssl speed`` (the
library Python's ``ssl`` module links, :data:`ssl.OPENSSL_VERSION`) and, for comparison,
through the ``cryptography`` package, which bundles its own, newer OpenSSL.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import subprocess
import time
from typing import Any
from urllib.parse import urlsplit

RECORD = 16 * 1024
GiB = 1024**3


def aes_gcm_report(endpoint: str | None = None, ca_file: str | None = None) -> dict[str, Any]:
    """AES-GCM rates (GB/s per core, CPU-s per GiB) with the library versions, and the
    cipher the benchmark's HTTPS endpoint negotiates with the ``ssl`` module."""
    report: dict[str, Any] = {"ssl_module_openssl": ssl.OPENSSL_VERSION}
    if endpoint and ca_file:
        report["negotiated_cipher"] = negotiated_cipher(endpoint, ca_file)
    for bits in (128, 256):
        speed = openssl_speed(f"aes-{bits}-gcm")
        if speed is not None:
            report[f"openssl_aes{bits}_gb_per_s"] = speed
            report[f"openssl_aes{bits}_cpu_s_per_gib"] = GiB / (speed * 1e9)
    report.update({f"cryptography_{k}": v for k, v in cryptography_rate().items()})
    return report


def negotiated_cipher(endpoint: str, ca_file: str) -> str:
    """The TLS version and cipher suite of one handshake with ``endpoint``."""
    url = urlsplit(endpoint)
    context = ssl.create_default_context(cafile=ca_file)
    host = url.hostname or "localhost"
    with (
        socket.create_connection((host, url.port or 443), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        cipher = tls.cipher()
        return f"{tls.version()} {cipher[0] if cipher else '?'}"


def openssl_speed(cipher: str) -> float | None:
    """``openssl speed -evp <cipher>`` on 16 KiB blocks, GB/s; None without the tool."""
    tool = shutil.which("openssl")
    if tool is None:
        return None
    command = [tool, "speed", "-evp", cipher, "-bytes", str(RECORD), "-seconds", "1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    found = re.search(r"^AES-\d+-GCM\s+([\d.]+)k", completed.stdout, re.MULTILINE)
    return float(found.group(1)) * 1000 / 1e9 if found else None


def cryptography_rate(seconds: float = 0.5) -> dict[str, float]:
    """AES-256-GCM encryption of 16 KiB records through ``cryptography`` on one core."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    cipher = AESGCM(AESGCM.generate_key(bit_length=256))
    record, nonce = os.urandom(RECORD), os.urandom(12)
    done, started = 0, time.process_time()
    while (elapsed := time.process_time() - started) < seconds:
        for _ in range(64):
            cipher.encrypt(nonce, record, None)
        done += 64 * RECORD
    return {"gb_per_s": done / elapsed / 1e9, "cpu_s_per_gib": elapsed / (done / GiB)}
