"""SigV4 for part uploads: botocore's algorithm, without botocore's per-request machinery.

botocore's ``S3SigV4Auth`` signs one UploadPart in about 0.3-0.6 ms of Python: an
``AWSRequest``, header maps normalised and copied, the URL split again and again, and the
signing key's four HMACs derived anew for every request. In thread mode that is time the
I/O loop holds the GIL while the training loop waits for it: with parts sent in native
batches (:mod:`~.batch`), botocore's signer was the largest Python cost left per part
(cProfile of a 1 GiB thread-mode save: 0.075 s of 0.24 s on the I/O loop, 108 parts).
Here a part's signature is one SHA-256 and one HMAC over strings built directly, the
signing key kept per secret, day, region and service: about 20 µs.

Only what :class:`~.uploads.SignedParts` sends is signed here, exactly as botocore signs
it for the client s3ckpt configures (:mod:`s3ckpt.s3.client`: SigV4, payload signing off,
so ``UNSIGNED-PAYLOAD``): ``PUT`` on the object's URL as the client addresses it, a query
of ``partNumber`` and ``uploadId``, the part's CRC32C header where it has one, and the
session token where the credentials carry one. ``tests/unit/test_wire_signing.py``
checks every header against botocore's signer for the same request at the same instant;
SeaweedFS checks the signatures themselves (``tests/integration/test_signed_parts.py``).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from typing import Any
from urllib.parse import SplitResult

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_MAX_KEYS = 64


class PartSigner:
    """Signs part uploads with SigV4; keeps the few signing keys it derives."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str, str], bytes] = {}

    def sign(
        self,
        url: SplitResult,
        headers: dict[str, str],
        *,
        credentials: Any,
        region: str,
        service: str,
        now: datetime.datetime | None = None,
    ) -> dict[str, str]:
        """``headers`` and the signer's (``X-Amz-Date``, ``X-Amz-Content-SHA256``, the token
        where there is one, ``Authorization``) for ``PUT url``, signed at ``now`` (UTC)."""
        moment = now or datetime.datetime.now(datetime.timezone.utc)
        stamp = moment.strftime("%Y%m%dT%H%M%SZ")
        signed = dict(headers)
        signed["X-Amz-Date"] = stamp
        if credentials.token:
            signed["X-Amz-Security-Token"] = credentials.token
        signed["X-Amz-Content-SHA256"] = UNSIGNED_PAYLOAD
        canonical = {name.lower(): " ".join(value.split()) for name, value in signed.items()}
        canonical.setdefault("host", host_of(url))
        names = sorted(canonical)
        signed_names = ";".join(names)
        request = "\n".join(
            (
                "PUT",
                url.path or "/",
                canonical_query(url.query),
                "".join(f"{name}:{canonical[name]}\n" for name in names),
                signed_names,
                UNSIGNED_PAYLOAD,
            )
        )
        scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
        to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
        key = self._key(credentials.secret_key, stamp[:8], region, service)
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        signed["Authorization"] = (
            f"{ALGORITHM} Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={signed_names}, Signature={signature}"
        )
        return signed

    def _key(self, secret: str, day: str, region: str, service: str) -> bytes:
        found = self._keys.get((secret, day, region, service))
        if found is None:
            found = f"AWS4{secret}".encode()
            for part in (day, region, service, "aws4_request"):
                found = hmac.new(found, part.encode(), hashlib.sha256).digest()
            if len(self._keys) >= _MAX_KEYS:
                self._keys.clear()
            self._keys[(secret, day, region, service)] = found
        return found


def host_of(url: SplitResult) -> str:
    """The ``Host`` SigV4 signs: the host name, with the port unless it is the scheme's."""
    host = url.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    if url.port is not None and url.port != _DEFAULT_PORTS.get(url.scheme):
        host = f"{host}:{url.port}"
    return host


def canonical_query(query: str) -> str:
    """The query's pairs sorted by name, then value, as they are encoded in the URL."""
    if not query:
        return ""
    pairs = sorted(tuple(pair.partition("=")[::2]) for pair in query.split("&"))
    return "&".join(f"{name}={value}" for name, value in pairs)
