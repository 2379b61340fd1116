"""Where the client sends a bucket's requests: each object's URL, and the signing region
and service, as the aiobotocore client works them out for itself.

The client's presigned URL of an object says all three (its endpoint rules, addressing
style and region applied), but presigning runs the client's per-request Python
(docs/decisions/0005-requests-signed-on-the-data-plane.md), and the keys of a save's
small objects (marker, index, metadata, manifest) are new every save. So one
URL is presigned per bucket, for a probe key, and an object's URL is that URL with the
key in the probe's place, quoted as botocore quotes an S3 key (``tests/unit``: equal to
the client's presigned URLs for path and virtual addressing and keys that need quoting).
Where the probe's URL does not end in the probe's key (an addressing this does not
know), every object is presigned instead.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult, parse_qs, quote, urlsplit

MAX_CACHED_OBJECTS = 4096
# A presigned URL is only read for its path and signing scope, never sent: any lifetime.
_PRESIGN_EXPIRES_S = 3600
# The key presigned once per bucket to learn how the client addresses its objects.
_PROBE_KEY = "s3ckpt-address-probe"

Address = tuple[SplitResult, str, str]  # URL (no query), signing region, signing service


class ObjectAddresses:
    """The addresses of ``client``'s objects, presigned ones kept per object and derived
    ones per bucket."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._objects: dict[tuple[str, str], Address] = {}
        self._buckets: dict[str, tuple[SplitResult, str, str, str] | None] = {}

    async def presigned(self, bucket: str, key: str) -> Address:
        """The object's address from the client's presigned URL for it (kept)."""
        known = self._objects.get((bucket, key))
        if known is None:
            known = await self._presign(bucket, key)
            if len(self._objects) >= MAX_CACHED_OBJECTS:
                self._objects.clear()
            self._objects[(bucket, key)] = known
        return known

    async def derived(self, bucket: str, key: str) -> Address:
        """The object's address, derived from the bucket's probe (see the module)."""
        found = await self._bucket(bucket)
        if found is None:
            return await self.presigned(bucket, key)
        probe, prefix, region, service = found
        return probe._replace(path=prefix + quote(key, safe="/~")), region, service

    async def bucket(self, bucket: str) -> Address | None:
        """The bucket's own address (its requests: ``HeadBucket``), or None where the
        probe's URL is not one this derives from."""
        found = await self._bucket(bucket)
        if found is None:
            return None
        probe, prefix, region, service = found
        return probe._replace(path=prefix.rstrip("/") or "/"), region, service

    async def _bucket(self, bucket: str) -> tuple[SplitResult, str, str, str] | None:
        if bucket not in self._buckets:
            probe, region, service = await self._presign(bucket, _PROBE_KEY)
            prefix = probe.path[: -len(_PROBE_KEY)]
            known = probe.path.endswith(f"/{_PROBE_KEY}")
            self._buckets[bucket] = (probe, prefix, region, service) if known else None
        return self._buckets[bucket]

    async def _presign(self, bucket: str, key: str) -> Address:
        presigned = urlsplit(
            await self.client.generate_presigned_url(
                "put_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=_PRESIGN_EXPIRES_S
            )
        )
        # X-Amz-Credential = <key id>/<date>/<region>/<service>/aws4_request
        scope = parse_qs(presigned.query)["X-Amz-Credential"][0].split("/")
        return presigned._replace(query="", fragment=""), scope[-3], scope[-2]
