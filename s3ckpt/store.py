"""A small, typed, async object-store API over aiobotocore, bound to one bucket.

Every method runs on the process's I/O loop (:mod:`s3ckpt.loop`) and raises only s3ckpt
errors (translated in :mod:`s3ckpt.error_mapping`); a missing object is
:class:`~s3ckpt.errors.ObjectNotFoundError`, a ``FileNotFoundError``. The store holds only
its config and bucket name, so it pickles and survives ``fork``: the client is created
lazily on the loop of whichever process uses it.

Requests are sent the way a fast client should talk to FlashBlade: path-style, no SHA-256
payload signing (``UNSIGNED-PAYLOAD``), and no checksums computed by botocore; callers
pass a CRC32C they computed with a native library instead.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from s3ckpt.config import S3Config
from s3ckpt.error_mapping import translated
from s3ckpt.errors import PreconditionFailedError, StorageError
from s3ckpt.http_body import MemoryBody
from s3ckpt.loop import io_loop

Body = bytes | bytearray | memoryview


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int
    etag: str
    last_modified: datetime | None = None


@dataclass(frozen=True)
class PartResult:
    part_number: int
    etag: str
    crc32c: str | None

    def as_complete_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"PartNumber": self.part_number, "ETag": self.etag}
        if self.crc32c:
            entry["ChecksumCRC32C"] = self.crc32c
        return entry


@dataclass(frozen=True)
class PendingUpload:
    key: str
    upload_id: str
    initiated: datetime | None


def crc32c_header(value: int) -> str:
    """S3's encoding of a CRC32C: base64 of the 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


