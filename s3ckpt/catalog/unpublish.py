"""Deleting a committed checkpoint's manifest, only while it is still the one listed.

``prune`` and ``rm`` decide from a listing and delete afterwards; a save that commits the
checkpoint again in between (an overwrite) must win, or the newest checkpoint is lost: its
manifest deleted, then the objects that manifest names. So the manifest is deleted with
``If-Match`` on the ETag the listing saw, and a store that honours it answers 412 to a
manifest written since: that checkpoint is left alone.

Some stores ignore ``If-Match`` on DELETE (the conditional delete just deletes) and some
refuse it (501). Whether a store honours it is probed once per endpoint and bucket, as
the conditional create of a commit is (:func:`conditional_deletes`: a scratch object
written twice, then a delete conditional on its first ETag, which must fail), unless
``s3ckpt doctor`` probed it in the same process or a conditional delete was refused as
unsupported. Where conditional deletes are not honoured, each checkpoint is checked again
immediately before its manifest is deleted (:func:`changed_since`): a HEAD of the manifest,
whose ETag must still be the listed one, and, side by side with it, a listing of the
checkpoint's own level, which must show no live in-flight record of another save (a save
that started after the listing and may commit at any moment). A checkpoint that fails
either is left alone and reported. What remains is the time between that re-check and the
DELETE (``docs/reliability.md``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

from s3ckpt.catalog.clock import store_time
from s3ckpt.catalog.scan import timestamp
from s3ckpt.config import S3URI
from s3ckpt.errors import (
    CorruptCheckpointError,
    ForeignObjectError,
    PreconditionFailedError,
    StorageError,
)
from s3ckpt.format.layout import LEASE_S, SAVING_PREFIX
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES
from s3ckpt.s3.store import ObjectMeta, ObjectStore
from s3ckpt.s3.versions import delete_every_version, versioning
from s3ckpt.transfer.commit import read_manifest

log = logging.getLogger(__name__)

# (endpoint, bucket) -> whether DELETE honours If-Match there (probed, or learned)
_conditional_deletes: dict[tuple[str | None, str], bool] = {}


def _store_key(store: ObjectStore) -> tuple[str | None, str]:
    return (store.config.endpoint_url, store.bucket)


def record_conditional_deletes(store: ObjectStore, honoured: bool) -> None:
    """Remember what a probe (``s3ckpt doctor``'s) or a refused request showed."""
    _conditional_deletes[_store_key(store)] = honoured


async def probe_conditional_delete(store: ObjectStore, key: str) -> tuple[bool, str]:
    """Whether DELETE honours ``If-Match`` on the store, and what it did: ``key`` is written
    twice, then deleted conditionally on the first ETag, which must fail (412). ``key`` is
    removed in every case; errors other than a refusal of the header propagate."""
    try:
        stale = await store.put(key, b"1")
        await store.put(key, b"2")
        try:
            await store.delete_if_match(key, stale)
        except PreconditionFailedError:
            return True, "If-Match on DELETE is honoured (412 for a changed object)"
        except StorageError as exc:
            if exc.code not in UNSUPPORTED_CODES:
                raise
            return False, f"If-Match on DELETE is refused ({exc.code})"
        what = "deleted" if not await store.exists(key) else "answered success and kept"
        return False, f"If-Match on DELETE is ignored (a delete on a stale ETag {what} the object)"
    finally:
        try:
            await store.delete_many([key])
        except StorageError as exc:
            log.warning("could not delete probe object %s: %s", key, exc)


async def conditional_deletes(store: ObjectStore, location: S3URI) -> bool:
    """Whether DELETE honours ``If-Match`` on this endpoint and bucket (probed once, with a
    ``.s3ckpt-probe-<hex>`` object under ``location``, then cached). A probe that fails
    counts as "not honoured" for this call: the re-check that then runs is always safe."""
    known = _conditional_deletes.get(_store_key(store))
    if known is not None:
        return known
    key = location.key(f".s3ckpt-probe-{secrets.token_hex(8)}")
    try:
        honoured, detail = await probe_conditional_delete(store, key)
    except StorageError as exc:
        log.info("could not probe conditional deletes (%s); re-checking before deletes", exc)
        return False
    await _free_probe(store, key)
    if not honoured:  # s3ckpt doctor says so too
        log.info("%s; manifests are re-checked just before they are deleted", detail)
    record_conditional_deletes(store, honoured)
    return honoured


async def _free_probe(store: ObjectStore, key: str) -> None:
    """On a bucket with versioning on, delete the probe's versions by id (the probe
    deleted the object: its bytes stay as versions there)."""
    try:
        if await versioning(store) != "never":
            await delete_every_version(store, key)
    except StorageError as exc:
        log.warning("could not delete the versions of probe object %s: %s", key, exc)


async def changed_since(
    store: ObjectStore,
    location: S3URI,
    listed: ObjectMeta,
    save_id: str | None,
    now: float,
    lease: float = LEASE_S,
) -> str | None:
    """Why the checkpoint at ``location`` must be left alone, or None: its manifest is
    still the one ``listed`` (same ETag) and no save other than ``save_id`` (the one the
    manifest names) holds a live in-flight record there (refreshed within ``lease`` of
    ``now``, the store's clock, and since the listed commit: as
    :meth:`~s3ckpt.catalog.scan.Group.in_flight` judges). A manifest gone meanwhile is no
    reason: see :func:`unpublish`."""

    async def manifest() -> ObjectMeta | None:
        try:
            return await store.head(location.key(MANIFEST_NAME))
        except FileNotFoundError:
            return None

    async def records() -> list[ObjectMeta]:
        level = location.key("")
        return [
            e
            async for e in store.list_level(level)
            if isinstance(e, ObjectMeta) and e.key[len(level) :].startswith(SAVING_PREFIX)
        ]

    current, saving = await asyncio.gather(manifest(), records())
    if current is not None and current.etag != listed.etag:
        return "recommitted since the listing"
    done = SAVING_PREFIX + str(save_id)
    committed_at = timestamp(listed)  # a record last written before it is a dead save's
    if any(
        not r.key.endswith(done) and now - timestamp(r) < lease and timestamp(r) >= committed_at
        for r in saving
    ):
        return "a save started there since the listing"
    return None


async def not_as_written(store: ObjectStore, location: S3URI, manifest: Manifest) -> str | None:
    """Why an object at a key ``manifest`` lists is not the one its save wrote, or None.

    Another tool may have written its own object over one of s3ckpt's: deleting "the
    objects the manifest lists" would then delete what is not s3ckpt's. One listing of the
    checkpoint's directory shows each object's size, and its ETag, which the manifest
    records for data objects (index and metadata objects: their size): an object that
    differs makes the whole checkpoint be left alone, its manifest included, so that
    nothing treats the object as a stopped save's either. Objects gone are no reason.
    """
    prefix = location.key("")
    found = {m.key[len(prefix) :]: m async for m in store.list(prefix)}
    recorded: dict[str, tuple[int, str | None]] = {
        o.key: (o.size, o.etag) for o in manifest.objects
    }
    recorded.update((i.key, (i.size, None)) for i in manifest.indexes)
    recorded[manifest.metadata_key] = (manifest.metadata_size, None)
    for key, (size, etag) in sorted(recorded.items()):
        meta = found.get(key)
        if meta is None:
            continue
        if meta.size != size:
            differs = f"{meta.size} bytes, recorded {size}"
        elif etag is not None and meta.etag.strip('"') != etag.strip('"'):
            differs = f"ETag {meta.etag}, recorded {etag}"
        else:
            continue
        return (
            f"{location}/{key} is not the object its manifest recorded ({differs}): "
            "not s3ckpt's; the checkpoint is left as it is"
        )
    return None


@dataclass(frozen=True)
class Unpublished:
    keys: list[str]  # the manifest's objects, relative to the checkpoint
    bytes: int


async def unpublish(
    store: ObjectStore,
    location: S3URI,
    listed: ObjectMeta,
    now: float | None = None,
    conditional: bool | None = None,
) -> Unpublished | str:
    """Read the manifest, then delete it if it is still the one ``listed``.

    Returns what is left to delete, or why the checkpoint was left alone: the manifest was
    replaced since the listing (a save recommitted it), a save started there meanwhile
    (stores without conditional deletes), it is gone (another prune got there first;
    when the manifest is deleted concurrently after it was read, the objects it listed
    are still deleted), or it, or an object at a key it lists, is not s3ckpt's
    (:class:`ForeignObjectError`, :func:`not_as_written`: nothing is deleted). An
    unreadable manifest of s3ckpt's is deleted alone; its objects are then
    gc's. ``now``: the store's clock (:mod:`s3ckpt.catalog.clock`), read when needed if
    None; ``conditional``: whether the store honours conditional deletes, probed if None.
    """
    try:
        manifest: Manifest | None = await read_manifest(store, location)
    except FileNotFoundError:
        return "removed since the listing"
    except CorruptCheckpointError:
        manifest = None
    except ForeignObjectError as exc:  # not s3ckpt's: no checkpoint, nothing to delete
        return str(exc)
    if manifest is not None and (replaced := await not_as_written(store, location, manifest)):
        return replaced
    key = location.key(MANIFEST_NAME)
    if conditional is None:
        conditional = await conditional_deletes(store, location)
    if conditional:
        try:
            await store.delete_if_match(key, listed.etag)
        except PreconditionFailedError:
            return "recommitted since the listing"
        except FileNotFoundError:
            pass  # removed concurrently; the objects it listed are still to be deleted
        except StorageError as exc:
            if exc.code not in UNSUPPORTED_CODES:
                raise
            record_conditional_deletes(store, False)
            log.warning("conditional deletes are refused (%s); re-checking instead", exc.code)
            if reason := await _delete_unless_changed(store, location, listed, manifest, now):
                return reason
    elif reason := await _delete_unless_changed(store, location, listed, manifest, now):
        return reason
    if manifest is None:
        return Unpublished([], listed.size)
    return Unpublished(manifest.all_keys(), manifest.total_bytes + listed.size)


async def _delete_unless_changed(
    store: ObjectStore,
    location: S3URI,
    listed: ObjectMeta,
    manifest: Manifest | None,
    now: float | None,
) -> str | None:
    """The re-check, then at once an unconditional delete of the manifest: None when
    deleted, else why it was not."""
    save_id = manifest.save_id if manifest is not None else None
    now = await store_time(store) if now is None else now
    reason = await changed_since(store, location, listed, save_id, now)
    if reason is None:
        await store.delete_many([location.key(MANIFEST_NAME)])
    return reason
