"""``rm``: deleting committed checkpoints, manifest first.

Deleting a committed checkpoint always removes its manifest first, so readers stop
seeing it at once, and then exactly the objects that manifest lists. Anything else in the
directory (objects of failed or in-flight saves) is left to ``gc``, which alone applies a
grace period; that is what keeps a save running next to a ``prune`` or ``rm`` unharmed.
On a bucket with versioning on, the versions those deletes leave are then deleted by id
where they are s3ckpt's (:mod:`s3ckpt.catalog.purge`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from s3ckpt.catalog.clock import store_time
from s3ckpt.catalog.purge import keeps_versions, purge
from s3ckpt.catalog.reporting import SILENT, Reporter
from s3ckpt.catalog.scan import Group, bookkeeping_name, child, delete_keys, open_store
from s3ckpt.catalog.unpublish import Unpublished, conditional_deletes, unpublish
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.s3.loop import bounded, io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import read_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Removed:
    """A deleted (or, in a dry run, deletable) checkpoint."""

    name: str
    uri: str
    objects: int
    bytes: int
    # On a bucket with versioning on: versions of its objects deleted by id, and their
    # bytes (:mod:`s3ckpt.catalog.purge`); also counted in ``objects`` and ``bytes``
    # where they are the versions that were current.
    versions: int = 0
    version_bytes: int = 0


async def remove_groups(
    store: ObjectStore,
    location: S3URI,
    groups: list[Group],
    progress: Reporter,
    *,
    now: float | None = None,
    why: dict[str, str] | None = None,
) -> tuple[list[Removed], list[str]]:
    """Unpublish every group's manifest (concurrently), then delete their objects in batches.

    Returns what was removed and the names of the checkpoints left alone because they
    changed since the listing (:mod:`s3ckpt.catalog.unpublish`), each with its reason in
    ``why`` when given. ``now``: the store's clock (read from the store when needed)."""
    conditional = bool(groups) and await conditional_deletes(store, location)  # probed once
    if groups and not conditional and now is None:
        now = await store_time(store)  # the re-check compares in-flight records with it
    results = await bounded(
        [
            lambda g=g: unpublish(store, child(location, g.name), g.manifest, now, conditional)  # type: ignore[arg-type]
            for g in groups
        ]
    )
    removed, changed, keys = [], [], []
    for group, result in zip(groups, results, strict=True):
        where = child(location, group.name)
        if isinstance(result, str):
            changed.append(group.name)
            log.info("%s: %s; left alone", where, result)
            if why is not None:
                why[group.name] = result
            continue
        keys += [where.key(k) for k in result.keys]
        removed.append(Removed(group.name, str(where), len(result.keys) + 1, result.bytes))
    progress.start("deleting objects", len(keys), "objects")
    await delete_keys(store, keys, progress)
    progress.finish()
    if removed and await keeps_versions(store):
        etags = {g.name: g.manifest.etag for g in groups if g.manifest is not None}
        removed = await bounded(
            [lambda r=r: _purged(store, location, r, results, groups, etags) for r in removed]
        )
    return removed, changed


async def _purged(
    store: ObjectStore,
    location: S3URI,
    removed: Removed,
    results: list[Unpublished | str],
    groups: list[Group],
    etags: dict[str, str],
) -> Removed:
    """``removed``, after the versions its delete left were deleted by id
    (:mod:`s3ckpt.catalog.purge`): those of the manifest's objects and of the manifest
    deleted, and of the in-flight records, claims and probes already deleted at its level."""
    where = child(location, removed.name)
    result = next(r for g, r in zip(groups, results, strict=True) if g.name == removed.name)
    assert isinstance(result, Unpublished)
    level = where.key("")
    names = {where.key(k) for k in [*result.keys, MANIFEST_NAME]}

    def wanted(key: str) -> bool:
        rest = key[len(level) :]
        return key in names or ("/" not in rest and bookkeeping_name(rest))

    manifest_etags = {where.key(MANIFEST_NAME): etags[removed.name]}
    purged = await purge(store, level, wanted, lambda key, latest: True, manifest_etags)
    return replace(removed, versions=purged.versions, version_bytes=purged.bytes)


async def aremove_checkpoint(
    store: ObjectStore, location: S3URI, *, progress: Reporter = SILENT
) -> Removed:
    """Delete the committed checkpoint at ``location`` (manifest first).

    Raises :class:`CheckpointNotFoundError` if there is no manifest, and
    :class:`ForeignObjectError`, deleting nothing, if the manifest is not s3ckpt's."""
    manifest_key = location.key(MANIFEST_NAME)
    try:
        meta = await store.head(manifest_key)
        await read_manifest(store, location)  # ForeignObjectError: not s3ckpt's, left alone
    except FileNotFoundError as exc:
        await store.head_bucket()
        raise CheckpointNotFoundError(f"no committed checkpoint at {location}") from exc
    except CorruptCheckpointError:
        pass  # s3ckpt's, damaged: its manifest is deleted alone (unpublish)
    group = Group("", manifest=meta)
    why: dict[str, str] = {}
    removed, changed = await remove_groups(store, location, [group], progress, why=why)
    if changed:
        raise CheckpointError(f"{location} was not removed: {why['']}; kept it")
    return removed[0]


def remove_checkpoint(
    uri: str | S3URI,
    *,
    progress: Reporter = SILENT,
    config: S3Config | None = None,
    **options: Any,
) -> Removed:
    """Delete the committed checkpoint at ``uri``, manifest first, then exactly the
    objects it lists (``s3ckpt rm``; :func:`aremove_checkpoint` run on the I/O loop).

    Readers stop seeing the checkpoint once its manifest is gone; anything else in the
    directory (a save in flight, one that stopped) is left to
    :func:`~s3ckpt.catalog.collect_garbage`. A damaged s3ckpt manifest is deleted alone.

    Args:
        uri: the checkpoint, ``s3://bucket/prefix`` (a prefix is required).
        progress: told how many objects are deleted as they go (the CLI's progress bar).
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        What was deleted: objects and bytes, and on a bucket with versioning on the
        versions deleted by id.

    Raises:
        ~s3ckpt.errors.CheckpointNotFoundError: nothing is committed at ``uri``.
        ~s3ckpt.errors.ForeignObjectError: the ``manifest.json`` there is not s3ckpt's;
            nothing is deleted.
        ~s3ckpt.errors.CheckpointError: the checkpoint changed after it was read
            (committed again, a save started there, or removed by another); it is left
            alone.
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://bucket/prefix`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: a request failed (a missing bucket:
            :class:`~s3ckpt.errors.BucketNotFoundError`).
    """
    store, location = open_store(uri, config, options, require_prefix=True)
    return io_loop().run(aremove_checkpoint(store, location, progress=progress))
