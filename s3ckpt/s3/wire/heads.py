"""``HeadObject`` and ``HeadBucket`` built, signed and answered on the data plane.

A save asks two of them as it starts (is the bucket there, is the checkpoint already
committed), and ``exists`` checks ask more. Through the aiobotocore client each cost the
I/O loop 1.4-1.9 ms of Python (event hooks, endpoint rules, the user-agent string, the
signer; ``time.thread_time`` against the zero-cost server), time a training loop beside a
thread-mode save waits for (docs/performance.md, "The loop beside a save"). Here a HEAD is
signed by :class:`~.signing.PartSigner` (checked against botocore's signer), sent on the
data plane's pool, and its answer read by the client's own response parser, so callers
get the dict, or the ``ClientError``, the client would have given them. The object's URL
comes from :class:`~.addresses.ObjectAddresses`; a redirect (a bucket in another region)
sends that HEAD again, and every later one, through the client, which follows it.
"""

from __future__ import annotations

from typing import Any

from s3ckpt.s3.compat_botocore import client_error, parsed_answer
from s3ckpt.s3.wire.addresses import Address, ObjectAddresses
from s3ckpt.s3.wire.signing import PartSigner
from s3ckpt.s3.wire.uploads import BodyTransport, request_head, signing_credentials

_NO_BODY = memoryview(b"")


class SignedHeads:
    """HEAD requests of ``client``'s buckets and objects on the data plane."""

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
        self.redirected = False  # the endpoint redirected one: the client sends them

    async def head_object(self, bucket: str, key: str) -> dict[str, Any] | None:
        """One try of HeadObject: what the client's ``head_object`` returns, or raises;
        None where the client must ask (the endpoint redirected it)."""
        return await self._head("HeadObject", await self.addresses.derived(bucket, key))

    async def head_bucket(self, bucket: str) -> dict[str, Any] | None:
        """One try of HeadBucket, as :meth:`head_object`; None also where the bucket's URL
        is not one the data plane knows."""
        address = await self.addresses.bucket(bucket)
        return None if address is None else await self._head("HeadBucket", address)

    async def _head(self, operation: str, address: Address) -> dict[str, Any] | None:
        url, region, service = address
        credentials = await signing_credentials(self.client)
        signed = self.signer.sign(
            url, {}, credentials=credentials, region=region, service=service, method="HEAD"
        )
        status, headers, body = await self.transport.send(
            url, request_head("HEAD", url, signed, 0), _NO_BODY
        )
        if 300 <= status < 400:
            self.redirected = True
            return None
        if status >= 300:
            raise client_error(self.client, operation, status, headers, body)
        # What the client's before-parse handler does with it: an unparsable date must not
        # fail the request; nothing here reads it.
        headers.pop("expires", None)
        return parsed_answer(self.client, operation, status, headers, body)
