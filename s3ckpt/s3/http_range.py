"""Ranged GETs received straight into destination memory: one copy from kernel to tensor.

Through aiohttp every body byte is copied three times after the kernel hands it over: into
a new ``bytes`` per socket read (uvloop copies its read buffer; asyncio allocates), into
another ``bytes`` by the HTTP parser's body callback, and finally into the tensor. For
checkpoint loads that is most of the client's CPU. :mod:`s3ckpt.s3.http_response`
speaks just enough HTTP/1.1 for a ranged GET on an :class:`asyncio.BufferedProtocol`, so
the event loop's ``recv_into`` writes the body directly into the memory the caller's
:class:`~s3ckpt.s3.http_response.RangeSink` names, usually the destination tensor; this
module signs, connects and reuses connections.

Everything else stays with aiobotocore: the request is signed by the client as a
presigned URL (SigV4 query authentication, so credentials, regions, session tokens and
addressing style are handled in one place and never appear in a header built here), TLS
uses the same verify settings, and error responses are turned into botocore
``ClientError`` s so that :mod:`s3ckpt.s3.retry` and :mod:`s3ckpt.s3.error_mapping` treat them
like any other. Responses it does not take in place (chunked encoding, a server that
ignores ``Range``) raise :class:`~s3ckpt.s3.http_response.UnsupportedResponse`, and the
caller falls back to aiobotocore for good. Endpoints reached through an HTTP proxy always use aiobotocore.

A presigned URL is reused for every range of its object for a few minutes (``Range``
is not signed), and signed anew when a reused one is refused.

Connections are kept alive and reused, one request at a time each; a reused connection
that the server had already closed is replaced at once instead of counting as a failure.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.request
from typing import Any
from urllib.parse import SplitResult, urlsplit

from botocore.exceptions import ClientError

from s3ckpt._version import __version__
from s3ckpt.s3.compat_botocore import (
    ca_bundle,
    connect_timeout,
    connection_failed,
    default_tls_context,
    tls_failed,
)
from s3ckpt.s3.http_response import Connection, RangeSink, StaleConnection

PRESIGN_EXPIRES_S = 3600
REUSE_SIGNATURE_S = 300.0
MAX_CACHED_URLS = 4096


def proxied(endpoint_url: str, proxies: dict[str, str] | None = None) -> bool:
    """Whether requests to ``endpoint_url`` go through a proxy: one configured for its
    scheme, or one the environment names (``HTTPS_PROXY``...) that ``NO_PROXY`` does not
    bypass."""
    parts = urlsplit(endpoint_url)
    if proxies and parts.scheme in proxies:
        return True
    if parts.scheme not in urllib.request.getproxies():
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


def tls_context(verify: bool | str) -> ssl.SSLContext:
    """The TLS settings aiobotocore derives from the same ``verify`` value."""
    context = default_tls_context()
    if verify:
        context.verify_mode = ssl.CERT_REQUIRED
        context.check_hostname = True
        ca_certs = ca_bundle(verify)
        if ca_certs:
            context.load_verify_locations(ca_certs, None, None)
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class DirectRangeReader:
    """Ranged GETs over kept-alive connections, signed by an aiobotocore client."""

    def __init__(
        self,
        client: Any,
        *,
        verify: bool | str,
        connect_timeout: float,
        read_timeout: float,
        max_idle: int,
    ) -> None:
        self.client = client
        self.verify = verify
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._urls: dict[tuple[str, str], tuple[float, SplitResult]] = {}
        self._tls: ssl.SSLContext | None = None

    async def read(self, bucket: str, key: str, start: int, end: int, sink: RangeSink) -> None:
        """Receive bytes ``[start, end)`` of ``bucket/key`` into ``sink``, in offset order."""
        url, reused = await self._signed(bucket, key)
        try:
            await self._get(url, start, end, sink)
        except ClientError as exc:
            if not reused or exc.response["ResponseMetadata"]["HTTPStatusCode"] != 403:
                raise
            # A reused signature may have outlived the credentials that made it: sign anew.
            url, _ = await self._signed(bucket, key, fresh=True)
            await self._get(url, start, end, sink)

    async def _signed(
        self, bucket: str, key: str, *, fresh: bool = False
    ) -> tuple[SplitResult, bool]:
        """A presigned GET URL for the object and whether it was reused: one URL serves
        every range of the object for a few minutes (``Range`` is not signed)."""
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

    async def _get(self, url: SplitResult, start: int, end: int, sink: RangeSink) -> None:
        origin = (url.scheme, url.hostname or "", url.port or _default_port(url.scheme))
        request = (
            f"GET {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Range: bytes={start}-{end - 1}\r\nAccept-Encoding: identity\r\n"
            f"User-Agent: s3ckpt/{__version__}\r\n\r\n"
        ).encode("ascii")
        while True:
            connection = await self._connection(origin)
            try:
                await connection.get(request, start, end, sink)
            except StaleConnection:
                continue  # the server closed it while idle: not a failure of this request
            except ClientError:
                self._release(origin, connection)  # its error body was read whole
                raise
            except BaseException:
                connection.close()
                raise
            self._release(origin, connection)
            return

    async def _connection(self, origin: tuple[str, str, int]) -> Connection:
        idle = self._idle.get(origin, [])
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
        return await self._connect(origin)

    async def _connect(self, origin: tuple[str, str, int]) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = await asyncio.to_thread(tls_context, self.verify)
            tls = self._tls
        endpoint = f"{scheme}://{host}:{port}"
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(loop, self.read_timeout, endpoint),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                ),
                self.connect_timeout,
            )
        except ssl.SSLError as exc:
            raise tls_failed(endpoint, exc) from exc
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise connect_timeout(endpoint) from exc
        except OSError as exc:
            raise connection_failed(endpoint, exc) from exc
        return connection

    def _release(self, origin: tuple[str, str, int], connection: Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if connection.usable() and len(idle) < self.max_idle:
            idle.append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        self.close_idle()

    def close_idle(self) -> None:
        """Close the kept-alive connections (those in use close when their request ends)."""
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80
