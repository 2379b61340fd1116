"""A small, typed, async object-store API over aiobotocore, bound to one bucket.

Every method runs on the process's I/O loop (:mod:`s3ckpt.s3.loop`) and raises only s3ckpt
errors (translated in :mod:`s3ckpt.s3.error_mapping`); a missing object is
:class:`~s3ckpt.errors.ObjectNotFoundError`, a ``FileNotFoundError``. The store holds only
its config and bucket name, so it pickles and survives ``fork``: the client is created
lazily on the loop of whichever process uses it.

Requests go through the shared client of :mod:`s3ckpt.s3.client` (path-style, no SHA-256
payload signing, no botocore checksums: callers pass a CRC32C computed natively), except
the body of ranged GETs, which :mod:`s3ckpt.s3.range_get` receives straight into the
caller's memory (one attempt; the retries are here).

Failed requests are retried here, by :mod:`s3ckpt.s3.retry` (botocore's own retries are off),
because a retry must know what the request meant: a ranged GET resumes at the first byte
not yet delivered, so its sink sees every byte exactly once; a retried create-only PUT or
CompleteMultipartUpload whose first response was lost recognises its own landed write
instead of reporting a conflict; a retried CreateMultipartUpload aborts the uploads its
lost responses created. Bodies are memory, so resending one costs no copy.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeVar

from botocore import xform_name
from botocore.exceptions import ClientError

from s3ckpt.config import S3Config
from s3ckpt.errors import PreconditionFailedError, StorageError
from s3ckpt.s3 import range_get, retry
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.error_mapping import PRECONDITION_CODES, error_code, translate_final, translated
from s3ckpt.s3.http_body import MemoryBody
from s3ckpt.s3.http_response import RangeSink
from s3ckpt.s3.range_get import ResumingSink

Body = bytes | bytearray | memoryview
T = TypeVar("T")
log = logging.getLogger(__name__)


_LAST_CHARACTER = "\U0010ffff"


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


class ObjectStore:
    """Async S3 operations on one bucket. Call the coroutines on :func:`s3ckpt.s3.loop.io_loop`.

    ``deadline`` (a ``time.monotonic()`` instant, see :meth:`with_deadline`) ends retrying:
    a request that fails after it is not tried again.
    """

    def __init__(self, config: S3Config, bucket: str, *, deadline: float | None = None) -> None:
        self.config = config
        self.bucket = bucket
        self.deadline = deadline

    def __repr__(self) -> str:
        return f"ObjectStore(bucket={self.bucket!r}, endpoint_url={self.config.endpoint_url!r})"

    def with_deadline(self, seconds: float | None) -> ObjectStore:
        """This store with a retry budget of ``seconds`` from now (``None``: unlimited).

        A save or load takes one such store for all its requests, so ``S3Config.deadline_s``
        bounds how long faults can keep it retrying.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        return ObjectStore(self.config, self.bucket, deadline=deadline)

    # -- requests and their retries ---------------------------------------------------------

    async def _retrying(
        self, operation: str, key: str | None, attempt: Callable[[int], Awaitable[T]]
    ) -> T:
        """Run ``attempt(n)`` under the retry policy; every failure leaves as an s3ckpt error."""
        policy = retry.RetryPolicy(max_attempts=self.config.max_attempts, deadline=self.deadline)
        with translated(operation, self.bucket, key):
            try:
                return await retry.run(attempt, policy, what=f"{operation} {self._where(key)}")
            except retry.RetryError as exc:
                raise translate_final(
                    exc.last,
                    exc.attempts,
                    out_of_time=exc.out_of_time,
                    operation=operation,
                    bucket=self.bucket,
                    key=key,
                ) from exc.last

    async def _request(self, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        """One try of one request, holding one of the client's request slots."""
        handle = client_handle(self.config)
        client = await handle.get()
        async with handle.slots:
            method: Callable[..., Any] = getattr(client, xform_name(operation))
            return await method(Bucket=self.bucket, **params)

    async def _call(self, operation: str, key: str | None, **params: Any) -> dict[str, Any]:
        return await self._retrying(operation, key, lambda _: self._request(operation, params))

    def _where(self, key: str | None) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

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
        :class:`PreconditionFailedError` if the key already exists. When it finds the key
        taken, the object is read back: holding exactly ``body``, it is this put's own
        write from a try whose response was lost (by s3ckpt's retry or aiohttp's silent
        resend of an idempotent request), so the put succeeded.
        """
        params: dict[str, Any] = {"Key": key, "Body": MemoryBody(body)}
        if mode == "create":
            params["IfNoneMatch"] = "*"
        if crc32c is not None and self.config.checksums:
            params["ChecksumCRC32C"] = crc32c_header(crc32c)
        if content_type:
            params["ContentType"] = content_type

        async def attempt(_: int) -> dict[str, Any]:
            try:
                return await self._request("PutObject", params)
            except ClientError as exc:
                if mode == "create" and error_code(exc) in PRECONDITION_CODES:
                    etag = await self._etag_if_holds(key, body)
                    if etag is not None:
                        return {"ETag": etag}
                raise

        response = await self._retrying("PutObject", key, attempt)
        return str(response.get("ETag", ""))

    async def get(self, key: str) -> bytes:
        """The whole object's bytes (for small objects: manifests, metadata)."""
        body, _ = await self._retrying("GetObject", key, lambda _: self._fetch(key))
        return body

    async def _fetch(self, key: str) -> tuple[bytes, str]:
        """One GET of a whole object: its bytes and ETag."""
        handle = client_handle(self.config)
        client = await handle.get()
        async with handle.slots:
            response = await client.get_object(Bucket=self.bucket, Key=key)
            async with response["Body"] as stream:
                return await stream.read(), str(response.get("ETag", ""))

    async def _etag_if_holds(self, key: str, body: Body) -> str | None:
        """The ETag of ``key`` if it holds exactly ``body``, else None."""
        try:
            stored, etag = await self._fetch(key)
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        return etag if memoryview(body).cast("B") == stored else None

    async def read_range(self, key: str, start: int, end: int, sink: RangeSink) -> None:
        """Receive bytes ``[start, end)`` of ``key`` into ``sink`` as they arrive.

        The sink names the memory each byte goes to (usually a tensor), so the range is
        never held twice; with :mod:`s3ckpt.s3.http_range` the socket writes into it directly.
        Bytes arrive in offset order and each exactly once: a retry asks only for the
        bytes not yet delivered.
        """
        progress = ResumingSink(sink, start)

        async def attempt(_: int) -> None:
            if progress.position < end:
                await range_get.receive(
                    self.config, self.bucket, key, progress.position, end, progress
                )

        await self._retrying("GetObject", key, attempt)

    async def close_idle_connections(self) -> None:
        """Make the next ranged GETs open fresh connections (after bytes came in damaged)."""
        client_handle(self.config).close_idle()

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
        async for entry in self._pages(prefix, None):
            if isinstance(entry, ObjectMeta):
                yield entry

    async def list_level(self, prefix: str) -> AsyncIterator[ObjectMeta | str]:
        """One level below ``prefix`` (which ends in ``/``): its objects, and each deeper
        "directory" once, as a key prefix ending in ``/`` (``Delimiter="/"``). A listing of
        N checkpoints costs N/1000 pages however many objects each holds."""
        async for entry in self._pages(prefix, "/"):
            yield entry

    async def _pages(self, prefix: str, delimiter: str | None) -> AsyncIterator[ObjectMeta | str]:
        """ListObjectsV2 page by page.

        A page marked truncated without a continuation token (some servers send none) is
        followed with ``StartAfter`` its last key; one that gives neither ends the listing
        with an error rather than asking for the same page forever.
        """
        base: dict[str, Any] = {"Prefix": prefix}
        if delimiter:
            base["Delimiter"] = delimiter
        params, seen = dict(base), set()
        while True:
            response = await self._call("ListObjectsV2", None, **params)
            contents = response.get("Contents", [])
            for item in contents:
                yield ObjectMeta(
                    item["Key"],
                    int(item["Size"]),
                    str(item.get("ETag", "")),
                    item.get("LastModified"),
                )
            folders = [str(p["Prefix"]) for p in response.get("CommonPrefixes") or []]
            for folder in folders:
                if folder not in seen:
                    seen.add(folder)
                    yield folder
            if not response.get("IsTruncated"):
                return
            params = dict(base)
            # Past a folder means past every key in it: U+10FFFF sorts after any of them.
            ends = [*(c["Key"] for c in contents), *(f + _LAST_CHARACTER for f in folders)]
            last = max(ends, default=None)
            if response.get("NextContinuationToken"):
                params["ContinuationToken"] = response["NextContinuationToken"]
            elif last is not None:
                params["StartAfter"] = last
            else:
                raise _stuck_listing("ListObjectsV2", self.bucket, prefix)

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
        makes this a plain delete; callers must be correct either way. A failed
        precondition with the key gone is an earlier try's success, its response lost.
        """
        params = {"Key": key, "IfMatch": etag}

        async def attempt(_: int) -> dict[str, Any]:
            try:
                return await self._request("DeleteObject", params)
            except ClientError as exc:
                if error_code(exc) in PRECONDITION_CODES and await self._head_or_none(key) is None:
                    return {}
                raise

        await self._retrying("DeleteObject", key, attempt)

    async def _head_or_none(self, key: str) -> dict[str, Any] | None:
        """One HEAD inside an attempt: the response, or None if the key is absent."""
        try:
            return await self._request("HeadObject", {"Key": key})
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    # -- server-side copies (same endpoint) ---------------------------------------------

    async def copy(self, key: str, source_bucket: str, source_key: str) -> str:
        """Copy ``source_bucket/source_key`` (at most 5 GiB) to ``key`` inside the store
        (CopyObject): no byte leaves the server. Returns the new object's ETag."""
        source = {"Bucket": source_bucket, "Key": source_key}
        response = await self._call("CopyObject", key, Key=key, CopySource=source)
        return str(response.get("CopyObjectResult", {}).get("ETag", ""))

    async def upload_part_copy(
        self,
        key: str,
        upload_id: str,
        part_number: int,
        source: tuple[str, str, int, int],
    ) -> PartResult:
        """One part of a multipart upload copied server-side (UploadPartCopy) from bytes
        ``[start, end)`` of ``source = (bucket, key, start, end)``: how objects over
        CopyObject's 5 GiB limit are copied."""
        bucket, source_key, start, end = source
        response = await self._call(
            "UploadPartCopy",
            key,
            Key=key,
            UploadId=upload_id,
            PartNumber=part_number,
            CopySource={"Bucket": bucket, "Key": source_key},
            CopySourceRange=f"bytes={start}-{end - 1}",
        )
        result = response.get("CopyPartResult", {})
        return PartResult(part_number, str(result["ETag"]), result.get("ChecksumCRC32C"))

    # -- multipart ---------------------------------------------------------------------

    async def create_multipart(self, key: str) -> str:
        params: dict[str, Any] = {"Key": key}
        if self.config.checksums:
            params["ChecksumAlgorithm"] = "CRC32C"

        async def attempt(number: int) -> tuple[int, dict[str, Any]]:
            return number, await self._request("CreateMultipartUpload", params)

        number, response = await self._retrying("CreateMultipartUpload", key, attempt)
        upload_id = str(response["UploadId"])
        if number > 1:  # earlier tries may have created uploads whose ids never arrived
            await self._abort_others(key, upload_id)
        return upload_id

    async def _abort_others(self, key: str, upload_id: str) -> None:
        """Abort the uploads of ``key`` other than ``upload_id`` (keys are unique per save).

        Best effort: what this misses, ``gc`` removes later.
        """
        try:
            async for pending in self.list_multipart_uploads(key):
                if pending.key == key and pending.upload_id != upload_id:
                    await self.abort_multipart(key, pending.upload_id)
        except StorageError as exc:
            log.warning("could not abort stray uploads of %s: %s", self._where(key), exc)

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

        async def attempt(_: int) -> dict[str, Any]:
            try:
                return await self._request("CompleteMultipartUpload", params)
            except ClientError as exc:
                # The upload is gone but the object is there: an earlier try completed it
                # and its response was lost. The key is unique to this save: it is ours.
                if error_code(exc) in ("NoSuchUpload", "404"):
                    landed = await self._head_or_none(key)
                    if landed is not None:
                        return landed
                raise

        response = await self._retrying("CompleteMultipartUpload", key, attempt)
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
            if not response.get("NextKeyMarker") or (
                (response.get("NextKeyMarker"), response.get("NextUploadIdMarker"))
                == (key_marker, upload_marker)
            ):
                raise _stuck_listing("ListMultipartUploads", self.bucket, prefix)
            key_marker = response.get("NextKeyMarker")
            upload_marker = response.get("NextUploadIdMarker")


def _stuck_listing(operation: str, bucket: str, prefix: str) -> StorageError:
    return StorageError(
        f"{operation} s3://{bucket}/{prefix} failed: a page was marked truncated but gave no "
        "way to the next one",
        operation=operation,
        bucket=bucket,
        key=prefix,
    )


__all__ = [
    "Body",
    "ObjectMeta",
    "ObjectStore",
    "PartResult",
    "PendingUpload",
    "PreconditionFailedError",
    "crc32c_header",
]
