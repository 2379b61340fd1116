"""The doctor's store feature checks, each a few small requests under the scratch prefix:
list/put/get/delete, conditional writes and deletes, CRC32C on uploads, multipart
uploads, ranged GETs, ListMultipartUploads, and a small throughput sample."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from crc32c import crc32c

from s3ckpt.catalog.doctor.report import Status
from s3ckpt.catalog.unpublish import probe_conditional_delete, record_conditional_deletes
from s3ckpt.errors import PreconditionFailedError, StorageError
from s3ckpt.s3.client import client_handle
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES, translated
from s3ckpt.s3.store import PartResult
from s3ckpt.units import human_bytes, human_rate

if TYPE_CHECKING:
    from s3ckpt.catalog.doctor.probe import Probe

MiB = 1024 * 1024


async def access(probe: Probe) -> None:
    key, body = probe.key("access"), b"s3ckpt doctor"
    await probe.store.put(key, body)
    listed = [m.key async for m in probe.store.list(probe.scratch + "/")]
    read = await probe.store.get(key)
    await probe.store.delete_many([key])
    gone = not await probe.store.exists(key)
    if read != body or key not in listed or not gone:
        probe.add("list, put, get, delete", "failed", "the store did not give back what it took")
    else:
        probe.add("list, put, get, delete", "ok", f"under {probe.location}")


async def conditional(probe: Probe) -> None:
    key = probe.key("conditional")
    try:
        await probe.store.put(key, b"1", mode="create")
        await probe.store.put(key, b"2", mode="create")
    except PreconditionFailedError:
        probe.add("conditional writes", "ok", "If-None-Match: * is honoured (412)")
        probe.diagnosis.plan.append("commits with a conditional create (If-None-Match: *)")
        return
    except StorageError as exc:
        if exc.code not in UNSUPPORTED_CODES:
            raise
        detail = f"If-None-Match: * is refused ({exc.code})"
    else:
        detail = "If-None-Match: * is ignored (the second create overwrote the first)"
    probe.add("conditional writes", "degraded", detail)
    probe.diagnosis.plan.append(
        "commits with the claim protocol (correct without conditional writes)"
    )


async def conditional_deletes(probe: Probe) -> None:
    honoured, detail = await probe_conditional_delete(probe.store, probe.key("delete"))
    record_conditional_deletes(probe.store, honoured)  # what prune and rm here rely on
    if honoured:
        probe.add("conditional deletes", "ok", detail)
        probe.diagnosis.plan.append("prune and rm delete a manifest with If-Match")
        return
    probe.add(
        "conditional deletes",
        "degraded",
        f"{detail}: prune and rm re-check each manifest just before deleting it, which "
        "leaves a short window (docs/reliability.md)",
    )
    probe.diagnosis.plan.append(
        "prune and rm re-check a manifest (ETag, in-flight records) before deleting it"
    )


async def checksums(probe: Probe) -> None:
    body = b"checksummed" * 100
    await probe.store.put(probe.key("crc-good"), body, crc32c=crc32c(body))
    try:
        await probe.store.put(probe.key("crc-bad"), body, crc32c=crc32c(body) ^ 1)
    except StorageError:
        probe.add("CRC32C on uploads", "ok", "checked: a wrong CRC32C is refused")
        return
    probe.add(
        "CRC32C on uploads",
        "degraded",
        "not checked (a wrong CRC32C was accepted): damage on the way in is caught only "
        "when loading, by s3ckpt's block checksums",
    )


async def multipart(probe: Probe) -> None:
    key = probe.key("multipart")
    parts = [b"a" * (5 * MiB), b"b" * 1024]
    upload = await probe.store.create_multipart(key)
    results = [
        await probe.store.upload_part(key, upload, n + 1, p, crc32c(p)) for n, p in enumerate(parts)
    ]
    await probe.store.complete_multipart(key, upload, results)
    size = (await probe.store.head(key)).size
    small = await _small_parts_refused(probe)
    status: Status = "ok" if size == sum(map(len, parts)) else "failed"
    detail = f"a 2-part upload completes ({size} bytes); parts under 5 MiB {small}"
    probe.add("multipart uploads", status, detail)


async def _small_parts_refused(probe: Probe) -> str:
    key = probe.key("small-parts")
    upload = await probe.store.create_multipart(key)
    parts: list[PartResult] = []
    for n in (1, 2):
        parts.append(await probe.store.upload_part(key, upload, n, b"x" * 1024, None))
    try:
        await probe.store.complete_multipart(key, upload, parts)
    except StorageError as exc:
        await probe.store.abort_multipart(key, upload)
        return f"are refused as S3 does ({exc.code})"
    return "are accepted (S3 refuses them; s3ckpt never sends them)"


async def ranges(probe: Probe) -> None:
    key, body = probe.key("range"), bytes(range(256)) * 4096
    await probe.store.put(key, body)
    received = bytearray(1000)
    await probe.store.read_range(key, 5000, 6000, memoryview(received))
    if bytes(received) != body[5000:6000]:
        probe.add("ranged GETs", "failed", "bytes 5000-5999 came back wrong")
    elif not await _range_honoured(probe, key):
        probe.add(
            "ranged GETs",
            "degraded",
            "Range is ignored (200 with the whole object): loads work, but every read "
            "transfers the object up to the range's end",
        )
    else:
        probe.add("ranged GETs", "ok", "a 1000-byte range of a 1 MiB object is exact (206)")
        probe.diagnosis.plan.append("loads with parallel ranged GETs")


async def _range_honoured(probe: Probe, key: str) -> bool:
    client = await client_handle(probe.store.config).get()
    with translated("GetObject", probe.store.bucket, key):
        response = await client.get_object(Bucket=probe.store.bucket, Key=key, Range="bytes=0-9")
        async with response["Body"] as body:
            await body.read()
    return bool(response["ResponseMetadata"]["HTTPStatusCode"] == 206)


async def uploads_listing(probe: Probe) -> None:
    try:
        [u async for u in probe.store.list_multipart_uploads(probe.scratch + "/")]
    except StorageError as exc:
        if exc.code not in UNSUPPORTED_CODES:
            raise
        probe.add(
            "ListMultipartUploads",
            "degraded",
            f"unsupported ({exc.code}): gc cannot abort uploads left by failed saves; "
            "add an AbortIncompleteMultipartUpload lifecycle rule",
        )
        return
    probe.add("ListMultipartUploads", "ok", "gc can find and abort uploads of failed saves")


async def throughput(probe: Probe) -> None:
    key, body = probe.key("sample"), b"\0" * probe.sample
    started = time.perf_counter()
    await probe.store.put(key, body)
    put = time.perf_counter() - started
    started = time.perf_counter()
    await probe.store.get(key)
    get = time.perf_counter() - started
    probe.add(
        "throughput sample",
        "ok",
        f"PUT {human_rate(probe.sample / put)}, GET {human_rate(probe.sample / get)} "
        f"({human_bytes(probe.sample)}, one request each: a sanity check, not what "
        "parallel saves reach)",
    )
