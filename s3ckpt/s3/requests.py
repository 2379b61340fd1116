"""The request core of :class:`~s3ckpt.s3.store.ObjectStore`: one bucket, one client, and
the retries every operation runs under (see :mod:`s3ckpt.s3.store` for why retries are
here and not in botocore), above the transport each try goes through
(:mod:`s3ckpt.s3.transport`): the request slots, the stall watch and the error mapping
are the same whichever transport sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from botocore.exceptions import ClientError

from s3ckpt.config import S3Config
from s3ckpt.errors import S3CkptError, StorageError, StoreStalledError
from s3ckpt.s3 import retry
from s3ckpt.s3.client import ClientHandle, client_handle
from s3ckpt.s3.compat_botocore import read_timeout
from s3ckpt.s3.error_mapping import (
    STORE_ERRORS,
    check_s3_answer,
    error_code,
    translate,
    translate_final,
)
from s3ckpt.s3.operations import CompletedParts, ObjectIds, Parsed
from s3ckpt.s3.transport import Transport
from s3ckpt.s3.wire import RangeBody

Body = bytes | bytearray | memoryview


def flat(body: Body) -> memoryview:
    """``body`` as one flat ``memoryview`` of bytes, its memory shared: what upload
    requests carry, so the data plane (:mod:`s3ckpt.s3.wire`) sends it from where it is."""
    view = memoryview(body)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Requests:
    """Requests on one bucket with s3ckpt's retry policy: what every part of
    :class:`~s3ckpt.s3.store.ObjectStore` (its listings, its multipart uploads, its whole
    objects) sends its requests through.

    ``deadline`` (a ``time.monotonic()`` instant) ends retrying: a request that fails after
    it is not tried again. ``tally`` counts the retries of every request made through it.
    """

    def __init__(
        self,
        config: S3Config,
        bucket: str,
        *,
        deadline: float | None = None,
        tally: retry.Tally | None = None,
    ) -> None:
        self.config = config
        self.bucket = bucket
        self.deadline = deadline
        self.tally = tally

    def retrying(self, operation: str, key: str | None) -> Retrying:
        """The retries of one ``operation`` on ``key``, for the loop that sends its
        tries: ``async with`` it, and after each failed try ``await`` its
        :meth:`~Retrying.failed`, which waits before the next try or ends the request.
        Every failure leaves the block as an s3ckpt error. Its tries go to the client it
        looks up here (:attr:`Retrying.handle`: one look-up per request, again only before
        a retry)."""
        handle = client_handle(self.config)
        policy = retry.RetryPolicy(
            max_attempts=self.config.max_attempts,
            base_delay=self.config.retry_base_delay_s,
            deadline=self.deadline,
            tally=self.tally,
            stall_timeout=self.config.stall_timeout_s,
            idle_timeout=self.config.idle_timeout(),
            answers=handle.answers,
        )
        tries = retry.Tries(policy, f"{operation} {self.where(key)}")
        return Retrying(self, operation, key, tries, handle)

    @contextlib.asynccontextmanager
    async def _sending(self, operation: str, handle: ClientHandle) -> AsyncIterator[Transport]:
        """The transport (:mod:`s3ckpt.s3.transport`) of ``handle``'s client, one of its
        request slots held, for one try of ``operation``: the client of the request's
        tries (:attr:`Retrying.handle`, looked up as the request began and again before
        each retry: rotated credentials make a new one). The try is noted as the store's
        answer when it returns or fails with an S3 error response (which only a reachable
        endpoint sends), and as silence when it is stopped for silence or cancelled
        (:class:`~s3ckpt.s3.retry.StoreAnswers`, for stalls)."""
        answers = handle.answers
        answers.asking()
        try:
            transport = await handle.transport()
            async with handle.slots:
                yield transport
        except ClientError as exc:
            answers.done(silent=False)
            handle.answered = True
            answers.note(f"{operation} {error_code(exc)}")
            raise
        except BaseException as exc:  # silence, a dropped connection, cancellation
            answers.done(silent=retry.is_stall(exc) or isinstance(exc, asyncio.CancelledError))
            raise
        answers.done(silent=False)
        handle.answered = True
        answers.note(f"{operation} OK")

    async def _try(
        self,
        operation: str,
        key: str | None,
        tries: Retrying,
        send: Callable[[Transport], Awaitable[Parsed]],
    ) -> Parsed:
        """One try of ``operation`` among ``tries``, which ``send`` makes through the
        transport, holding a request slot; an answer that is a web page fails it.
        ``key``: the object it names."""
        async with self._sending(operation, tries.handle) as transport:
            answer = await send(transport)
            check_s3_answer(operation, answer, self.bucket, key)  # no web pages
        return answer

    async def _retried(
        self,
        operation: str,
        key: str | None,
        send: Callable[[Transport], Awaitable[Parsed]],
        *,
        names_key: bool = True,
    ) -> Parsed:
        """``operation`` on ``key``, each try made by ``send``, retried under the policy
        (``names_key``: the request names ``key``, not only its errors)."""
        async with self.retrying(operation, key) as tries:
            while True:
                try:
                    return await self._try(operation, key if names_key else None, tries, send)
                except Exception as exc:
                    await tries.failed(exc)

    # -- one try, for the loops that hold their request's retries ------------------------

    async def try_create_multipart_upload(self, key: str, tries: Retrying) -> Parsed:
        """One try of CreateMultipartUpload among ``tries``, its parts to carry a CRC32C
        where the configuration sends checksums."""
        checksum = self.config.checksums
        return await self._try(
            "CreateMultipartUpload",
            key,
            tries,
            lambda t: t.create_multipart_upload(self.bucket, key, checksum=checksum),
        )

    async def try_complete_multipart_upload(
        self, key: str, upload_id: str, parts: CompletedParts, tries: Retrying, *, create: bool
    ) -> Parsed:
        """One try of CompleteMultipartUpload among ``tries`` (``create``: only where
        ``key`` is absent)."""
        return await self._try(
            "CompleteMultipartUpload",
            key,
            tries,
            lambda t: t.complete_multipart_upload(
                self.bucket, key, upload_id, parts, create=create
            ),
        )

    async def try_delete_object(self, key: str, tries: Retrying, *, if_match: str | None) -> Parsed:
        """One try of DeleteObject among ``tries`` (``if_match``: only while its ETag is
        that)."""
        return await self._try(
            "DeleteObject",
            key,
            tries,
            lambda t: t.delete_object(self.bucket, key, if_match=if_match),
        )

    async def head_or_none(self, key: str, tries: Retrying) -> Parsed | None:
        """One HEAD inside a try of ``tries``: the response, or None if the key is absent."""
        try:
            return await self._try(
                "HeadObject", key, tries, lambda t: t.head_object(self.bucket, key)
            )
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    async def try_put_object(self, params: dict[str, Any], tries: Retrying) -> dict[str, Any]:
        """One try of PutObject among ``tries`` (``params`` as the client takes them),
        holding a request slot."""
        return await self._try(
            "PutObject", params.get("Key"), tries, lambda t: t.put_object(self.bucket, params)
        )

    async def try_upload_part(self, params: dict[str, Any], tries: Retrying) -> dict[str, Any]:
        """One try of UploadPart among ``tries`` (``params`` as the client takes them),
        holding a request slot."""
        return await self._try(
            "UploadPart", params.get("Key"), tries, lambda t: t.upload_part(self.bucket, params)
        )

    async def try_parts(
        self, key: str, upload_id: str, parts: list[tuple[int, memoryview, str | None]]
    ) -> list[dict[str, Any] | Exception] | None:
        """One try of each ``(part number, body, checksum)`` of ``key``'s upload, sent as one
        batch by native threads (:mod:`s3ckpt.s3.wire.batch`) on up to half the client's
        request slots, held for the batch: what :meth:`try_upload_part` returns or raises, for
        each. None where batches are not sent that way: send each part instead."""
        handle = client_handle(self.config)
        transport = await handle.transport()
        if not transport.sends_batches():
            return None
        connections = max(1, min(len(parts), self.config.max_concurrency // 2))
        async with handle.slots_for(connections):
            answers = handle.answers
            answers.asking()
            try:
                outcomes = await transport.try_parts(
                    self.bucket, key, upload_id, parts, connections
                )
            except BaseException as exc:
                answers.done(silent=isinstance(exc, asyncio.CancelledError))
                raise
        answers.done(silent=any(retry.is_stall(o) for o in outcomes or ()))
        for outcome in outcomes or ():
            if isinstance(outcome, ClientError):
                handle.answered = True
                answers.note(f"UploadPart {error_code(outcome)}")
            elif not isinstance(outcome, Exception):
                handle.answered = True
                answers.note("UploadPart OK")
        return outcomes

    async def get_object(self, key: str, tries: Retrying) -> tuple[bytes, str]:
        """One GET of a whole (small) object among ``tries``, holding a request slot: its
        bytes and ETag."""
        async with self._sending("GetObject", tries.handle) as transport:
            return await transport.get_object(self.bucket, key)

    @contextlib.asynccontextmanager
    async def range_try(
        self, key: str, start: int, end: int, tries: Retrying
    ) -> AsyncIterator[RangeBody]:
        """One try of a ranged GET of bytes ``[start, end)`` of ``key`` among ``tries``, its
        head read: the body to pull from inside ``async with``, a request slot held until
        it ends."""
        async with self._sending("GetObject", tries.handle) as transport:
            body = await transport.open_range(self.bucket, key, start, end)
            try:
                yield body
            finally:
                await body.aclose()

    def close_idle(self) -> None:
        """Make the next requests open fresh connections."""
        client_handle(self.config).close_idle()

    def where(self, key: str | None) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    # -- whole requests, retried under the policy ------------------------------------------

    async def head_object(self, key: str) -> Parsed:
        return await self._retried("HeadObject", key, lambda t: t.head_object(self.bucket, key))

    async def head_bucket(self) -> Parsed:
        return await self._retried("HeadBucket", None, lambda t: t.head_bucket(self.bucket))

    async def abort_multipart_upload(self, key: str, upload_id: str) -> Parsed:
        return await self._retried(
            "AbortMultipartUpload",
            key,
            lambda t: t.abort_multipart_upload(self.bucket, key, upload_id),
        )

    async def list_objects(
        self,
        prefix: str,
        *,
        delimiter: str | None = None,
        continuation_token: str | None = None,
        start_after: str | None = None,
    ) -> Parsed:
        """One page of ListObjectsV2."""
        return await self._retried(
            "ListObjectsV2",
            None,
            lambda t: t.list_objects(
                self.bucket,
                prefix,
                delimiter=delimiter,
                continuation_token=continuation_token,
                start_after=start_after,
            ),
        )

    async def list_multipart_uploads(
        self, prefix: str, *, key_marker: str | None = None, upload_id_marker: str | None = None
    ) -> Parsed:
        """One page of ListMultipartUploads."""
        return await self._retried(
            "ListMultipartUploads",
            None,
            lambda t: t.list_multipart_uploads(
                self.bucket, prefix, key_marker=key_marker, upload_id_marker=upload_id_marker
            ),
        )

    async def list_object_versions(
        self, prefix: str, *, key_marker: str | None = None, version_id_marker: str | None = None
    ) -> Parsed:
        """One page of ListObjectVersions."""
        return await self._retried(
            "ListObjectVersions",
            None,
            lambda t: t.list_object_versions(
                self.bucket, prefix, key_marker=key_marker, version_id_marker=version_id_marker
            ),
        )

    async def copy_object(self, key: str, source_bucket: str, source_key: str) -> Parsed:
        return await self._retried(
            "CopyObject",
            key,
            lambda t: t.copy_object(self.bucket, key, source_bucket, source_key),
        )

    async def upload_part_copy(
        self, key: str, upload_id: str, part_number: int, source: tuple[str, str, int, int]
    ) -> Parsed:
        """Bytes ``[start, end)`` of ``source = (bucket, key, start, end)`` as a part."""
        return await self._retried(
            "UploadPartCopy",
            key,
            lambda t: t.upload_part_copy(self.bucket, key, upload_id, part_number, source),
        )

    async def delete_objects(self, objects: ObjectIds) -> Parsed:
        """A quiet DeleteObjects of ``objects`` (its errors name the first)."""
        return await self._retried(
            "DeleteObjects",
            objects[0]["Key"],
            lambda t: t.delete_objects(self.bucket, objects),
            names_key=False,
        )

    async def get_bucket_versioning(self) -> Parsed:
        return await self._retried(
            "GetBucketVersioning", None, lambda t: t.get_bucket_versioning(self.bucket)
        )

    async def get_bucket_lifecycle_configuration(self) -> Parsed:
        return await self._retried(
            "GetBucketLifecycleConfiguration",
            None,
            lambda t: t.get_bucket_lifecycle_configuration(self.bucket),
        )


class Retrying:
    """One request's tries under the retry policy (:class:`~s3ckpt.s3.retry.Tries`), as
    the loop that sends them holds them (:meth:`Requests.retrying`): inside ``async with``,
    every failed try goes to :meth:`failed`; what leaves the block leaves as an s3ckpt
    error. On a store that stalled a request and has answered nothing since, the block is
    cut short after :data:`~s3ckpt.s3.retry.STILL_STALLED_S` (or the idle timeout, where
    shorter), as stalled again."""

    def __init__(
        self,
        requests: Requests,
        operation: str,
        key: str | None,
        tries: retry.Tries,
        handle: ClientHandle,
    ) -> None:
        self.requests = requests
        self.operation = operation
        self.key = key
        self.tries = tries
        self.handle = handle
        self._cut: asyncio.Timeout | None = None
        self._cut_after = 0.0

    @property
    def number(self) -> int:
        """The try under way (past 1, it may repeat a request whose response was lost)."""
        return self.tries.number

    async def failed(self, failure: Exception) -> None:
        """Try :attr:`number` failed with ``failure``: return once the next may go, or
        raise where there is none (``failure`` itself where no retry can fix it)."""
        delay = self.tries.after(failure, endpoint_answered=self.handle.answered)
        await asyncio.sleep(delay)
        # The next try goes to the client current now: credentials rotated in the AWS
        # environment while this request retried are the next try's.
        self.handle = client_handle(self.requests.config)

    async def __aenter__(self) -> Retrying:
        config = self.requests.config
        if self.handle.answers.stalled and config.stall_timeout_s is not None:
            self._cut_after = min(retry.STILL_STALLED_S, config.idle_timeout())
            self._cut = asyncio.timeout(self._cut_after)
            await self._cut.__aenter__()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: object
    ) -> None:
        if self._cut is not None:
            try:
                await self._cut.__aexit__(kind, error, trace)  # type: ignore[arg-type]
            except TimeoutError:  # cut short: the store is still stalled
                silent = read_timeout(self.requests.config.endpoint_url or "the endpoint")
                silence = max(self.handle.answers.silence(), self._cut_after)
                error = retry.RetryError(silent, 1, out_of_time=False, stalled=silence)
        if isinstance(error, retry.RetryError):
            raise self._final(error) from error.last
        if isinstance(error, STORE_ERRORS) and not isinstance(error, S3CkptError):
            raise translate(
                error, operation=self.operation, bucket=self.requests.bucket, key=self.key
            ) from error

    def _final(self, stopped: retry.RetryError) -> Exception:
        """The s3ckpt error a request that stopped retrying ends with."""
        answers = self.handle.answers
        final = translate_final(
            stopped.last,
            stopped.attempts,
            out_of_time=stopped.out_of_time,
            operation=self.operation,
            bucket=self.requests.bucket,
            key=self.key,
            stalled=stopped.stalled,
            last_answer=answers.describe(),
        )
        answers.stalled = answers.stalled or isinstance(final, StoreStalledError)
        return final


class StorePart:
    """A part of :class:`~s3ckpt.s3.store.ObjectStore`, one kind of operation in its own
    module (whole objects and listings, multipart uploads), all sending through one
    ``requests``: the store is made of its parts, each part's methods its own."""

    def __init__(self, requests: Requests) -> None:
        self.requests = requests

    def stuck_listing(self, operation: str, prefix: str) -> StorageError:
        """The error a listing of ``prefix`` ends with where a page was marked truncated
        but gave no way to the next one (rather than asking for the same page forever)."""
        bucket = self.requests.bucket
        return StorageError(
            f"{operation} s3://{bucket}/{prefix} failed: a page was marked truncated but gave "
            "no way to the next one",
            operation=operation,
            bucket=bucket,
            key=prefix,
        )
