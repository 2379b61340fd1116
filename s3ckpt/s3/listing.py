"""Listing a bucket: objects under a prefix (recursively or one level at a time) and the
multipart uploads left open there, page by page, on servers that paginate oddly too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from s3ckpt.errors import StorageError
from s3ckpt.s3.requests import StorePart

_LAST_CHARACTER = "\U0010ffff"


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int
    etag: str
    last_modified: datetime | None = None


@dataclass(frozen=True)
class PendingUpload:
    key: str
    upload_id: str
    initiated: datetime | None


class Listings(StorePart):
    """The listing operations of :class:`~s3ckpt.s3.store.ObjectStore`, sent through its
    ``requests``."""

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
        page: dict[str, str] = {}  # where the next page starts
        seen = set()
        while True:
            response = await self.requests.list_objects(prefix, delimiter=delimiter, **page)
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
            # Past a folder means past every key in it: U+10FFFF sorts after any of them.
            ends = [*(c["Key"] for c in contents), *(f + _LAST_CHARACTER for f in folders)]
            last = max(ends, default=None)
            if response.get("NextContinuationToken"):
                page = {"continuation_token": response["NextContinuationToken"]}
            elif last is not None:
                page = {"start_after": last}
            else:
                raise _stuck_listing("ListObjectsV2", self.requests.bucket, prefix)

    async def list_multipart_uploads(self, prefix: str) -> AsyncIterator[PendingUpload]:
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
                raise _stuck_listing("ListMultipartUploads", self.requests.bucket, prefix)
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
