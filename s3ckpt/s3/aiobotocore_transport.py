"""The transport through the aiobotocore client: every operation as its method sends it.

What :func:`~s3ckpt.s3.transport.choose_transport` picks where the data plane does not
serve the endpoint, and what the data plane hands the requests it does not send.
"""

from __future__ import annotations

from typing import Any

from s3ckpt.s3 import get_attempt
from s3ckpt.s3.compat_botocore import operation_method
from s3ckpt.s3.error_mapping import check_s3_answer
from s3ckpt.s3.wire import RangeBody


class AiobotocoreTransport:
    """A :class:`~s3ckpt.s3.transport.Transport` through ``client``; ``endpoint`` names
    the endpoint in warnings."""

    def __init__(self, client: Any, endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint

    async def request(self, bucket: str, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        return await operation_method(self.client, operation)(Bucket=bucket, **params)

    async def put_object(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        return await self.request(bucket, "PutObject", params)

    async def upload_part(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        return await self.request(bucket, "UploadPart", params)

    def sends_batches(self) -> bool:
        return False

    async def try_parts(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        parts: list[tuple[int, memoryview, str | None]],
        connections: int,
    ) -> list[dict[str, Any] | Exception] | None:
        return None

    async def get_object(self, bucket: str, key: str) -> tuple[bytes, str]:
        response = await self.client.get_object(Bucket=bucket, Key=key)
        async with response["Body"] as stream:
            check_s3_answer("GetObject", response, bucket, key)  # no web pages
            return await stream.read(), str(response.get("ETag", ""))

    async def open_range(self, bucket: str, key: str, start: int, end: int) -> RangeBody:
        return await get_attempt.open_range(self.client, self.endpoint, bucket, key, start, end)

    def close_idle(self) -> None:
        """Nothing to close: aiohttp's pool keeps its own."""

    async def aclose(self) -> None:
        """Nothing to close: the client is its owner's (:mod:`s3ckpt.s3.client`)."""
