"""Ranged GETs signed by the aiobotocore client, sent on the pool's connections.

The request is signed as a presigned URL (SigV4 query authentication), so credentials,
regions, session tokens and addressing style are handled by the client in one place and
never appear in a header built here. A presigned URL is reused for every range of its
object for a few minutes (``Range`` is not signed), and signed anew when a reused one is
refused. Error responses come back as the ``ClientError`` s aiobotocore would raise, so
:mod:`s3ckpt.s3.retry` and :mod:`s3ckpt.s3.error_mapping` treat them like any other.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import SplitResult, urlsplit

from botocore.exceptions import ClientError

from s3ckpt._version import __version__
from s3ckpt.s3.wire.get_exchange import RangeResponse, open_range
from s3ckpt.s3.wire.pool import ConnectionPool

PRESIGN_EXPIRES_S = 3600
REUSE_SIGNATURE_S = 300.0
MAX_CACHED_URLS = 4096


class RangedGets:
    """Ranged GETs over the pool's kept-alive connections, signed by an aiobotocore client."""

    def __init__(self, client: Any, pool: ConnectionPool) -> None:
        self.client = client
        self.pool = pool
        self._urls: dict[tuple[str, str], tuple[float, SplitResult]] = {}

    async def open(self, bucket: str, key: str, start: int, end: int) -> RangeResponse:
        """Ask for bytes ``[start, end)`` of ``bucket/key``: the response, its head read,
        whose body the caller pulls (and then closes)."""
        url, reused = await self._signed(bucket, key)
        try:
            return await self._open(url, start, end)
        except ClientError as exc:
            if not reused or exc.response["ResponseMetadata"]["HTTPStatusCode"] != 403:
                raise
            # A reused signature may have outlived the credentials that made it: sign anew.
            url, _ = await self._signed(bucket, key, fresh=True)
            return await self._open(url, start, end)

    async def _signed(
        self, bucket: str, key: str, *, fresh: bool = False
    ) -> tuple[SplitResult, bool]:
        """A presigned GET URL for the object and whether it was reused."""
        now = time.monotonic()
        cached = self._urls.get((bucket, key))
        if cached is not None and not fresh and now - cached[0] < REUSE_SIGNATURE_S:
            return cached[1], True
        url = await self.client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=PRESIGN_EXPIRES_S
        )
        if len(self._urls) >= MAX_CACHED_URLS:
            self._urls.clear()
        self._urls[(bucket, key)] = (now, urlsplit(url))
        return self._urls[(bucket, key)][1], False

    async def _open(self, url: SplitResult, start: int, end: int) -> RangeResponse:
        origin = (
            url.scheme,
            url.hostname or "",
            url.port or (443 if url.scheme == "https" else 80),
        )
        request = (
            f"GET {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Range: bytes={start}-{end - 1}\r\nAccept-Encoding: identity\r\n"
            f"User-Agent: s3ckpt/{__version__}\r\n\r\n"
        ).encode("ascii")
        return await open_range(self.pool, origin, request, start, end)
