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
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.fanout import bounded


@dataclass(frozen=True)
class PruneReport:
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
