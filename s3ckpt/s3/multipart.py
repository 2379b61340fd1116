"""Multipart uploads and server-side copies: the operations a large object is written with,
and the listing of the multipart uploads left open under a prefix.

Every retry knows what its request meant: a retried CreateMultipartUpload aborts the
uploads its lost responses created, and a retried CompleteMultipartUpload whose first
response was lost recognises its own landed object.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from botocore.exceptions import ClientError

from s3ckpt.errors import StorageError
from s3ckpt.s3.error_mapping import error_code
from s3ckpt.s3.operations import CompletedParts, Parsed
from s3ckpt.s3.requests import Body, Retrying, StorePart, flat
from s3ckpt.s3.wire.batch import NotSent

log = logging.getLogger(__name__)


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


class MultipartUploads(StorePart):
    """The multipart and copy operations of :class:`~s3ckpt.s3.store.ObjectStore`, sent
    through its ``requests``."""

    async def create_multipart(self, key: str) -> str:
        async with self.requests.retrying("CreateMultipartUpload", key) as tries:
            while True:
                try:
                    response = await self.requests.try_create_multipart_upload(key, tries)
                    break
                except Exception as exc:
                    await tries.failed(exc)
        upload_id = str(response["UploadId"])
        if tries.number > 1:  # earlier tries may have created uploads whose ids never arrived
            await self._abort_others(key, upload_id)
        return upload_id

    async def list_multipart_uploads(self, prefix: str) -> AsyncIterator[PendingUpload]:
        """Every multipart upload left open under ``prefix``, page by page; a page marked
        truncated that names no next one (or the same again) ends it with an error."""
        key_marker: str | None = None
        upload_marker: str | None = None
        while True:
            response = await self.requests.list_multipart_uploads(
                prefix,
                key_marker=key_marker or None,
                upload_id_marker=(upload_marker or "") if key_marker else None,
            )
            for item in response.get("Uploads", []):
                yield PendingUpload(item["Key"], item["UploadId"], item.get("Initiated"))
            if not response.get("IsTruncated"):
                return
            if not response.get("NextKeyMarker") or (
                (response.get("NextKeyMarker"), response.get("NextUploadIdMarker"))
                == (key_marker, upload_marker)
            ):
                raise self.stuck_listing("ListMultipartUploads", prefix)
            key_marker = response.get("NextKeyMarker")
            upload_marker = response.get("NextUploadIdMarker")

    async def _abort_others(self, key: str, upload_id: str) -> None:
        """Abort the uploads of ``key`` other than ``upload_id`` (keys are unique per save).

        Best effort: what this misses, ``gc`` removes later.
        """
        try:
            async for pending in self.list_multipart_uploads(key):
                if pending.key == key and pending.upload_id != upload_id:
                    await self.abort_multipart(key, pending.upload_id)
        except StorageError as exc:
            log.warning("could not abort stray uploads of %s: %s", self.requests.where(key), exc)

    async def upload_part(
        self,
        key: str,
        upload_id: str,
        part_number: int,
        body: Body,
        crc32c: int | None,
        *,
        first_try: Exception | None = None,
    ) -> PartResult:
        """Upload one part, retried under the policy. ``first_try``: how a try already
        made failed (:meth:`try_parts`), which counts as the first: retried (or raised) as
        any try's failure; a :class:`NotSent` one means the part is sent now."""
        params = self._part_params(key, upload_id, part_number, body, crc32c)
        async with self.requests.retrying("UploadPart", key) as tries:
            if first_try is not None and not isinstance(first_try, NotSent):
                await tries.failed(first_try)
            while True:
                try:
                    response = await self.requests.try_upload_part(params, tries)
                    break
                except Exception as exc:
                    await tries.failed(exc)
        return PartResult(part_number, str(response["ETag"]), params.get("ChecksumCRC32C"))

    async def try_parts(
        self, key: str, upload_id: str, parts: list[tuple[int, Body, int | None]]
    ) -> list[PartResult | Exception] | None:
        """One try of each ``(part number, body, CRC32C)``, sent together as one batch
        (:meth:`Requests.try_parts <s3ckpt.s3.requests.Requests.try_parts>`): each part's
        result, or how its try failed (for :meth:`upload_part`'s ``first_try``). None
        where parts are sent one at a time."""
        tries = []
        for number, body, crc32c in parts:
            params = self._part_params(key, upload_id, number, body, crc32c)
            tries.append((number, params["Body"], params.get("ChecksumCRC32C")))
        outcomes = await self.requests.try_parts(key, upload_id, tries)
        if outcomes is None:
            return None
        return [
            outcome
            if isinstance(outcome, Exception)
            else PartResult(number, str(outcome["ETag"]), checksum)
            for (number, _, checksum), outcome in zip(tries, outcomes, strict=True)
        ]

    def _part_params(
        self, key: str, upload_id: str, part_number: int, body: Body, crc32c: int | None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "Key": key,
            "UploadId": upload_id,
            "PartNumber": part_number,
            "Body": flat(body),
        }
        if crc32c is not None and self.requests.config.checksums:
            params["ChecksumCRC32C"] = crc32c_header(crc32c)
        return params

    async def complete_multipart(
        self,
        key: str,
        upload_id: str,
        parts: list[PartResult],
        *,
        mode: Literal["overwrite", "create"] = "overwrite",
    ) -> str:
        entries = [p.as_complete_entry() for p in sorted(parts, key=lambda p: p.part_number)]
        async with self.requests.retrying("CompleteMultipartUpload", key) as tries:
            while True:
                try:
                    response = await self._complete_once(
                        key, upload_id, entries, tries, create=mode == "create"
                    )
                    break
                except Exception as exc:
                    await tries.failed(exc)
        return str(response.get("ETag", ""))

    async def _complete_once(
        self, key: str, upload_id: str, parts: CompletedParts, tries: Retrying, *, create: bool
    ) -> Parsed:
        """One try of :meth:`complete_multipart` among ``tries``."""
        try:
            return await self.requests.try_complete_multipart_upload(
                key, upload_id, parts, tries, create=create
            )
        except ClientError as exc:
            # The upload is gone but the object is there: an earlier try completed it
            # and its response was lost. The key is unique to this save: it is ours.
            if error_code(exc) in ("NoSuchUpload", "404"):
                landed = await self.requests.head_or_none(key, tries)
                if landed is not None:
                    return landed
            raise

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort an upload; an upload that is already gone counts as aborted."""
        try:
            await self.requests.abort_multipart_upload(key, upload_id)
        except StorageError as exc:
            if exc.code not in ("NoSuchUpload", "404"):
                raise

    # -- server-side copies (same endpoint) ---------------------------------------------

    async def copy(self, key: str, source_bucket: str, source_key: str) -> str:
        """Copy ``source_bucket/source_key`` (at most 5 GiB) to ``key`` inside the store
        (CopyObject): no byte leaves the server. Returns the new object's ETag."""
        response = await self.requests.copy_object(key, source_bucket, source_key)
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
        response = await self.requests.upload_part_copy(key, upload_id, part_number, source)
        result = response.get("CopyPartResult", {})
        return PartResult(part_number, str(result["ETag"]), result.get("ChecksumCRC32C"))
