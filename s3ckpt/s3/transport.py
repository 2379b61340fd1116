"""The transport seam: how one try of each S3 operation the engine sends travels.

:class:`Transport` is what :class:`~s3ckpt.s3.requests.Requests` sends every try through;
the retries, the request slots, the stall watch and the error mapping stay above it, in
:mod:`s3ckpt.s3.requests`, the same for every implementation. :func:`choose_transport`
picks the implementation once per client (and so per endpoint and settings):

* :class:`~s3ckpt.s3.aiobotocore_transport.AiobotocoreTransport`: every operation through
  the aiobotocore client (endpoints behind a proxy, or with the data plane turned off);
* :class:`~s3ckpt.s3.wire.DataPlane`: upload bodies, ranged GETs and a save's other
  requests built, signed and sent by s3ckpt itself (:mod:`s3ckpt.s3.wire` says why),
  every other request, and every one the endpoint redirects, handed to the aiobotocore
  implementation it holds.

Each method makes one try of one operation, its arguments typed (the parameters the client
takes are built from them in :mod:`s3ckpt.s3.operations`), and answers as the client's
method for the operation answers (its dict, or its ``ClientError``), whichever
implementation sent it. Which implementation sends a request is decided by the method
called, never by an operation's name.
"""

from __future__ import annotations

from typing import Any, Protocol

from s3ckpt.config import S3Config
from s3ckpt.s3.aiobotocore_transport import AiobotocoreTransport
from s3ckpt.s3.operations import CompletedParts, ObjectIds, Params, Parsed
from s3ckpt.s3.wire import DataPlane, RangeBody, proxied

PartTry = tuple[int, memoryview, str | None]  # part number, body, CRC32C header


class Transport(Protocol):
    """One try of each S3 operation the engine sends, on one client's connections."""

    async def head_object(self, bucket: str, key: str) -> Parsed:
        """One try of HeadObject."""
        ...

    async def head_bucket(self, bucket: str) -> Parsed:
        """One try of HeadBucket."""
        ...

    async def create_multipart_upload(self, bucket: str, key: str, *, checksum: bool) -> Parsed:
        """One try of CreateMultipartUpload (``checksum``: its parts carry a CRC32C)."""
        ...

    async def complete_multipart_upload(
        self, bucket: str, key: str, upload_id: str, parts: CompletedParts, *, create: bool
    ) -> Parsed:
        """One try of CompleteMultipartUpload (``create``: only where ``key`` is absent)."""
        ...

    async def abort_multipart_upload(self, bucket: str, key: str, upload_id: str) -> Parsed:
        """One try of AbortMultipartUpload."""
        ...

    async def list_objects(
        self,
        bucket: str,
        prefix: str,
        *,
        delimiter: str | None = None,
        continuation_token: str | None = None,
        start_after: str | None = None,
    ) -> Parsed:
        """One try of ListObjectsV2: one page, its keys decoded."""
        ...

    async def list_multipart_uploads(
        self,
        bucket: str,
        prefix: str,
        *,
        key_marker: str | None = None,
        upload_id_marker: str | None = None,
    ) -> Parsed:
        """One try of ListMultipartUploads: one page."""
        ...

    async def list_object_versions(
        self,
        bucket: str,
        prefix: str,
        *,
        key_marker: str | None = None,
        version_id_marker: str | None = None,
    ) -> Parsed:
        """One try of ListObjectVersions: one page."""
        ...

    async def copy_object(
        self, bucket: str, key: str, source_bucket: str, source_key: str
    ) -> Parsed:
        """One try of CopyObject."""
        ...

    async def upload_part_copy(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        part_number: int,
        source: tuple[str, str, int, int],
    ) -> Parsed:
        """One try of UploadPartCopy of bytes ``[start, end)`` of ``(bucket, key, start, end)``."""
        ...

    async def delete_object(self, bucket: str, key: str, *, if_match: str | None) -> Parsed:
        """One try of DeleteObject (``if_match``: only while the ETag is that)."""
        ...

    async def delete_objects(self, bucket: str, objects: ObjectIds) -> Parsed:
        """One try of a quiet DeleteObjects."""
        ...

    async def get_bucket_versioning(self, bucket: str) -> Parsed:
        """One try of GetBucketVersioning."""
        ...

    async def get_bucket_lifecycle_configuration(self, bucket: str) -> Parsed:
        """One try of GetBucketLifecycleConfiguration."""
        ...

    async def put_object(self, bucket: str, params: Params) -> Parsed:
        """One try of PutObject."""
        ...

    async def upload_part(self, bucket: str, params: Params) -> Parsed:
        """One try of UploadPart."""
        ...

    def sends_batches(self) -> bool:
        """Whether :meth:`try_parts` may send a batch (else it answers None)."""
        ...

    async def try_parts(
        self, bucket: str, key: str, upload_id: str, parts: list[PartTry], connections: int
    ) -> list[Parsed | Exception] | None:
        """One try of each part of upload ``upload_id``, the batch sent at once on at most
        ``connections`` connections: each answer, or its try's error; None where this
        batch is not sent so (send each part with :meth:`upload_part`)."""
        ...

    async def get_object(self, bucket: str, key: str) -> tuple[bytes, str]:
        """One GET of a whole (small) object: its bytes and ETag."""
        ...

    async def open_range(self, bucket: str, key: str, start: int, end: int) -> RangeBody:
        """One ranged GET of bytes ``[start, end)``, its head read: the body the caller
        pulls, in offset order, each byte once (and then closes)."""
        ...

    def close_idle(self) -> None:
        """Close kept-alive connections, so that the next requests open new ones."""
        ...

    async def aclose(self) -> None:
        """Close every connection of this transport (not the client)."""
        ...


def choose_transport(client: Any, config: S3Config, verify: bool | str) -> Transport:
    """The transport for ``client``, made with ``config``: the data plane where it serves
    the endpoint and ``config`` wants it (uploads or reads on it, no proxy; TLS verified
    with ``verify``, as the client verifies it), else the client alone. Called once, when
    the client is made."""
    through_client = AiobotocoreTransport(client, config.endpoint_url or "the endpoint")
    uploads, reads = config.uploads_on_data_plane(), config.direct_reads
    if not (uploads or reads) or proxied(client.meta.endpoint_url, config.proxies):
        return through_client
    return DataPlane(
        client,
        through_client,
        verify=verify,
        connect_timeout=config.connect_timeout,
        read_timeout=config.idle_timeout(),  # stalls: S3Config.stall_timeout_s
        max_concurrency=config.max_concurrency,
        uploads=uploads,
        reads=reads,
        batches=config.native_uploads,
    )
