"""The committed checkpoints under a prefix, asked cheaply: their names (what a training
loop may afford to wait for), whether one is committed, and one's manifest with its items
(``show``)."""

from __future__ import annotations

from typing import Any

from s3ckpt.catalog.ownership import only_ours
from s3ckpt.catalog.retention import Candidate, superseded
from s3ckpt.catalog.scan import open_store, read_committed, scan_checkpoints
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import BucketNotFoundError, ForeignObjectError
from s3ckpt.format.manifest import Manifest
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import manifest_exists
from s3ckpt.transfer.rank_index import with_items


async def acommitted_names(store: ObjectStore, location: S3URI) -> dict[str, str | None]:
    """The committed checkpoints under ``location``, each with the name of the one that
    supersedes it after a rollback (None: current; see :mod:`s3ckpt.catalog.retention`).

    The listing of :func:`~s3ckpt.catalog.listing.alist_checkpoints` without its manifest
    GETs: names and commit times are all it needs, so it costs one request up to 1000
    objects under the prefix and one per directory past that, what a training loop may
    afford to wait for. Only a manifest whose directory shows no metadata object is read:
    a foreign one is left out.
    """
    scanned = await scan_checkpoints(store, location)
    groups = await only_ours(store, location, [g for g in scanned.groups.values() if g.committed])
    replaced = superseded([Candidate(g.name, g.newest) for g in groups])
    return {g.name: replaced.get(g.name) for g in groups}


def committed_names(
    uri: str | S3URI, *, config: S3Config | None = None, **options: Any
) -> dict[str, str | None]:
    """The committed checkpoints under ``uri``, each with the name of the one that
    supersedes it after a rollback (:func:`acommitted_names` run on the I/O loop): the
    listing alone, cheap enough for a training loop to wait for.

    Args:
        uri: ``s3://bucket`` or ``s3://bucket/prefix``.
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        Each committed name (relative to ``uri``) mapped to the name that supersedes it,
        or None where it is current. Directories whose ``manifest.json`` is not s3ckpt's
        are left out.

    Raises:
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: a listing failed (a missing bucket:
            :class:`~s3ckpt.errors.BucketNotFoundError`).
    """
    store, location = open_store(uri, config, options, require_prefix=False)
    return io_loop().run(acommitted_names(store, location))


async def ais_committed(store: ObjectStore, location: S3URI) -> bool:
    """Whether a checkpoint is committed at ``location``: one GET of its manifest
    (:func:`~s3ckpt.transfer.commit.manifest_exists`); a ``manifest.json`` that is not
    s3ckpt's is no checkpoint, nor is anything in a missing bucket (False: a save there
    says why)."""
    try:
        return await manifest_exists(store, location)
    except (ForeignObjectError, BucketNotFoundError):
        return False


def is_committed(uri: str | S3URI, *, config: S3Config | None = None, **options: Any) -> bool:
    """Whether a checkpoint is committed at ``uri``, from one GET of its manifest
    (:func:`ais_committed` run on the I/O loop).

    Args:
        uri: the checkpoint, ``s3://bucket/prefix`` (a prefix is required).
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        True where s3ckpt's manifest is there, damaged or not; False where there is none,
        where the ``manifest.json`` there is not s3ckpt's, and where the bucket is missing.

    Raises:
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://bucket/prefix`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: the GET failed otherwise (refused credentials:
            :class:`~s3ckpt.errors.AccessDeniedError`; an unreachable endpoint:
            :class:`~s3ckpt.errors.EndpointError`).
    """
    store, location = open_store(uri, config, options, require_prefix=True)
    return io_loop().run(ais_committed(store, location))


def show_checkpoint(
    uri: str | S3URI, *, config: S3Config | None = None, **options: Any
) -> Manifest:
    """The committed manifest at ``uri``, with every item listed (format 2 reads them from
    the index objects).

    Args:
        uri: the checkpoint, ``s3://bucket/prefix`` (a prefix is required).
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Raises:
        ~s3ckpt.errors.CheckpointNotFoundError: nothing is committed at ``uri``.
        ~s3ckpt.errors.ForeignObjectError: the ``manifest.json`` there is not s3ckpt's.
        ~s3ckpt.errors.CorruptCheckpointError: the manifest is unreadable, or an index
            object it names is missing or damaged.
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://bucket/prefix`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: a request failed (a missing bucket:
            :class:`~s3ckpt.errors.BucketNotFoundError`).
    """
    store, location = open_store(uri, config, options, require_prefix=True)
    return io_loop().run(_committed_with_items(store, location))


async def _committed_with_items(store: ObjectStore, location: S3URI) -> Manifest:
    return await with_items(store, location, await read_committed(store, location))
