"""``s3ckpt doctor``: what a store supports, probed, and what s3ckpt will do on it.

Someone pointing s3ckpt at a new FlashBlade (or any S3 endpoint) wants one command that
says whether it will work before a training job finds out. Each check makes a few small
requests under a scratch prefix (``<prefix>/.s3ckpt-doctor-<hex>/``, removed at the end)
and gives one :class:`Check`: ``ok``, ``degraded`` (s3ckpt works, with a fallback) or
``failed`` (s3ckpt cannot work). Requests are not retried (a doctor reports what it sees)
and time out after ``read_timeout``. The throughput sample is small and bounded; it says
whether the path is sane, not what a real save reaches.

On a bucket with versioning on (``Enabled`` or ``Suspended``), the versioning check says
what that means for space (a delete keeps the bytes as a noncurrent version), whether a
delete by version id frees them (what ``prune``, ``gc`` and ``rm`` do with s3ckpt's own
versions), and whether a lifecycle rule expires noncurrent versions; the clean-up deletes
the scratch prefix's versions by id.

The first check names the endpoint exactly as requests will use it (the URL the S3
client resolved, from ``--endpoint-url``, the environment or the AWS config file) and
where it came from (:func:`endpoint_source`), then the transport: TLS and what verifies
it for ``https``, and for ``http`` that nothing is encrypted. An endpoint that answers
but not as S3 does fails it with :class:`~s3ckpt.errors.NotS3EndpointError`'s message.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from crc32c import crc32c

from s3ckpt.catalog.unpublish import probe_conditional_delete, record_conditional_deletes
from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.errors import (
    BucketNotFoundError,
    NotS3EndpointError,
    PreconditionFailedError,
    S3CkptError,
    StorageError,
)
from s3ckpt.s3.client import client_handle, tls_verify
from s3ckpt.s3.compat_botocore import configured_endpoint, ignored_s3_endpoint
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES, translated
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore, PartResult
from s3ckpt.s3.versions import delete_versions, list_versions, versioning
from s3ckpt.units import human_bytes, human_rate

Status = Literal["ok", "degraded", "failed"]
MiB = 1024 * 1024
LIFECYCLE_HINT = (
    "add a rule with NoncurrentVersionExpiration (and ExpiredObjectDeleteMarker) to free "
    "what other writers' deletes leave (docs/compatibility.md, versioned buckets)"
)


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclass
class Diagnosis:
    """``endpoint``: the URL requests go to, as the client resolved it; ``endpoint_source``:
    where it was configured (:func:`endpoint_source`)."""

    uri: str
    endpoint: str
    endpoint_source: str = ""
    checks: list[Check] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)  # what s3ckpt will do on this store

    @property
    def exit_status(self) -> int:
        """0: s3ckpt will work; 1: it will, with a degraded feature; 2: it cannot."""
        statuses = {c.status for c in self.checks}
        return 2 if "failed" in statuses else 1 if "degraded" in statuses else 0


class _Probe:
    """One doctor run: the store, the scratch prefix, and the checks so far."""

    def __init__(self, store: ObjectStore, location: S3URI, sample: int) -> None:
        self.store, self.location, self.sample = store, location, sample
        self.scratch = location.key(f".s3ckpt-doctor-{secrets.token_hex(6)}")
        self.versioned = False  # deletes keep versions: the clean-up deletes them by id
        self.diagnosis = Diagnosis(str(location), store.config.endpoint_url or "(unresolved)")

    def key(self, name: str) -> str:
        return f"{self.scratch}/{name}"

    def add(self, name: str, status: Status, detail: str) -> None:
        self.diagnosis.checks.append(Check(name, status, detail))

    async def run(self) -> Diagnosis:
        try:
            if await self._reach():
                for check in (
                    self._access,
                    self._versioning,
                    self._conditional,
                    self._conditional_deletes,
                    self._checksums,
                    self._multipart,
                    self._ranges,
                    self._uploads_listing,
                    self._throughput,
                ):
                    await self._guarded(check)
        finally:
            await self._clean_up()
        return self.diagnosis

    async def _guarded(self, check: Callable[[], Awaitable[None]]) -> None:
        name = check.__name__.strip("_").replace("_", " ")
        try:
            await check()
        except S3CkptError as exc:
            self.add(name, "failed", str(exc))

    # -- the checks --------------------------------------------------------------------

    async def _reach(self) -> bool:
        config = self.store.config
        try:
            with translated("CreateClient", self.store.bucket):
                client = await client_handle(config).get()
        except S3CkptError as exc:
            self.add("endpoint, credentials, bucket", "failed", str(exc))
            return False
        endpoint = self.diagnosis.endpoint = str(client.meta.endpoint_url)
        self.diagnosis.endpoint_source = endpoint_source(config, endpoint)
        try:
            await self.store.head_bucket()
        except BucketNotFoundError as exc:
            await self._not_s3_or(exc)
            return False
        except StorageError as exc:
            self.add("endpoint, credentials, bucket", "failed", f"{exc}{self._at()}")
            return False
        detail = (
            f"{endpoint} ({self.diagnosis.endpoint_source}) answers; {_transport(config, endpoint)}"
        )
        self.add("endpoint and TLS", "ok", detail)
        self.add("credentials and bucket", "ok", f"s3://{self.store.bucket} is accessible")
        return True

    async def _not_s3_or(self, missing: StorageError) -> None:
        """A HEAD's bare 404 is S3's "no such bucket", and a web server's too: a listing,
        which S3 explains with an XML error, tells them apart."""
        try:
            async for _ in self.store.list(self.scratch + "/"):
                break
        except NotS3EndpointError as exc:
            self.add("endpoint, credentials, bucket", "failed", f"{exc}{self._at()}")
            return
        except StorageError:
            pass
        self.add("endpoint, credentials, bucket", "failed", f"{missing}{self._at()}")

    def _at(self) -> str:
        return f" (endpoint {self.diagnosis.endpoint}, {self.diagnosis.endpoint_source})"

    async def _access(self) -> None:
        key, body = self.key("access"), b"s3ckpt doctor"
        await self.store.put(key, body)
        listed = [m.key async for m in self.store.list(self.scratch + "/")]
        read = await self.store.get(key)
        await self.store.delete_many([key])
        gone = not await self.store.exists(key)
        if read != body or key not in listed or not gone:
            self.add("list, put, get, delete", "failed", "the store did not give back what it took")
        else:
            self.add("list, put, get, delete", "ok", f"under {self.location}")

    async def _versioning(self) -> None:
        try:
            state = await versioning(self.store)
        except StorageError as exc:  # a policy without s3:GetBucketVersioning, say
            self.add(
                "bucket versioning",
                "degraded",
                f"unknown: GetBucketVersioning failed ({exc.code}): commits probe conditional "
                "writes at every commit, and if versioning is on, deletes keep the bytes "
                f"as noncurrent versions; {LIFECYCLE_HINT}",
            )
            return
        if state == "never":
            self.add("bucket versioning", "ok", "off: a delete frees its object's space")
            return
        self.versioned = True
        rule = await self._noncurrent_rule()
        meaning = (
            f"{state}: a delete only adds a delete marker, and the bytes stay as a "
            "noncurrent version; prune, gc and rm then delete the versions s3ckpt's saves "
            "wrote, by version id"
        )
        try:
            freed = await self._delete_by_version()
        except StorageError as exc:
            if exc.code not in {*UNSUPPORTED_CODES, "AccessDenied", "403"}:
                raise
            freed = f"but deleting a version by id failed ({exc.code})"
        if freed:  # the versions stay: only a lifecycle rule frees them
            self.add("bucket versioning", "degraded", f"{meaning}, {freed}; {rule}")
            self.diagnosis.plan.append("deletes leave noncurrent versions (see versioning)")
            return
        self.add("bucket versioning", "ok", f"{meaning}; {rule}")
        self.diagnosis.plan.append(
            f"prune, gc and rm delete the versions s3ckpt wrote by version id (versioning {state})"
        )

    async def _delete_by_version(self) -> str:
        """Write, delete and then delete by id every version of a scratch object: ""
        when no version with bytes is left (a marker may be: it holds none), else what
        was left."""
        key = self.key("versions")
        await self.store.put(key, b"1")
        await self.store.delete_many([key])
        entries = [v async for v in list_versions(self.store, key) if v.key == key]
        await delete_versions(self.store, entries)
        if [v async for v in list_versions(self.store, key) if v.key == key and not v.marker]:
            return "but a version deleted by id stayed"
        return ""

    async def _noncurrent_rule(self) -> str:
        """What the bucket's lifecycle rules do with noncurrent versions, or the rule to set."""
        try:
            config = await self.store.requests.call("GetBucketLifecycleConfiguration", None)
        except StorageError as exc:
            if exc.code not in {*UNSUPPORTED_CODES, "NoSuchLifecycleConfiguration"}:
                return f"its lifecycle rules could not be read ({exc.code}): {LIFECYCLE_HINT}"
            config = {}
        days = [
            r["NoncurrentVersionExpiration"].get("NoncurrentDays")
            for r in config.get("Rules") or []
            if r.get("Status") == "Enabled" and r.get("NoncurrentVersionExpiration")
        ]
        if days:
            return f"a lifecycle rule expires noncurrent versions after {min(days)} day(s)"
        return f"no lifecycle rule expires noncurrent versions: {LIFECYCLE_HINT}"

    async def _conditional(self) -> None:
        key = self.key("conditional")
        try:
            await self.store.put(key, b"1", mode="create")
            await self.store.put(key, b"2", mode="create")
        except PreconditionFailedError:
            self.add("conditional writes", "ok", "If-None-Match: * is honoured (412)")
            self.diagnosis.plan.append("commits with a conditional create (If-None-Match: *)")
            return
        except StorageError as exc:
            if exc.code not in UNSUPPORTED_CODES:
                raise
            detail = f"If-None-Match: * is refused ({exc.code})"
        else:
            detail = "If-None-Match: * is ignored (the second create overwrote the first)"
        self.add("conditional writes", "degraded", detail)
        self.diagnosis.plan.append(
            "commits with the claim protocol (correct without conditional writes)"
        )

    async def _conditional_deletes(self) -> None:
        honoured, detail = await probe_conditional_delete(self.store, self.key("delete"))
        record_conditional_deletes(self.store, honoured)  # what prune and rm here rely on
        if honoured:
            self.add("conditional deletes", "ok", detail)
            self.diagnosis.plan.append("prune and rm delete a manifest with If-Match")
            return
        self.add(
            "conditional deletes",
            "degraded",
            f"{detail}: prune and rm re-check each manifest just before deleting it, which "
            "leaves a short window (docs/reliability.md)",
        )
        self.diagnosis.plan.append(
            "prune and rm re-check a manifest (ETag, in-flight records) before deleting it"
        )

    async def _checksums(self) -> None:
        body = b"checksummed" * 100
        await self.store.put(self.key("crc-good"), body, crc32c=crc32c(body))
        try:
            await self.store.put(self.key("crc-bad"), body, crc32c=crc32c(body) ^ 1)
        except StorageError:
            self.add("CRC32C on uploads", "ok", "checked: a wrong CRC32C is refused")
            return
        self.add(
            "CRC32C on uploads",
            "degraded",
            "not checked (a wrong CRC32C was accepted): damage on the way in is caught only "
            "when loading, by s3ckpt's block checksums",
        )

    async def _multipart(self) -> None:
        key = self.key("multipart")
        parts = [b"a" * (5 * MiB), b"b" * 1024]
        upload = await self.store.create_multipart(key)
        results = [
            await self.store.upload_part(key, upload, n + 1, p, crc32c(p))
            for n, p in enumerate(parts)
        ]
        await self.store.complete_multipart(key, upload, results)
        size = (await self.store.head(key)).size
        small = await self._small_parts_refused()
        status: Status = "ok" if size == sum(map(len, parts)) else "failed"
        detail = f"a 2-part upload completes ({size} bytes); parts under 5 MiB {small}"
        self.add("multipart uploads", status, detail)

    async def _small_parts_refused(self) -> str:
        key = self.key("small-parts")
        upload = await self.store.create_multipart(key)
        parts: list[PartResult] = []
        for n in (1, 2):
            parts.append(await self.store.upload_part(key, upload, n, b"x" * 1024, None))
        try:
            await self.store.complete_multipart(key, upload, parts)
        except StorageError as exc:
            await self.store.abort_multipart(key, upload)
            return f"are refused as S3 does ({exc.code})"
        return "are accepted (S3 refuses them; s3ckpt never sends them)"

    async def _ranges(self) -> None:
        key, body = self.key("range"), bytes(range(256)) * 4096
        await self.store.put(key, body)
        received = bytearray(1000)

        class Sink:
            def buffer(self, offset: int) -> memoryview:
                return memoryview(received)[offset - 5000 :]

            def filled(self, offset: int, nbytes: int) -> None:
                pass

        await self.store.read_range(key, 5000, 6000, Sink())
        if bytes(received) != body[5000:6000]:
            self.add("ranged GETs", "failed", "bytes 5000-5999 came back wrong")
        elif not await self._range_honoured(key):
            self.add(
                "ranged GETs",
                "degraded",
                "Range is ignored (200 with the whole object): loads work, but every read "
                "transfers the object up to the range's end",
            )
        else:
            self.add("ranged GETs", "ok", "a 1000-byte range of a 1 MiB object is exact (206)")
            self.diagnosis.plan.append("loads with parallel ranged GETs")

    async def _range_honoured(self, key: str) -> bool:
        client = await client_handle(self.store.config).get()
        with translated("GetObject", self.store.bucket, key):
            response = await client.get_object(Bucket=self.store.bucket, Key=key, Range="bytes=0-9")
            async with response["Body"] as body:
                await body.read()
        return bool(response["ResponseMetadata"]["HTTPStatusCode"] == 206)

    async def _uploads_listing(self) -> None:
        try:
            [u async for u in self.store.list_multipart_uploads(self.scratch + "/")]
        except StorageError as exc:
            if exc.code not in UNSUPPORTED_CODES:
                raise
            self.add(
                "ListMultipartUploads",
                "degraded",
                f"unsupported ({exc.code}): gc cannot abort uploads left by failed saves; "
                "add an AbortIncompleteMultipartUpload lifecycle rule",
            )
            return
        self.add("ListMultipartUploads", "ok", "gc can find and abort uploads of failed saves")

    async def _throughput(self) -> None:
        key, body = self.key("sample"), b"\0" * self.sample
        started = time.perf_counter()
        await self.store.put(key, body)
        put = time.perf_counter() - started
        started = time.perf_counter()
        await self.store.get(key)
        get = time.perf_counter() - started
        self.add(
            "throughput sample",
            "ok",
            f"PUT {human_rate(self.sample / put)}, GET {human_rate(self.sample / get)} "
            f"({human_bytes(self.sample)}, one request each: a sanity check, not what "
            "parallel saves reach)",
        )

    async def _clean_up(self) -> None:
        try:
            keys = [m.key async for m in self.store.list(self.scratch + "/")]
            if keys:
                await self.store.delete_many(keys)
            if self.versioned:  # every version under the scratch prefix is the doctor's
                left = [v async for v in list_versions(self.store, self.scratch + "/")]
                await delete_versions(self.store, left)
            async for upload in self.store.list_multipart_uploads(self.scratch + "/"):
                await self.store.abort_multipart(upload.key, upload.upload_id)
        except S3CkptError:
            pass  # nothing more to do: the scratch prefix is named in every check's detail


