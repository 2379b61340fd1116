"""The doctor's versioning check: what versioning on a bucket means for space (a delete
keeps the bytes as a noncurrent version), whether a delete by version id frees them (what
``prune``, ``gc`` and ``rm`` do with s3ckpt's own versions), and whether a lifecycle rule
expires noncurrent versions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from s3ckpt.errors import StorageError
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES
from s3ckpt.s3.versions import delete_versions, list_versions
from s3ckpt.s3.versions import versioning as versioning_state

if TYPE_CHECKING:
    from s3ckpt.catalog.doctor.probe import Probe

LIFECYCLE_HINT = (
    "add a rule with NoncurrentVersionExpiration (and ExpiredObjectDeleteMarker) to free "
    "what other writers' deletes leave (docs/compatibility.md, versioned buckets)"
)


async def versioning(probe: Probe) -> None:
    try:
        state = await versioning_state(probe.store)
    except StorageError as exc:  # a policy without s3:GetBucketVersioning, say
        probe.add(
            "bucket versioning",
            "degraded",
            f"unknown: GetBucketVersioning failed ({exc.code}): commits probe conditional "
            "writes at every commit, and if versioning is on, deletes keep the bytes "
            f"as noncurrent versions; {LIFECYCLE_HINT}",
        )
        return
    if state == "never":
        probe.add("bucket versioning", "ok", "off: a delete frees its object's space")
        return
    probe.versioned = True
    rule = await noncurrent_rule(probe)
    meaning = (
        f"{state}: a delete only adds a delete marker, and the bytes stay as a "
        "noncurrent version; prune, gc and rm then delete the versions s3ckpt's saves "
        "wrote, by version id"
    )
    try:
        freed = await _delete_by_version(probe)
    except StorageError as exc:
        if exc.code not in {*UNSUPPORTED_CODES, "AccessDenied", "403"}:
            raise
        freed = f"but deleting a version by id failed ({exc.code})"
    if freed:  # the versions stay: only a lifecycle rule frees them
        probe.add("bucket versioning", "degraded", f"{meaning}, {freed}; {rule}")
        probe.diagnosis.plan.append("deletes leave noncurrent versions (see versioning)")
        return
    probe.add("bucket versioning", "ok", f"{meaning}; {rule}")
    probe.diagnosis.plan.append(
        f"prune, gc and rm delete the versions s3ckpt wrote by version id (versioning {state})"
    )


async def _delete_by_version(probe: Probe) -> str:
    """Write, delete and then delete by id every version of a scratch object: ""
    when no version with bytes is left (a marker may be: it holds none), else what
    was left."""
    key = probe.key("versions")
    await probe.store.put(key, b"1")
    await probe.store.delete_many([key])
    entries = [v async for v in list_versions(probe.store, key) if v.key == key]
    await delete_versions(probe.store, entries)
    if [v async for v in list_versions(probe.store, key) if v.key == key and not v.marker]:
        return "but a version deleted by id stayed"
    return ""


async def noncurrent_rule(probe: Probe) -> str:
    """What the bucket's lifecycle rules do with noncurrent versions, or the rule to set."""
    try:
        config = await probe.store.requests.get_bucket_lifecycle_configuration()
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
