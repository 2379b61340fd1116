"""A save's requests other than its uploads, built, signed and answered on the data plane:
the HEADs as it starts (is the bucket there, is the checkpoint already committed) and
those of ``exists`` checks; creating and completing its multipart uploads, the listings
that confirm its objects and the delete of its in-flight marker as it commits.

Through the aiobotocore client each of them runs the client's per-request Python on the
I/O loop (event hooks, endpoint rules, the user-agent string, the signer, aiohttp),
bunched where a thread-mode save starts and commits: time a training loop beside the save
waits for (docs/decisions/0005-requests-signed-on-the-data-plane.md).
Here the request is built by the client's own serializer (the XML bodies, the query, the
headers exactly as the client builds them), the handlers the client runs for these
operations are applied (:mod:`s3ckpt.s3.compat_botocore`: the listing's
``EncodingType=url`` and its decoding, DeleteObjects' escaped body and its integrity
headers, a ``200`` that carries an error, an unparsable ``Expires`` header left out), and
the request is signed by :class:`~.signing.PartSigner`, sent on the data plane's pool and
its answer read by the client's response parser: callers get the dict, or the
``ClientError``, the client would have given them. ``tests/unit/s3/wire/test_calls.py`` checks
each request against the one the client sends, header for header and byte for byte. The
object's URL comes from :class:`~.addresses.ObjectAddresses`.

Which requests come here is decided by :class:`~.data_plane.DataPlane`, by the method of
the transport seam called (their parameters built by :mod:`s3ckpt.s3.operations`); every
other request goes through the client, and so does one the endpoint redirects (a bucket in
another region), and every one after it (the data plane switches), as the client follows
redirects.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from typing import Any

from s3ckpt.s3.compat_botocore import (
    answer_status,
    client_error,
    decoded_listing,
    escaped_xml,
    parsed_answer,
    serialized,
    serializer,
)
from s3ckpt.s3.wire.addresses import Address, ObjectAddresses
from s3ckpt.s3.wire.on_loop import BodyTransport
from s3ckpt.s3.wire.signing import PartSigner
from s3ckpt.s3.wire.uploads import Redirected, request_head, signing_credentials


class SignedCalls:
    """A save's requests other than its uploads (those :class:`~.data_plane.DataPlane`
    sends here), to ``client``'s buckets and objects, signed on the data plane."""

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
