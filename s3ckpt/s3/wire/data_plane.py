"""The data plane of one client: one connection pool, the part uploads (one at a time, or
in batches sent by native threads), the upload sender, the ranged GETs."""

from __future__ import annotations

from typing import Any

from s3ckpt.s3.wire.batch import NativeBatch, native_batches
from s3ckpt.s3.wire.calls import SignedCalls
from s3ckpt.s3.wire.gets import RangedGets
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.uploads import BodySender, BodyTransport, SignedUploads


class DataPlane:
    """Part uploads and whole-object PUTs (``parts``), other upload bodies, a save's other
    requests (``calls``: HEADs, multipart create and complete, listings, batch deletes)
    and ranged GETs (``gets``) of ``client``, on one pool; ``batches``: batches of parts to plain-HTTP endpoints go to
    native threads (:mod:`~.batch`) where the sender is built."""

    def __init__(
        self,
        client: Any,
        *,
        verify: bool | str,
        connect_timeout: float,
        read_timeout: float,
        max_concurrency: int,
        uploads: bool,
        reads: bool,
        batches: bool = True,
    ) -> None:
        self.pool = ConnectionPool(
            verify=verify,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_idle=max_concurrency,
        )
        self.gets: RangedGets | None = None
        self.parts: SignedUploads | None = None
        self.calls: SignedCalls | None = None
        if reads:
            self.gets = RangedGets(client, self.pool)
        if uploads:
            transport = BodyTransport(self.pool)
            batch = NativeBatch(self.pool) if batches and native_batches() else None
            self.parts = SignedUploads(client, transport, batch)
            self.calls = SignedCalls(client, transport, self.parts.signer, self.parts.addresses)
            BodySender(transport).register(client)

    def stop_reads(self) -> None:
        """Leave every later ranged GET to aiobotocore (the endpoint answered one oddly)."""
        self.gets = None

    def close_idle(self) -> None:
        """Close the kept-alive connections, so the next requests open new ones."""
        self.pool.close_idle()

    async def aclose(self) -> None:
        await self.pool.aclose()
