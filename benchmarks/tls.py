"""The encryption floor of HTTPS: AES-256-GCM on one core, as TLS records use it.

TLS 1.3 between OpenSSL clients and Go servers (SeaweedFS, and most S3 front ends) uses
AES-256-GCM in records of 16 KiB. Whatever the transport does, every byte is encrypted
once by the sender and decrypted once by the receiver, so this rate bounds how close
HTTPS can come to plain HTTP in CPU per byte. Measured with ``openssl speed`` (the
library Python's ``ssl`` module links, :data:`ssl.OPENSSL_VERSION`) and, for comparison,
through the ``cryptography`` package, which bundles its own, newer OpenSSL.
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
import time
from typing import Any

RECORD = 16 * 1024
GiB = 1024**3


def aes_gcm_report() -> dict[str, Any]:
    """Both measurements (GB/s per core, CPU-s per GiB), with the library versions."""
    report: dict[str, Any] = {"ssl_module_openssl": ssl.OPENSSL_VERSION}
    speed = openssl_speed()
    if speed is not None:
        report["openssl_speed_gb_per_s"] = speed
        report["openssl_speed_cpu_s_per_gib"] = GiB / (speed * 1e9)
    report.update({f"cryptography_{k}": v for k, v in cryptography_rate().items()})
    return report


def openssl_speed() -> float | None:
    """``openssl speed -evp aes-256-gcm`` on 16 KiB blocks, GB/s; None without the tool."""
    tool = shutil.which("openssl")
    if tool is None:
        return None
    command = [tool, "speed", "-evp", "aes-256-gcm", "-bytes", str(RECORD), "-seconds", "1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    found = re.search(r"^AES-256-GCM\s+([\d.]+)k", completed.stdout, re.MULTILINE)
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