def endpoint_source(config: S3Config, endpoint: str) -> str:
    """Where ``endpoint``, the URL the client for ``config`` sends requests to, came from:
    the configuration's ``endpoint_url`` (``--endpoint-url``), the environment, the AWS
    config file's profile or services section, or none (AWS's own endpoint)."""
    if config.endpoint_url is not None:
        return "from --endpoint-url / S3Config.endpoint_url"
    found = configured_endpoint(config.profile, endpoint)
    if found is None:
        ignored = ignored_s3_endpoint(config.profile)
        note = (
            f"; the endpoint_url {ignored} in the s3 section of profile "
            f"{config.profile or 'default'} is not read: AWS tools take it from a "
            "services section"
            if ignored
            else ""
        )
        return f"AWS's own endpoint: none configured{note}"
    where = f"profile {found.profile} in {found.config_file}"
    return {
        "environment_service": "from AWS_ENDPOINT_URL_S3",
        "environment_global": "from AWS_ENDPOINT_URL",
        "config_service": f"from s3's endpoint_url in [services {found.services}] of {where}",
        "config_global": f"from the endpoint_url of {where}",
    }.get(found.location, f"from {found.location} ({where})")


def _transport(config: S3Config, endpoint: str) -> str:
    """What protects the connection: TLS and how it is verified, or nothing."""
    if not endpoint.lower().startswith("https:"):
        return "plain HTTP: the connection is not encrypted (no TLS)"
    verify = tls_verify(config)
    if verify is False:
        return "TLS, certificate not verified (--no-verify-ssl / verify=False)"
    bundle = f"the CA bundle {verify}" if isinstance(verify, str) else "botocore's CA bundle"
    return f"TLS verified against {bundle}"


def diagnose(
    uri: str | S3URI,
    *,
    sample_mib: int = 8,
    config: S3Config | None = None,
    **options: Any,
) -> Diagnosis:
    """Probe the store behind ``uri`` (see the module docstring)."""
    location = uri if isinstance(uri, S3URI) else S3URI.parse(uri, require_prefix=False)
    probing = replace(make_config(config, **options), max_attempts=1)
    store = ObjectStore(probing, location.bucket)
    return io_loop().run(_Probe(store, location, sample_mib * MiB).run())
