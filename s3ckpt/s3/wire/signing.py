"""SigV4 for part uploads: botocore's algorithm, without botocore's per-request machinery.

botocore's ``S3SigV4Auth`` builds an ``AWSRequest`` for every request, normalises and
copies its header maps, splits the URL again and again and derives the signing key's
four HMACs anew. In thread mode that Python holds the GIL on the I/O loop while the
training loop waits for it, once per part
(docs/decisions/0005-requests-signed-on-the-data-plane.md).
Here a part's signature is one SHA-256 and one HMAC over strings built directly, the
signing key kept per secret, day, region and service. The parts of one upload are signed
by :class:`PartHeads`, which works out once what they share and writes each part's whole
request head.

Only what the data plane sends is signed here, exactly as botocore signs it for the
client s3ckpt configures (:mod:`s3ckpt.s3.client`: SigV4, payload signing off, so
``UNSIGNED-PAYLOAD``): the parts and PUTs of :class:`~.uploads.SignedPuts` (``PUT`` on
the object's URL as the client addresses it, a query of ``partNumber`` and ``uploadId``,
the part's CRC32C header where it has one) and the requests of
:class:`~.data_plane.SignedCalls` (the method, query and headers the client's serializer
built), with the session token where the credentials carry one.
``tests/unit/s3/wire/test_signing.py`` and ``tests/unit/s3/wire/test_data_plane.py`` check
the signatures against botocore's signer for the same request at the same instant; SeaweedFS
checks them itself (``tests/integration/test_signed_parts.py`` and every save).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import time
from typing import Any
from urllib.parse import SplitResult, quote

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
        method: str = "PUT",
    ) -> dict[str, str]:
        """``headers`` and the signer's (``X-Amz-Date``, ``X-Amz-Content-SHA256``, the token
        where there is one, ``Authorization``) for ``method url`` (``PUT`` or a request
        without a body, ``HEAD``), signed at ``now`` (UTC)."""
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
                method,
                url.path or "/",
                canonical_query(url.query),
                "".join(f"{name}:{canonical[name]}\n" for name in names),
                signed_names,
                UNSIGNED_PAYLOAD,
            )
        )
        scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
        key = self.signing_key(credentials.secret_key, stamp[:8], region, service)
        signature = _signature(key, stamp, scope, request)
        signed["Authorization"] = (
            f"{ALGORITHM} Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={signed_names}, Signature={signature}"
        )
        return signed

    def signing_key(self, secret: str, day: str, region: str, service: str) -> bytes:
        """The SigV4 signing key of ``secret`` for ``day`` (``YYYYMMDD``), region and service."""
        found = self._keys.get((secret, day, region, service))
        if found is None:
            found = f"AWS4{secret}".encode()
            for part in (day, region, service, "aws4_request"):
                found = hmac.new(found, part.encode(), hashlib.sha256).digest()
            if len(self._keys) >= _MAX_KEYS:
                self._keys.clear()
            self._keys[(secret, day, region, service)] = found
        return found


class PartHeads:
    """The signed request heads of one multipart upload's parts.

    For each part, the bytes :func:`~.uploads.request_head` makes of what
    :meth:`PartSigner.sign` signs, with what every part shares worked out once: the path,
    both host forms, the quoted upload id, the credentials' token, the header names, and
    the timestamp formatted once a second, where the general pair works each part's out
    anew. ``tests/unit/s3/wire/test_signing.py`` checks every head byte for byte against the
    general pair's.
    """

    def __init__(
        self,
        signer: PartSigner,
        base: SplitResult,
        upload_id: str,
        *,
        credentials: Any,
        region: str,
        service: str,
        host_header: str,
        user_agent: str,
    ) -> None:
        self._signer, self._credentials = signer, credentials
        self._region, self._service = region, service
        self._path = base.path or "/"
        self._upload_id = quote(upload_id, safe="-_.~")
        self._host = host_of(base)
        self._token = credentials.token
        token_names = ";x-amz-security-token" if self._token else ""
        self._names = f"host;x-amz-content-sha256;x-amz-date{token_names}"
        self._names_checksum = (
            f"host;x-amz-checksum-crc32c;x-amz-content-sha256;x-amz-date{token_names}"
        )
        self._host_line = f"Host: {host_header}\r\n"
        self._tail = f"User-Agent: {user_agent}\r\n\r\n"
        self._second = -1
        self._stamp = ""

    def __call__(
        self, number: int, length: int, checksum: str | None, now: datetime.datetime | None = None
    ) -> bytes:
        """The head of part ``number`` (``length`` bytes, its CRC32C header if any), signed
        now (or at ``now``, UTC)."""
        stamp = self._stamp_at(now)
        query = f"partNumber={number}&uploadId={self._upload_id}"  # already in sorted order
        token = self._token
        names = self._names_checksum if checksum else self._names
        scope = f"{stamp[:8]}/{self._region}/{self._service}/aws4_request"
        key = self._signer.signing_key(
            self._credentials.secret_key, stamp[:8], self._region, self._service
        )
        signature = _signature(key, stamp, scope, self._request(query, checksum, stamp, names))
        head = f"PUT {self._path}?{query} HTTP/1.1\r\n{self._host_line}Content-Length: {length}\r\n"
        if checksum:
            head += f"x-amz-checksum-crc32c: {checksum}\r\n"
        head += f"X-Amz-Date: {stamp}\r\n"
        if token:
            head += f"X-Amz-Security-Token: {token}\r\n"
        head += (
            f"X-Amz-Content-SHA256: {UNSIGNED_PAYLOAD}\r\nAuthorization: {ALGORITHM} "
            f"Credential={self._credentials.access_key}/{scope}, SignedHeaders={names}, "
            f"Signature={signature}\r\n{self._tail}"
        )
        return head.encode("latin-1")

    def _request(self, query: str, checksum: str | None, stamp: str, names: str) -> str:
        """The canonical request of a part (header values with their spaces folded)."""
        headers = f"host:{self._host}\n"
        if checksum:
            headers += f"x-amz-checksum-crc32c:{' '.join(checksum.split())}\n"
        headers += f"x-amz-content-sha256:{UNSIGNED_PAYLOAD}\nx-amz-date:{stamp}\n"
        if self._token:
            headers += f"x-amz-security-token:{' '.join(self._token.split())}\n"
        return f"PUT\n{self._path}\n{query}\n{headers}\n{names}\n{UNSIGNED_PAYLOAD}"

    def _stamp_at(self, now: datetime.datetime | None) -> str:
        if now is not None:
            return now.strftime("%Y%m%dT%H%M%SZ")
        second = int(time.time())
        if second != self._second:
            self._stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))
            self._second = second
        return self._stamp


def _signature(key: bytes, stamp: str, scope: str, request: str) -> str:
    """SigV4's signature of the canonical ``request`` at ``stamp``, with a signing key."""
    to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


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
