"""Bucket versioning: its state, the versions under a prefix, deletes by version id.

On a bucket with versioning on (``Enabled``, or ``Suspended`` after it was), a DELETE
without a version id removes nothing: it adds a *delete marker* that hides the key, and
the bytes stay as a noncurrent version. Freeing them takes a delete naming the version.
Listings (``ListObjectsV2``) and GETs without a version id see only current versions, so
s3ckpt's readers never see a noncurrent one.

These requests go through the store's :class:`~s3ckpt.s3.requests.Requests` (its retries,
its error translation). A store that does not implement versioning answers
``GetBucketVersioning`` with 501 or 405 (:data:`~s3ckpt.s3.error_mapping.UNSUPPORTED_CODES`):
:func:`versioning` reads that as ``"never"``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from s3ckpt.errors import StorageError
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES
from s3ckpt.s3.store import ObjectStore

Versioning = Literal["Enabled", "Suspended", "never"]
DELETE_BATCH = 1000  # versions per DeleteObjects request, S3's maximum


@dataclass(frozen=True)
class ObjectVersion:
    """One entry of ``ListObjectVersions``: a version of ``key``, or a delete marker."""

    key: str
    version_id: str
    latest: bool  # the current entry of the key (a marker that is latest hides the key)
    marker: bool  # a delete marker: no bytes
    size: int = 0
    etag: str = ""
    last_modified: datetime | None = None


async def versioning(store: ObjectStore) -> Versioning:
    """The bucket's versioning state, from one ``GetBucketVersioning``: ``"Enabled"``,
    ``"Suspended"``, or ``"never"`` (never enabled, or not implemented by the store).
    Other errors (a policy that denies the request, say) propagate."""
    try:
        answer = await store.requests.get_bucket_versioning()
    except StorageError as exc:
        if exc.code in UNSUPPORTED_CODES:
            return "never"
        raise
    status = answer.get("Status")
    return status if status in ("Enabled", "Suspended") else "never"


async def list_versions(store: ObjectStore, prefix: str) -> AsyncIterator[ObjectVersion]:
    """Every version and delete marker under ``prefix``, key by key, newest first within
    a key, one ``ListObjectVersions`` page (1000 entries) per request."""
    asked: tuple[str | None, str | None] = (None, None)  # the markers this page started at
    while True:
        answer = await store.requests.list_object_versions(
            prefix, key_marker=asked[0], version_id_marker=asked[1]
        )
        entries = [
            *(_entry(v, marker=False) for v in answer.get("Versions") or []),
            *(_entry(m, marker=True) for m in answer.get("DeleteMarkers") or []),
        ]
        # S3 orders a page by key, then newest first; botocore splits it in two lists.
        entries.sort(key=lambda e: (e.key, not e.latest, -_time(e)))
        for entry in entries:
            yield entry
        if not answer.get("IsTruncated"):
            return
        marker = (answer.get("NextKeyMarker"), answer.get("NextVersionIdMarker"))
        if not marker[0] or marker == asked:
            raise StorageError(
                f"ListObjectVersions s3://{store.bucket}/{prefix} failed: a page was marked "
                "truncated but gave no way to the next one",
                operation="ListObjectVersions",
                bucket=store.bucket,
                key=prefix,
            )
        asked = (marker[0], marker[1] or None)


def _entry(item: dict[str, Any], *, marker: bool) -> ObjectVersion:
    return ObjectVersion(
        key=str(item["Key"]),
        version_id=str(item.get("VersionId") or "null"),
        latest=bool(item.get("IsLatest")),
        marker=marker,
        size=0 if marker else int(item.get("Size", 0)),
        etag="" if marker else str(item.get("ETag", "")),
        last_modified=item.get("LastModified"),
    )


def _time(entry: ObjectVersion) -> float:
    return entry.last_modified.timestamp() if entry.last_modified is not None else 0.0


async def delete_versions(store: ObjectStore, versions: list[ObjectVersion]) -> None:
    """Delete each of ``versions`` (versions and markers) by its version id: bytes freed,
    no marker added. Batched DeleteObjects; a version already gone is fine."""
    for i in range(0, len(versions), DELETE_BATCH):
        batch = [{"Key": v.key, "VersionId": v.version_id} for v in versions[i : i + DELETE_BATCH]]
        answer = await store.requests.delete_objects(batch)
        errors = [e for e in answer.get("Errors") or [] if e.get("Code") != "NoSuchVersion"]
        if errors:
            first = errors[0]
            raise StorageError(
                f"DeleteObjects failed for {len(errors)} version(s), first "
                f"s3://{store.bucket}/{first.get('Key')} version {first.get('VersionId')}: "
                f"{first.get('Code')}",
                operation="DeleteObjects",
                code=first.get("Code"),
                bucket=store.bucket,
                key=first.get("Key"),
            )


async def delete_every_version(store: ObjectStore, key: str) -> None:
    """Delete every version and marker of exactly ``key`` by id (an object whose name
    only s3ckpt uses, a probe's), or, where none is listed, ``key`` itself."""
    entries = [e async for e in list_versions(store, key) if e.key == key]
    if entries:
        await delete_versions(store, entries)
    else:
        await store.delete_many([key])