class _ClientHandle:
    """An entered aiobotocore client plus the semaphore bounding its requests."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.client: Any = None
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self._ctx: Any = None
        self._lock = asyncio.Lock()

    async def get(self) -> Any:
        if self.client is None:
            async with self._lock:
                if self.client is None:
                    self._ctx = _create_client(self.config)
                    self.client = await self._ctx.__aenter__()
        return self.client

    async def aclose(self) -> None:
        if self._ctx is not None:
            await self._ctx.__aexit__(None, None, None)
            self._ctx = self.client = None


def _create_client(config: S3Config) -> Any:
    session = AioSession(profile=config.profile) if config.profile else AioSession()
    aio_config = AioConfig(
        signature_version="s3v4",
        s3={"addressing_style": config.addressing_style, "payload_signing_enabled": False},
        max_pool_connections=config.max_concurrency,
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        retries={"total_max_attempts": config.max_attempts, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
        # Validation rejects memoryview bodies, which is how tensor bytes are sent without a
        # copy; every request's parameters are built by this module.
        parameter_validation=False,
    )
    return session.create_client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region,
        aws_access_key_id=config.access_key_id,
        aws_secret_access_key=config.secret_access_key,
        aws_session_token=config.session_token,
        verify=config.verify,
        config=aio_config,
    )


def _handle(config: S3Config) -> _ClientHandle:
    resources = io_loop().resources
    key = ("s3-client", config.client_key())
    handle = resources.get(key)
    if handle is None:
        handle = resources[key] = _ClientHandle(config)
    return handle


class ObjectStore:
    """Async S3 operations on one bucket. Call the coroutines on :func:`s3ckpt.loop.io_loop`."""

    def __init__(self, config: S3Config, bucket: str) -> None:
        self.config = config
        self.bucket = bucket

    def __repr__(self) -> str:
        return f"ObjectStore(bucket={self.bucket!r}, endpoint_url={self.config.endpoint_url!r})"

    async def _call(self, operation: str, key: str | None, **params: Any) -> dict[str, Any]:
        handle = _handle(self.config)
        with translated(operation, self.bucket, key):
            client = await handle.get()
            async with handle.slots:
                method: Callable[..., Any] = getattr(client, _snake(operation))
                return await method(Bucket=self.bucket, **params)

    # -- whole objects ------------------------------------------------------------------

    async def put(
        self,
        key: str,
        body: Body,
        *,
        mode: Literal["overwrite", "create"] = "overwrite",
        crc32c: int | None = None,
        content_type: str | None = None,
    ) -> str:
        """Store ``body`` at ``key``; returns the ETag.

        ``mode="create"`` sends ``If-None-Match: *`` and raises
        :class:`PreconditionFailedError` if the key already exists.
        """
        params: dict[str, Any] = {"Key": key, "Body": MemoryBody(body)}
        if mode == "create":
            params["IfNoneMatch"] = "*"
        if crc32c is not None and self.config.checksums:
            params["ChecksumCRC32C"] = crc32c_header(crc32c)
        if content_type:
            params["ContentType"] = content_type
        response = await self._call("PutObject", key, **params)
        return str(response.get("ETag", ""))

    async def get(self, key: str) -> bytes:
        """The whole object's bytes (for small objects: manifests, metadata)."""
        handle = _handle(self.config)
        with translated("GetObject", self.bucket, key):
            client = await handle.get()
            async with handle.slots:
                response = await client.get_object(Bucket=self.bucket, Key=key)
                async with response["Body"] as stream:
                    return await stream.read()

    async def read_range(
        self, key: str, start: int, end: int, sink: Callable[[int, bytes], None]
    ) -> None:
        """Stream bytes ``[start, end)`` of ``key``, calling ``sink(offset, chunk)`` as they arrive.

        The sink copies each chunk where it belongs (usually straight into a tensor), so
        the whole range is never held twice.
        """
        handle = _handle(self.config)
        with translated("GetObject", self.bucket, key):
            client = await handle.get()
            async with handle.slots:
                response = await client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
                )
                position = start
                async with response["Body"] as stream:
                    # readchunk() hands over one received buffer as is; readany() and
                    # read(n) join everything buffered into a new bytes object first.
                    content = stream.raw_stream.content
                    while position < end:
                        chunk, _ = await content.readchunk()
                        if not chunk:
                            break
                        sink(position, chunk)
                        position += len(chunk)
                if position != end:
                    raise StorageError(
                        f"GetObject s3://{self.bucket}/{key} returned {position - start} bytes "
                        f"for a {end - start}-byte range",
                        operation="GetObject",
                        bucket=self.bucket,
                        key=key,
                    )

    async def head(self, key: str) -> ObjectMeta:
        response = await self._call("HeadObject", key, Key=key)
        return ObjectMeta(
            key,
            int(response["ContentLength"]),
            str(response.get("ETag", "")),
            response.get("LastModified"),
        )

    async def exists(self, key: str) -> bool:
        try:
            await self.head(key)
        except FileNotFoundError:
            return False
        return True

    async def head_bucket(self) -> None:
        await self._call("HeadBucket", None)

    async def list(self, prefix: str) -> AsyncIterator[ObjectMeta]:
        """Every object under ``prefix``, one LIST page (1000 keys) per request."""
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Prefix": prefix}
            if token:
                params["ContinuationToken"] = token
            response = await self._call("ListObjectsV2", None, **params)
            for item in response.get("Contents", []):
                yield ObjectMeta(
                    item["Key"],
                    int(item["Size"]),
                    str(item.get("ETag", "")),
                    item.get("LastModified"),
                )
            if not response.get("IsTruncated"):
                return
            token = response.get("NextContinuationToken")

    async def delete_many(self, keys: list[str]) -> None:
        """Delete ``keys`` with batched DeleteObjects (1000 per request); missing keys are fine."""
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            response = await self._call(
                "DeleteObjects", batch[0]["Key"], Delete={"Objects": batch, "Quiet": True}
            )
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"DeleteObjects failed for {len(errors)} key(s), first s3://{self.bucket}/{first.get('Key')}: "
                    f"{first.get('Code')}",
                    operation="DeleteObjects",
                    code=first.get("Code"),
                    bucket=self.bucket,
                    key=first.get("Key"),
                )

    async def delete_if_match(self, key: str, etag: str) -> None:
        """Delete ``key`` only while its ETag is still ``etag`` (``If-Match``).

        Raises :class:`PreconditionFailedError` if the object changed (or, on some stores,
        is gone). Stores that do not implement conditional deletes ignore the header, which
        makes this a plain delete; callers must be correct either way.
        """
        await self._call("DeleteObject", key, Key=key, IfMatch=etag)

    # -- multipart ---------------------------------------------------------------------

    async def create_multipart(self, key: str) -> str:
        params: dict[str, Any] = {"Key": key}
        if self.config.checksums:
            params["ChecksumAlgorithm"] = "CRC32C"
        response = await self._call("CreateMultipartUpload", key, **params)
        return str(response["UploadId"])

    async def upload_part(
        self, key: str, upload_id: str, part_number: int, body: Body, crc32c: int | None
    ) -> PartResult:
        params: dict[str, Any] = {
            "Key": key,
            "UploadId": upload_id,
            "PartNumber": part_number,
            "Body": MemoryBody(body),
        }
        checksum = crc32c_header(crc32c) if crc32c is not None and self.config.checksums else None
        if checksum:
            params["ChecksumCRC32C"] = checksum
        response = await self._call("UploadPart", key, **params)
        return PartResult(part_number, str(response["ETag"]), checksum)

    async def complete_multipart(
        self,
        key: str,
        upload_id: str,
        parts: list[PartResult],
        *,
        mode: Literal["overwrite", "create"] = "overwrite",
    ) -> str:
        params: dict[str, Any] = {
            "Key": key,
            "UploadId": upload_id,
            "MultipartUpload": {
                "Parts": [p.as_complete_entry() for p in sorted(parts, key=lambda p: p.part_number)]
            },
        }
        if mode == "create":
            params["IfNoneMatch"] = "*"
        response = await self._call("CompleteMultipartUpload", key, **params)
        return str(response.get("ETag", ""))

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort an upload; an upload that is already gone counts as aborted."""
        try:
            await self._call("AbortMultipartUpload", key, Key=key, UploadId=upload_id)
        except StorageError as exc:
            if exc.code not in ("NoSuchUpload", "404"):
                raise

    async def list_multipart_uploads(self, prefix: str) -> AsyncIterator[PendingUpload]:
        key_marker: str | None = None
        upload_marker: str | None = None
        while True:
            params: dict[str, Any] = {"Prefix": prefix}
            if key_marker:
                params["KeyMarker"] = key_marker
                params["UploadIdMarker"] = upload_marker or ""
            response = await self._call("ListMultipartUploads", None, **params)
            for item in response.get("Uploads", []):
                yield PendingUpload(item["Key"], item["UploadId"], item.get("Initiated"))
            if not response.get("IsTruncated"):
                return
            key_marker = response.get("NextKeyMarker")
            upload_marker = response.get("NextUploadIdMarker")


def _snake(operation: str) -> str:
    out = []
    for i, ch in enumerate(operation):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


__all__ = [
    "Body",
    "ObjectMeta",
    "ObjectStore",
    "PartResult",
    "PendingUpload",
    "PreconditionFailedError",
    "crc32c_header",
]
