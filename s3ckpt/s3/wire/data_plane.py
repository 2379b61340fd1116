"""The data plane's transport for one client: one connection pool, the PUTs of upload bodies
(one part at a time, or in batches sent by native threads), a save's other requests signed
here (:class:`SignedCalls`), the ranged GETs; whatever it does not send goes through the
aiobotocore transport it holds.

Where requests go is decided here and nowhere else, by the method called: an operation
this plane does not serve goes to the client; a redirect (a bucket in another region) sends that request, and every
later one, through the client, which follows redirects (:meth:`DataPlane.redirected`); an
odd answer to a ranged GET (chunked, a redirect) sends that GET, and every later one,
through the client (:meth:`DataPlane.odd_read`).

A save's requests other than its uploads are built, signed and answered here: the HEADs as
it starts (is the bucket there, is the checkpoint already committed) and those of
``exists`` checks; creating and completing its multipart uploads, the listings that
confirm its objects and the delete of its in-flight marker as it commits. Through the
aiobotocore client each of them runs the client's per-request Python on the I/O loop
(event hooks, endpoint rules, the user-agent string, the signer, aiohttp), bunched where a
thread-mode save starts and commits: time a training loop beside the save waits for
(docs/decisions/0005-requests-signed-on-the-data-plane.md). Here the request is built by
the client's own serializer (the XML bodies, the query, the headers exactly as the client
builds them), the handlers the client runs for these operations are applied
(:mod:`s3ckpt.s3.compat_botocore`: the listing's ``EncodingType=url`` and its decoding,
DeleteObjects' escaped body and its integrity headers, a ``200`` that carries an error, an
unparsable ``Expires`` header left out), and the request is signed by
:class:`~.signing.PartSigner`, sent on the data plane's pool and its answer read by the
client's response parser: callers get the dict, or the ``ClientError``, the client would
have given them. ``tests/unit/s3/wire/test_data_plane.py`` checks each request against the
one the client sends, header for header and byte for byte. The object's URL comes from
:class:`~.addresses.ObjectAddresses`. Which requests are signed here is decided by the
method of the transport seam called (their parameters built by
:mod:`s3ckpt.s3.operations`); every other request goes through the client, and so does one
the endpoint redirects, and every one after it, as the client follows redirects.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from s3ckpt.s3 import operations
from s3ckpt.s3.compat_botocore import (
    answer_status,
    client_error,
    decoded_listing,
    escaped_xml,
    parsed_answer,
    serialized,
    serializer,
)
from s3ckpt.s3.operations import CompletedParts, ObjectIds, Params, Parsed
from s3ckpt.s3.wire.addresses import Address, ObjectAddresses
from s3ckpt.s3.wire.batch import NativeBatch, native_batches
from s3ckpt.s3.wire.get_exchange import RangedGets, UnsupportedResponse
from s3ckpt.s3.wire.on_loop import BodyTransport
from s3ckpt.s3.wire.pool import ConnectionPool
from s3ckpt.s3.wire.range_body import RangeBody
from s3ckpt.s3.wire.signing import PartSigner
from s3ckpt.s3.wire.uploads import (
    BodySender,
    Redirected,
    SignedPuts,
    is_redirect,
    put_headers,
    request_head,
    signing_credentials,
)

if TYPE_CHECKING:
    from s3ckpt.s3.transport import Transport

log = logging.getLogger(__name__)


class DataPlane:
    """A :class:`~s3ckpt.s3.transport.Transport` for ``client`` on one pool: upload bodies
    and a save's other requests (``puts``, ``calls``; ``uploads``), ranged GETs (``gets``;
    ``reads``), every other request through ``client_transport``. ``batches``: batches of
    parts to plain-HTTP endpoints go to native threads (:mod:`~.batch`) where the sender
    is built."""

    def __init__(
        self,
        client: Any,
        client_transport: Transport,
        *,
        verify: bool | str,
        connect_timeout: float,
        read_timeout: float,
        max_concurrency: int,
        uploads: bool,
        reads: bool,
        batches: bool = True,
    ) -> None:
        self.client_transport = client_transport
        self.pool = ConnectionPool(
            verify=verify,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_idle=max_concurrency,
        )
        self.gets: RangedGets | None = None
        self.puts: SignedPuts | None = None
        self.calls: SignedCalls | None = None
        if reads:
            self.gets = RangedGets(client, self.pool)
        if uploads:
            transport = BodyTransport(self.pool)
            batch = NativeBatch(self.pool) if batches and native_batches() else None
            self.puts = SignedPuts(client, transport, batch)
            self.calls = SignedCalls(client, transport, self.puts.signer, self.puts.addresses)
            BodySender(transport).register(client)

    def redirected(self) -> None:
        """The endpoint redirected a request: send every later one through the client."""
        self.puts = self.calls = None

    def odd_read(self, reason: str) -> None:
        """The endpoint answered a ranged GET oddly: read through the client from now on."""
        if self.gets is not None:
            log.warning("ranged GETs fall back to aiobotocore: %s", reason)
            self.gets = None

    async def _signed(self, bucket: str, operation: str, params: Params) -> Parsed | None:
        """One try of ``operation`` signed here (:class:`SignedCalls`); None where the client
        must send it (the data plane's uploads are off, the bucket's URL is not known
        here, or the endpoint redirected it: then every later one too)."""
        calls = self.calls
        if calls is None:
            return None
        try:
            return await calls.call(bucket, operation, params)
        except Redirected:
            self.redirected()
            return None

    async def _either(
        self,
        bucket: str,
        operation: str,
        params: Params,
        through_client: Callable[[], Awaitable[Parsed]],
    ) -> Parsed:
        """``operation`` signed here, or else ``through_client``."""
        answer = await self._signed(bucket, operation, params)
        return answer if answer is not None else await through_client()

    async def head_object(self, bucket: str, key: str) -> Parsed:
        return await self._either(
            bucket,
            "HeadObject",
            operations.head_object(key),
            lambda: self.client_transport.head_object(bucket, key),
        )

    async def head_bucket(self, bucket: str) -> Parsed:
        return await self._either(
            bucket, "HeadBucket", {}, lambda: self.client_transport.head_bucket(bucket)
        )

    async def create_multipart_upload(self, bucket: str, key: str, *, checksum: bool) -> Parsed:
        return await self._either(
            bucket,
            "CreateMultipartUpload",
            operations.create_multipart_upload(key, checksum=checksum),
            lambda: self.client_transport.create_multipart_upload(bucket, key, checksum=checksum),
        )

    async def complete_multipart_upload(
        self, bucket: str, key: str, upload_id: str, parts: CompletedParts, *, create: bool
    ) -> Parsed:
        return await self._either(
            bucket,
            "CompleteMultipartUpload",
            operations.complete_multipart_upload(key, upload_id, parts, create=create),
            lambda: self.client_transport.complete_multipart_upload(
                bucket, key, upload_id, parts, create=create
            ),
        )

    async def list_objects(self, bucket: str, prefix: str, **page: str | None) -> Parsed:
        return await self._either(
            bucket,
            "ListObjectsV2",
            operations.list_objects(prefix, **page),
            lambda: self.client_transport.list_objects(bucket, prefix, **page),
        )

    async def delete_objects(self, bucket: str, objects: ObjectIds) -> Parsed:
        return await self._either(
            bucket,
            "DeleteObjects",
            operations.delete_objects(objects),
            lambda: self.client_transport.delete_objects(bucket, objects),
        )

    async def abort_multipart_upload(self, bucket: str, key: str, upload_id: str) -> Parsed:
        return await self.client_transport.abort_multipart_upload(bucket, key, upload_id)

    async def list_multipart_uploads(self, bucket: str, prefix: str, **page: str | None) -> Parsed:
        return await self.client_transport.list_multipart_uploads(bucket, prefix, **page)

    async def list_object_versions(self, bucket: str, prefix: str, **page: str | None) -> Parsed:
        return await self.client_transport.list_object_versions(bucket, prefix, **page)

    async def copy_object(
        self, bucket: str, key: str, source_bucket: str, source_key: str
    ) -> Parsed:
        return await self.client_transport.copy_object(bucket, key, source_bucket, source_key)

    async def upload_part_copy(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        part_number: int,
        source: tuple[str, str, int, int],
    ) -> Parsed:
        return await self.client_transport.upload_part_copy(
            bucket, key, upload_id, part_number, source
        )

    async def delete_object(self, bucket: str, key: str, *, if_match: str | None) -> Parsed:
        return await self.client_transport.delete_object(bucket, key, if_match=if_match)

    async def get_bucket_versioning(self, bucket: str) -> Parsed:
        return await self.client_transport.get_bucket_versioning(bucket)

    async def get_bucket_lifecycle_configuration(self, bucket: str) -> Parsed:
        return await self.client_transport.get_bucket_lifecycle_configuration(bucket)

    async def put_object(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        puts, headers = self.puts, put_headers(params)
        if puts is not None and headers is not None:
            try:
                return await puts.put_object(bucket, params["Key"], params["Body"], headers)
            except Redirected:
                self.redirected()
        return await self.client_transport.put_object(bucket, params)

    async def upload_part(self, bucket: str, params: dict[str, Any]) -> dict[str, Any]:
        """One part: a redirect fails it with the client's error, and sends every later one
        through the client."""
        puts = self.puts
        if puts is None:
            return await self.client_transport.upload_part(bucket, params)
        try:
            return await puts.upload_part(
                bucket,
                params["Key"],
                params["UploadId"],
                params["PartNumber"],
                params["Body"],
                params.get("ChecksumCRC32C"),
            )
        except Exception as exc:
            if is_redirect(exc):
                self.redirected()
            raise

    def sends_batches(self) -> bool:
        return self.puts is not None and self.puts.batch is not None

    async def try_parts(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        parts: list[tuple[int, memoryview, str | None]],
        connections: int,
    ) -> list[dict[str, Any] | Exception] | None:
        puts = self.puts
        if puts is None:
            return None
        outcomes = await puts.try_parts(bucket, key, upload_id, parts, connections)
        if any(is_redirect(outcome) for outcome in outcomes or ()):
            self.redirected()
        return outcomes

    async def get_object(self, bucket: str, key: str) -> tuple[bytes, str]:
        return await self.client_transport.get_object(bucket, key)

    async def open_range(self, bucket: str, key: str, start: int, end: int) -> RangeBody:
        gets = self.gets
        if gets is not None:
            try:
                return await gets.open(bucket, key, start, end)
            except UnsupportedResponse as exc:
                self.odd_read(str(exc))
        return await self.client_transport.open_range(bucket, key, start, end)

    def close_idle(self) -> None:
        self.pool.close_idle()

    async def aclose(self) -> None:
        await self.pool.aclose()


class SignedCalls:
    """A save's requests other than its uploads (those :class:`DataPlane` signs itself),
    to ``client``'s buckets and objects, signed on the data plane (see the module's
    docstring)."""

    def __init__(
        self,
        client: Any,
        transport: BodyTransport,
        signer: PartSigner,
        addresses: ObjectAddresses,
    ) -> None:
        self.client = client
        self.transport = transport
        self.signer = signer
        self.addresses = addresses
        self.serialize = serializer(client)

    async def call(
        self, bucket: str, operation: str, params: dict[str, Any]
    ) -> dict[str, Any] | None:
        """One try of ``operation`` with ``params`` (addressed to the object ``Key`` names,
        else to the bucket): what the client's method returns, or raises; None where the
        client must send it (the bucket's URL is not one the data plane knows),
        :class:`~.uploads.Redirected` where the endpoint redirected it."""
        address = await (
            self.addresses.derived(bucket, params["Key"])
            if "Key" in params
            else self.addresses.bucket(bucket)
        )
        if address is None:
            return None
        return await self._send(bucket, operation, params, address)

    async def _send(
        self, bucket: str, operation: str, params: dict[str, Any], address: Address
    ) -> dict[str, Any]:
        listing = operation == "ListObjectsV2"
        if listing:  # what the client adds to a listing, decoded below
            params = {**params, "EncodingType": "url"}
        request = serialized(self.client, self.serialize, operation, {"Bucket": bucket, **params})
        headers, body = request.headers, request.body
        if operation == "DeleteObjects":
            body = escaped_xml(body)
            headers = {**headers, **integrity_headers(body)}
        url, region, service = address
        url = url._replace(query=request.query)
        credentials = await signing_credentials(self.client)
        signed = self.signer.sign(
            url, headers, credentials=credentials, region=region, service=service,
            method=request.method,
        )  # fmt: skip
        head = request_head(request.method, url, signed, len(body))
        status, answer, content = await self.transport.send(url, head, memoryview(body))
        if 300 <= status < 400:
            raise Redirected(f"{operation} redirected ({status})")
        answered, status = status, answer_status(self.client, operation, status, content)
        if status >= 300:
            raise client_error(self.client, operation, status, answer, content, answered)
        # What the client's before-parse handler does with it: an unparsable date must not
        # fail the request; nothing here reads it.
        answer.pop("expires", None)
        parsed = parsed_answer(self.client, operation, status, answer, content)
        return decoded_listing(parsed) if listing else parsed


def integrity_headers(body: bytes) -> dict[str, str]:
    """What DeleteObjects carries to prove its body: the CRC32 the client adds to an
    operation that requires a checksum, and :func:`content_md5`."""
    crc = zlib.crc32(body).to_bytes(4, "big")
    return {
        "x-amz-sdk-checksum-algorithm": "CRC32",
        "x-amz-checksum-crc32": base64.b64encode(crc).decode("ascii"),
        "Content-MD5": content_md5(body),
    }


def content_md5(body: bytes) -> str:
    """``Content-MD5`` of ``body``: S3 has always required an integrity header on
    DeleteObjects, and stores that predate its CRC checksums (some gateways, older MinIO)
    accept only MD5, which recent botocore no longer sends."""
    return base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode("ascii")
