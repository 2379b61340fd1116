"""The data plane's transport for one client: one connection pool, the PUTs of upload bodies
(one part at a time, or in batches sent by native threads), a save's other requests, the
ranged GETs; whatever it does not send goes through the aiobotocore transport it holds.

Where requests go is decided here and nowhere else: a request this plane does not serve
goes to the client; a redirect (a bucket in another region) sends that request, and every
later one, through the client, which follows redirects (:meth:`DataPlane.redirected`); an
odd answer to a ranged GET (chunked, a redirect) sends that GET, and every later one,
through the client (:meth:`DataPlane.odd_read`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from s3ckpt.s3.wire.batch import NativeBatch, native_batches
from s3ckpt.s3.wire.calls import SignedCalls
from s3ckpt.s3.wire.get_exchange import UnsupportedResponse
from s3ckpt.s3.wire.gets import RangedGets
from s3ckpt.s3.wire.on_loop import BodyTransport
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.range_body import RangeBody
from s3ckpt.s3.wire.uploads import (
    BodySender,
    Redirected,
    SignedPuts,
    is_redirect,
    put_headers,
)

if TYPE_CHECKING:
    from s3ckpt.s3.transport import Transport

log = logging.getLogger(__name__)


class DataPlane:
    """A :class:`~s3ckpt.s3.transport.Transport` for ``client`` on one pool: upload bodies
    and a save's other requests (``puts``, ``calls``; ``uploads``), ranged GETs (``gets``;
    ``reads``), every other request through ``client_transport``. ``batches``: batches of
    parts to plain-HTTP endpoints go to native threads (:mod:`~.batch`) where the sender
    is built."""

    def __init__(
        self,
        client: Any,
        client_transport: Transport,
        *,
        verify: bool | str,
        connect_timeout: float,
        read_timeout: float,
        max_concurrency: int,
        uploads: bool,
        reads: bool,
        batches: bool = True,
    ) -> None:
        self.client_transport = client_transport
        self.pool = ConnectionPool(
            verify=verify,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_idle=max_concurrency,
        )
        self.gets: RangedGets | None = None
        self.puts: SignedPuts | None = None
        self.calls: SignedCalls | None = None
        if reads:
            self.gets = RangedGets(client, self.pool)
        if uploads:
            transport = BodyTransport(self.pool)
            batch = NativeBatch(self.pool) if batches and native_batches() else None
            self.puts = SignedPuts(client, transport, batch)
            self.calls = SignedCalls(client, transport, self.puts.signer, self.puts.addresses)
            BodySender(transport).register(client)

    def redirected(self) -> None:
        """The endpoint redirected a request: send every later one through the client."""
        self.puts = self.calls = None

    def odd_read(self, reason: str) -> None:
        """The endpoint answered a ranged GET oddly: read through the client from now on."""
        if self.gets is not None:
            log.warning("ranged GETs fall back to aiobotocore: %s", reason)
            self.gets = None

    async def request(self, bucket: str, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        calls = self.calls
        if calls is not None and calls.serves(operation, params):
            try:
                answer = await calls.call(bucket, operation, params)
            except Redirected:
                self.redirected()
            else:
                if answer is not None:
                    return answer
        return await self.client_transport.request(bucket, operation, params)

    async def put_object(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        puts, headers = self.puts, put_headers(params)
        if puts is not None and headers is not None:
            try:
                return await puts.put_object(bucket, params["Key"], params["Body"], headers)
            except Redirected:
                self.redirected()
        return await self.client_transport.put_object(bucket, params)

    async def upload_part(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        """One part: a redirect fails it with the client's error, and sends every later one
        through the client."""
        puts = self.puts
        if puts is None:
            return await self.client_transport.upload_part(bucket, params)
        try:
            return await puts.upload_part(
                bucket,
                params["Key"],
                params["UploadId"],
                params["PartNumber"],
                params["Body"],
                params.get("ChecksumCRC32C"),
            )
        except Exception as exc:
            if is_redirect(exc):
                self.redirected()
            raise

    def sends_batches(self) -> bool:
        return self.puts is not None and self.puts.batch is not None

    async def try_parts(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        parts: list[tuple[int, memoryview, str | None]],
        connections: int,
    ) -> list[dict[str, Any] | Exception] | None:
        puts = self.puts
        if puts is None:
            return None
        outcomes = await puts.try_parts(bucket, key, upload_id, parts, connections)
        if any(is_redirect(outcome) for outcome in outcomes or ()):
            self.redirected()
        return outcomes

    async def get_object(self, bucket: str, key: str) -> tuple[bytes, str]:
        return await self.client_transport.get_object(bucket, key)

    async def open_range(self, bucket: str, key: str, start: int, end: int) -> RangeBody:
        gets = self.gets
        if gets is not None:
            try:
                return await gets.open(bucket, key, start, end)
            except UnsupportedResponse as exc:
                self.odd_read(str(exc))
        return await self.client_transport.open_range(bucket, key, start, end)

    def close_idle(self) -> None:
        self.pool.close_idle()

    async def aclose(self) -> None:
        await self.pool.aclose()
