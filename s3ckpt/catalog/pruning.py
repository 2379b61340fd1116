"""``prune``: a retention policy (:mod:`s3ckpt.catalog.retention`) applied to the committed
checkpoints under a prefix, deleting through :mod:`s3ckpt.catalog.removal`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from s3ckpt.catalog.clock import store_time
from s3ckpt.catalog.ownership import extent, maybe_manifest, only_ours
from s3ckpt.catalog.removal import Removed, remove_groups
from s3ckpt.catalog.reporting import SILENT, Reporter
from s3ckpt.catalog.retention import Candidate, Decision, plan_retention
from s3ckpt.catalog.scan import child, open_store, scan_checkpoints
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import ForeignObjectError
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest
from s3ckpt.s3.loop import bounded, io_loop
from s3ckpt.s3.store import ObjectStore


@dataclass(frozen=True)
class PruneReport:
    """What :func:`prune` decided and did: a :class:`~s3ckpt.catalog.retention.Decision`
    for every committed checkpoint, the checkpoints removed (in a dry run: removable),
    those left alone because they changed since the listing, and why."""

    decisions: list[Decision]  # every committed checkpoint, oldest first
    removed: list[Removed]
    changed: list[str]  # changed since the listing (recommitted, a save started): left alone
    dry_run: bool
    why_changed: dict[str, str] = field(default_factory=dict)  # name -> why it was left alone
    foreign: list[str] = field(default_factory=list)  # directories not s3ckpt's, left alone: why


async def aprune(
    store: ObjectStore,
    location: S3URI,
    *,
    keep_last: int,
    keep_every: int | None = None,
    older_than: float | None = None,
    force: bool = False,
    dry_run: bool = False,
    now: float | None = None,
    progress: Reporter = SILENT,
) -> PruneReport:
    """Apply a retention policy (:func:`s3ckpt.catalog.retention.plan_retention`) to the committed
    checkpoints under ``location``. Saves that are in flight have no manifest and are not
    candidates, and a committed checkpoint being overwritten is kept; a checkpoint
    committed after the listing is not seen, so it survives. A directory whose manifest is
    not s3ckpt's is no candidate either (read as
    :func:`~s3ckpt.catalog.listing.alist_checkpoints` reads them, and again just before any
    delete: :func:`~s3ckpt.catalog.unpublish.unpublish`): why is in
    :attr:`PruneReport.foreign`, and :class:`ForeignObjectError` is raised when it is
    ``location`` itself."""
    listed = await scan_checkpoints(store, location)
    committed = [g for g in listed.groups.values() if g.committed]
    foreign: list[str] = []
    groups = {g.name: g for g in await only_ours(store, location, committed, foreign)}
    mine = f"s3://{store.bucket}/{location.key(MANIFEST_NAME)} "  # as read_manifest names it
    if itself := [f for f in foreign if f.startswith(mine)]:
        raise ForeignObjectError(itself[0])  # the prefix itself: refused, as rm refuses it
    if now is None and (older_than is not None or any(g.saving for g in groups.values())):
        now = await store_time(store)  # ages are the store's: commit times, in-flight records
    decisions = plan_retention(
        [
            Candidate(g.name, g.newest, now is not None and g.in_flight(now))
            for g in groups.values()
        ],
        keep_last=keep_last,
        keep_every=keep_every,
        older_than=older_than,
        force=force,
        now=time.time() if now is None else now,  # then no rule reads it
    )
    victims = [groups[d.name] for d in decisions if d.delete]
    if dry_run:
        manifests = await bounded(
            [lambda g=g: maybe_manifest(store, child(location, g.name), g, False) for g in victims]
        )
        removed = [
            Removed(
                g.name,
                str(child(location, g.name)),
                *extent(g, m if isinstance(m, Manifest) else None),
            )
            for g, m in zip(victims, manifests, strict=True)
        ]
        return PruneReport(decisions, removed, [], dry_run=True, foreign=foreign)
    why: dict[str, str] = {}
    removed, changed = await remove_groups(store, location, victims, progress, now=now, why=why)
    return PruneReport(decisions, removed, changed, dry_run=False, why_changed=why, foreign=foreign)


def prune(
    uri: str | S3URI,
    *,
    keep_last: int,
    keep_every: int | None = None,
    older_than: float | None = None,
    force: bool = False,
    dry_run: bool = False,
    progress: Reporter = SILENT,
    config: S3Config | None = None,
    **options: Any,
) -> PruneReport:
    """Apply a retention policy to the committed checkpoints under ``uri`` and delete what
    it does not keep (``s3ckpt prune``; :func:`aprune` run on the I/O loop).

    The rules are :mod:`~s3ckpt.catalog.retention`'s: a checkpoint is deleted only where
    every rule allows it. Saves in flight are no candidates, and a checkpoint committed
    or started again after the listing is left alone.

    Args:
        uri: ``s3://bucket`` or ``s3://bucket/prefix``.
        keep_last: keep the newest ``keep_last`` (superseded ones not counted; 0 keeps
            only the newest, unless ``force``).
        keep_every: also keep every step that is a multiple of ``keep_every``.
        older_than: delete only checkpoints committed more than this many seconds ago
            (by the store's clock).
        force: the newest checkpoint may be deleted too.
        dry_run: decide and report, delete nothing.
        progress: told how many objects are deleted as they go (the CLI's progress bar).
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        A decision with its reason for every committed checkpoint, what was removed (in a
        dry run, what would be), what changed since the listing and was left alone, and
        the directories left alone because their ``manifest.json`` is not s3ckpt's.

    Raises:
        ~s3ckpt.errors.ConfigError: an invalid rule (``keep_last`` below 0, ``keep_every``
            below 1, ``older_than`` negative) or an unknown option.
        ~s3ckpt.errors.ForeignObjectError: the ``manifest.json`` at ``uri`` itself is not
            s3ckpt's; nothing is deleted.
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://`` URI.
        ~s3ckpt.errors.StorageError: a listing or a delete failed (a missing bucket:
            :class:`~s3ckpt.errors.BucketNotFoundError`).
    """
    store, location = open_store(uri, config, options, require_prefix=False)
    return io_loop().run(
        aprune(
            store,
            location,
            keep_last=keep_last,
            keep_every=keep_every,
            older_than=older_than,
            force=force,
            dry_run=dry_run,
            progress=progress,
        )
    )
