"""The transport through the aiobotocore client: every operation as its method sends it.

What :func:`~s3ckpt.s3.transport.choose_transport` picks where the data plane does not
serve the endpoint, and what the data plane hands the requests it does not send.
"""

from __future__ import annotations

from typing import Any

from s3ckpt.s3 import get_attempt, operations
from s3ckpt.s3.error_mapping import check_s3_answer
from s3ckpt.s3.operations import CompletedParts, ObjectIds, Parsed
from s3ckpt.s3.wire import RangeBody


class AiobotocoreTransport:
    """A :class:`~s3ckpt.s3.transport.Transport` through ``client``; ``endpoint`` names
    the endpoint in warnings."""

    def __init__(self, client: Any, endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint

    async def head_object(self, bucket: str, key: str) -> Parsed:
        return await self.client.head_object(Bucket=bucket, **operations.head_object(key))

    async def head_bucket(self, bucket: str) -> Parsed:
        return await self.client.head_bucket(Bucket=bucket)

    async def create_multipart_upload(self, bucket: str, key: str, *, checksum: bool) -> Parsed:
        params = operations.create_multipart_upload(key, checksum=checksum)
        return await self.client.create_multipart_upload(Bucket=bucket, **params)

    async def complete_multipart_upload(
        self, bucket: str, key: str, upload_id: str, parts: CompletedParts, *, create: bool
    ) -> Parsed:
        params = operations.complete_multipart_upload(key, upload_id, parts, create=create)
        return await self.client.complete_multipart_upload(Bucket=bucket, **params)

    async def abort_multipart_upload(self, bucket: str, key: str, upload_id: str) -> Parsed:
        params = operations.abort_multipart_upload(key, upload_id)
        return await self.client.abort_multipart_upload(Bucket=bucket, **params)

    async def list_objects(self, bucket: str, prefix: str, **page: str | None) -> Parsed:
        params = operations.list_objects(prefix, **page)
        return await self.client.list_objects_v2(Bucket=bucket, **params)

    async def list_multipart_uploads(self, bucket: str, prefix: str, **page: str | None) -> Parsed:
        params = operations.list_multipart_uploads(prefix, **page)
        return await self.client.list_multipart_uploads(Bucket=bucket, **params)

    async def list_object_versions(self, bucket: str, prefix: str, **page: str | None) -> Parsed:
        params = operations.list_object_versions(prefix, **page)
        return await self.client.list_object_versions(Bucket=bucket, **params)

    async def copy_object(
        self, bucket: str, key: str, source_bucket: str, source_key: str
    ) -> Parsed:
        params = operations.copy_object(key, source_bucket, source_key)
        return await self.client.copy_object(Bucket=bucket, **params)

    async def upload_part_copy(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        part_number: int,
        source: tuple[str, str, int, int],
    ) -> Parsed:
        params = operations.upload_part_copy(key, upload_id, part_number, source)
        return await self.client.upload_part_copy(Bucket=bucket, **params)

    async def delete_object(self, bucket: str, key: str, *, if_match: str | None) -> Parsed:
        params = operations.delete_object(key, if_match=if_match)
        return await self.client.delete_object(Bucket=bucket, **params)

    async def delete_objects(self, bucket: str, objects: ObjectIds) -> Parsed:
        params = operations.delete_objects(objects)
        return await self.client.delete_objects(Bucket=bucket, **params)

    async def get_bucket_versioning(self, bucket: str) -> Parsed:
        return await self.client.get_bucket_versioning(Bucket=bucket)

    async def get_bucket_lifecycle_configuration(self, bucket: str) -> Parsed:
        return await self.client.get_bucket_lifecycle_configuration(Bucket=bucket)

    async def put_object(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        return await self.client.put_object(Bucket=bucket, **params)

    async def upload_part(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        return await self.client.upload_part(Bucket=bucket, **params)

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
