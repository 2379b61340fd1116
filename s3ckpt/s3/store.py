"""A small, typed, async object-store API over aiobotocore, bound to one bucket: whole
objects, deletes, ranged reads and listings here, multipart uploads and copies beside them.

Every method runs on the process's I/O loop (:mod:`s3ckpt.s3.loop`) and raises only s3ckpt
errors (translated in :mod:`s3ckpt.s3.error_mapping`); a missing object is
:class:`~s3ckpt.errors.ObjectNotFoundError`, a ``FileNotFoundError``. The store holds only
its config and bucket name, so it pickles and survives ``fork``: the client is created
lazily on the loop of whichever process uses it.

Requests go through the transport of the shared client of :mod:`s3ckpt.s3.client`
(:mod:`s3ckpt.s3.transport`, chosen once per client): the client itself (path-style, no
SHA-256 payload signing, no botocore checksums: callers pass a CRC32C computed natively),
or its data plane (:mod:`s3ckpt.s3.wire`: uploads, HEADs, a save's other requests built,
signed and answered as the client would, ranged GETs received straight into the
caller's memory). Each sends one try; the retries are here.

Failed requests are retried here, by :mod:`s3ckpt.s3.retry` (botocore's own retries are off),
because a retry must know what the request meant: a ranged GET resumes at the first byte
not yet delivered, so its reader sees every byte exactly once; a retried create-only PUT or
CompleteMultipartUpload whose first response was lost recognises its own landed write
instead of reporting a conflict; a retried CreateMultipartUpload aborts the uploads its
lost responses created. Bodies are memory, so resending one costs no copy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

from botocore.exceptions import ClientError

from s3ckpt.config import S3Config
from s3ckpt.errors import PreconditionFailedError, StorageError
from s3ckpt.s3 import retry
from s3ckpt.s3.error_mapping import PRECONDITION_CODES, error_code
from s3ckpt.s3.multipart import MultipartUploads, PartResult, PendingUpload, crc32c_header
from s3ckpt.s3.ranged_read import RangedRead
from s3ckpt.s3.requests import Body, Requests, Retrying, flat

_LAST_CHARACTER = "\U0010ffff"


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int
    etag: str
    last_modified: datetime | None = None


class ObjectStore(MultipartUploads):
    """Async S3 operations on one bucket. Call the coroutines on :func:`s3ckpt.s3.loop.io_loop`.

    Made of one part per kind of operation, each in its own module, all sending through
    one :class:`~s3ckpt.s3.requests.Requests` (the bucket, the retries, the retry budget):
    whole objects, deletes and listings here, and
    :class:`~s3ckpt.s3.multipart.MultipartUploads` (and copies, and the listing of open
    uploads) beside them, whose methods are the store's. ``deadline`` (see
    :meth:`with_deadline`) ends retrying; ``tally`` counts the retries of every request
    made through it.
    """

    def __init__(
        self,
        config: S3Config,
        bucket: str,
        *,
        deadline: float | None = None,
        tally: retry.Tally | None = None,
    ) -> None:
        super().__init__(Requests(config, bucket, deadline=deadline, tally=tally))

    @property
    def config(self) -> S3Config:
        return self.requests.config

    @property
    def bucket(self) -> str:
        return self.requests.bucket

    @property
    def deadline(self) -> float | None:
        """The ``time.monotonic()`` instant after which no request is tried again."""
        return self.requests.deadline

    def __repr__(self) -> str:
        return f"ObjectStore(bucket={self.bucket!r}, endpoint_url={self.config.endpoint_url!r})"

    def with_deadline(self, seconds: float | None) -> ObjectStore:
        """This store with a retry budget of ``seconds`` from now (``None``: unlimited).

        A save or load takes one such store for all its requests, so ``S3Config.deadline_s``
        bounds how long faults can keep it retrying.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        return ObjectStore(self.config, self.bucket, deadline=deadline)

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
        params: dict[str, Any] = {"Key": key, "Body": flat(body)}
        if mode == "create":
            params["IfNoneMatch"] = "*"
        if crc32c is not None and self.config.checksums:
            params["ChecksumCRC32C"] = crc32c_header(crc32c)
        if content_type:
            params["ContentType"] = content_type

        async with self.requests.retrying("PutObject", key) as tries:
            while True:
                try:
                    return await self._put_once(key, body, params, tries)
                except Exception as exc:
                    await tries.failed(exc)

    async def _put_once(self, key: str, body: Body, params: dict[str, Any], tries: Retrying) -> str:
        """One try of :meth:`put` among ``tries``: the ETag."""
        try:
            response = await self.requests.try_put_object(params, tries)
        except ClientError as exc:
            if "IfNoneMatch" in params and error_code(exc) in PRECONDITION_CODES:  # create
                etag = await self._etag_if_holds(key, body, tries)
                if etag is not None:
                    return etag
            raise
        return str(response.get("ETag", ""))

    async def get(self, key: str) -> bytes:
        """The whole object's bytes (for small objects: manifests, metadata)."""
        async with self.requests.retrying("GetObject", key) as tries:
            while True:
                try:
                    body, _ = await self._fetch(key, tries)
                    return body
                except Exception as exc:
                    await tries.failed(exc)

    async def _fetch(self, key: str, tries: Retrying) -> tuple[bytes, str]:
        """One GET of a whole object among ``tries``: its bytes and ETag."""
        return await self.requests.get_object(key, tries)

    async def _etag_if_holds(self, key: str, body: Body, tries: Retrying) -> str | None:
        """The ETag of ``key`` if it holds exactly ``body``, else None (one GET, inside a
        try of ``tries``)."""
        try:
            stored, etag = await self._fetch(key, tries)
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        return etag if memoryview(body).cast("B") == stored else None

    @contextlib.asynccontextmanager
    async def open_range(self, key: str, start: int, end: int) -> AsyncIterator[RangedRead]:
        """Bytes ``[start, end)`` of ``key``, to pull inside ``async with`` into memory the
        caller names (:meth:`RangedRead.receive_into`; usually a tensor), so the range is
        never held twice; on the data plane (:mod:`s3ckpt.s3.wire`) the socket writes into
        it directly. Bytes arrive in offset order and each exactly once: a failed try is
        retried here, asking only for the bytes not yet delivered. The request is sent
        (and its head read) on entry."""
        async with self.requests.retrying("GetObject", key) as tries:
            read = RangedRead(self.requests, tries, key, start, end)
            await read.open()
            try:
                yield read
            except BaseException as exc:
                await read.close(exc)
                raise
            await read.close(None)

    async def read_range(self, key: str, start: int, end: int, into: memoryview) -> None:
        """Bytes ``[start, end)`` of ``key`` into ``into`` (``end - start`` bytes long)."""
        async with self.open_range(key, start, end) as read:
            await read.receive_into(into)

    async def close_idle_connections(self) -> None:
        """Make the next ranged GETs open fresh connections (after bytes came in damaged)."""
        self.requests.close_idle()

    async def head(self, key: str) -> ObjectMeta:
        response = await self.requests.head_object(key)
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
        await self.requests.head_bucket()

    async def server_time(self) -> float | None:
        """The store's clock, from the ``Date`` header of a ``HeadBucket`` response (seconds
        since the epoch, whole seconds); None when the store sent none, or an unreadable one."""
        response = await self.requests.head_bucket()
        date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            return parsedate_to_datetime(date).timestamp() if date else None
        except (TypeError, ValueError):
            return None

    # -- listings -------------------------------------------------------------------------

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
        """ListObjectsV2 page by page, on servers that paginate oddly too.

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
                raise self.stuck_listing("ListObjectsV2", prefix)

    # -- deletes ----------------------------------------------------------------------------

    async def delete_many(self, keys: list[str]) -> None:
        """Delete ``keys`` with batched DeleteObjects (1000 per request); missing keys are fine."""
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            response = await self.requests.delete_objects(batch)
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
        async with self.requests.retrying("DeleteObject", key) as tries:
            while True:
                try:
                    return await self._delete_once(key, etag, tries)
                except Exception as exc:
                    await tries.failed(exc)

    async def _delete_once(self, key: str, etag: str, tries: Retrying) -> None:
        """One try of :meth:`delete_if_match` among ``tries``."""
        try:
            await self.requests.try_delete_object(key, tries, if_match=etag)
        except ClientError as exc:
            if error_code(exc) not in PRECONDITION_CODES:
                raise
            if await self.requests.head_or_none(key, tries) is not None:
                raise


__all__ = [
    "Body",
    "ObjectMeta",
    "ObjectStore",
    "PartResult",
    "PendingUpload",
    "PreconditionFailedError",
    "crc32c_header",
]
