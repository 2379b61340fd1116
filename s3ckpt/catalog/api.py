"""Managing the checkpoints under a prefix: list, show, remove, prune.

The CLI is a thin layer over these functions, which scripts can call directly. Each has
an ``async`` form taking an :class:`ObjectStore` (run it on :func:`s3ckpt.s3.loop.io_loop`)
and a synchronous wrapper taking an ``s3://`` URI plus the usual connection options.
:mod:`s3ckpt.catalog` re-exports them with garbage collection and verification.

Deleting a committed checkpoint always removes its manifest first, so readers stop
seeing it at once, and then exactly the objects that manifest lists. Anything else in the
directory (objects of failed or in-flight saves) is left to ``gc``, which alone applies a
grace period; that is what keeps a save running next to a ``prune`` or ``rm`` unharmed.
On a bucket with versioning on, the versions those deletes leave are then deleted by id
where they are s3ckpt's (:mod:`s3ckpt.catalog.purge`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from s3ckpt.catalog.clock import store_time
from s3ckpt.catalog.grace import DEFAULT_GRACE
from s3ckpt.catalog.purge import keeps_versions, purge
from s3ckpt.catalog.reporting import SILENT, Reporter
from s3ckpt.catalog.retention import (
    Candidate,
    Decision,
    natural_key,
    plan_retention,
    superseded,
)
from s3ckpt.catalog.scan import (
    Group,
    add_uploads,
    bookkeeping_name,
    child,
    delete_keys,
    open_store,
    read_committed,
    scan_checkpoints,
    timestamp,
)
from s3ckpt.catalog.unpublish import Unpublished, conditional_deletes, unpublish
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import (
    BucketNotFoundError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignObjectError,
)
from s3ckpt.format.layout import HEARTBEAT_S, LEASE_S, SAVING_PREFIX
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import manifest_exists, read_manifest
from s3ckpt.transfer.fanout import bounded
from s3ckpt.transfer.rank_index import with_items

log = logging.getLogger(__name__)

# Writers refresh their in-flight record every HEARTBEAT_S: one silent for two of those has
# missed a refresh, and its save has most likely stopped (gc still waits out the lease).
SILENT_S = 2 * HEARTBEAT_S


@dataclass(frozen=True)
class CheckpointInfo:
    """One row of ``ls``: from the listing and, for a committed checkpoint, its manifest."""

    name: str  # relative to the listed prefix; "" is the prefix itself
    uri: str
    committed: bool  # an s3ckpt manifest is there (never for a foreign one)
    time: float  # commit time (manifest LastModified), else the newest object's
    # Committed: the committed save's objects, manifest included (from the manifest).
    # Uncommitted: every s3ckpt object in the directory (from the listing).
    bytes: int
    objects: int
    ranks: int | None  # ranks that wrote data
    items: int | None = None  # only with details
    save_id: str | None = None
    uploads: int = 0  # open multipart uploads (listed with include_uncommitted only)
    in_flight: bool = False  # a save is writing here now (a live in-flight record)
    superseded_by: str | None = None  # a lower step committed after it (a rollback)
    damaged: str | None = None  # why the manifest could not be read (when it was read)
    foreign: str | None = None  # why the manifest.json there is not s3ckpt's: no checkpoint
    silent: float | None = None  # seconds since the live in-flight record was refreshed
    left: int = 0  # objects a save that stopped left here (with ``uploads``: what gc removes)
    gc_after: float | None = None  # when gc (default grace) removes them (store clock)

    @property
    def running(self) -> bool:
        """A save is writing here and refreshed its record within :data:`SILENT_S`."""
        return self.in_flight and (self.silent is None or self.silent < SILENT_S)


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


@dataclass(frozen=True)
class PruneReport:
    decisions: list[Decision]  # every committed checkpoint, oldest first
    removed: list[Removed]
    changed: list[str]  # changed since the listing (recommitted, a save started): left alone
    dry_run: bool
    why_changed: dict[str, str] = field(default_factory=dict)  # name -> why it was left alone
    foreign: list[str] = field(default_factory=list)  # directories not s3ckpt's, left alone: why


# -- ls -----------------------------------------------------------------------------------


def _extent(group: Group, manifest: Manifest | None) -> tuple[int, int]:
    """Objects and bytes of a checkpoint: the committed save's when the manifest was read,
    else what the listing saw."""
    if manifest is not None and group.manifest is not None:
        return len(manifest.all_keys()) + 1, manifest.total_bytes + group.manifest.size
    return len(group.objects) + (1 if group.committed else 0), group.bytes


# What reading a manifest for ``ls`` found: the manifest, why it is damaged (str), that it
# is not s3ckpt's, or None (no manifest, or it need not be read).
Read = Manifest | str | ForeignObjectError | None


def _info(
    location: S3URI,
    group: Group,
    read: Read,
    now: float,
    superseded_by: str | None,
    details: bool,
) -> CheckpointInfo:
    """One row of ``ls``; ``read`` is what reading its manifest found."""
    manifest = read if isinstance(read, Manifest) else None
    foreign = read if isinstance(read, ForeignObjectError) else None
    save_id = manifest.save_id if manifest else group.committed_save_hint()
    objects, size = _extent(group, manifest)
    # A foreign directory is no save's: gc leaves it alone (but s3ckpt's own records).
    silent, left, gc_after = (None, 0, None) if foreign else _stopped(group, save_id, now)
    return CheckpointInfo(
        name=group.name,
        uri=str(child(location, group.name)),
        committed=group.committed and foreign is None,
        time=group.newest,
        bytes=size,
        objects=objects,
        ranks=manifest.world_size if manifest else group.ranks(save_id),
        items=manifest.item_count if manifest and details else None,
        save_id=None if foreign else save_id,
        uploads=len(group.uploads),
        in_flight=group.in_flight(now),
        superseded_by=superseded_by,
        damaged=read if isinstance(read, str) else None,
        foreign=str(foreign) if foreign else None,
        silent=silent,
        left=left,
        gc_after=gc_after,
    )


def _stopped(
    group: Group, save_id: str | None, now: float
) -> tuple[float | None, int, float | None]:
    """What a save that stopped (killed, crashed) left in ``group``, from the listing: how
    long the live in-flight record has been silent (None: no live record), the objects
    left, and when ``gc`` with its default grace removes them and the open uploads (None:
    nothing left, or a save refreshed its record within :data:`SILENT_S`: it is running).

    Left are: the objects of an uncommitted directory; in a committed one, those of other
    saves written after the commit (an overwrite that stopped; a save the commit replaced
    is no crash's) and every in-flight record (the committed save's own, when its
    coordinator stopped before deleting it). ``gc`` removes them once the newest of them,
    and of the open uploads, is older than its grace, and not while a record is live.
    """
    # The records Group.in_flight counts: refreshed within the lease, after the commit, and
    # not the committed save's own.
    done = SAVING_PREFIX + str(save_id) if group.committed else None
    commit = timestamp(group.manifest) if group.manifest is not None else None
    live = [
        timestamp(m)
        for m in group.saving
        if now - timestamp(m) < LEASE_S
        and (done is None or not m.key.endswith(done))
        and (commit is None or timestamp(m) > commit)
    ]
    silent = now - max(live) if live else None
    if silent is not None and silent < SILENT_S:
        return silent, 0, None
    if commit is not None:
        stale = [
            o.meta for o in group.objects if o.save_id != save_id and timestamp(o.meta) > commit
        ]
    else:
        stale = [o.meta for o in group.objects]
    left = [*stale, *group.saving]
    started = [u.initiated.timestamp() for u in group.uploads if u.initiated is not None]
    if not left and not group.uploads:
        return silent, 0, None
    newest = max([*(timestamp(m) for m in left), *started], default=now)
    return silent, len(left), newest + DEFAULT_GRACE


async def alist_checkpoints(
    store: ObjectStore,
    location: S3URI,
    *,
    include_uncommitted: bool = False,
    details: bool = False,
    problems: list[str] | None = None,
) -> list[CheckpointInfo]:
    """Checkpoints under ``location``, oldest first (see :mod:`s3ckpt.catalog.retention` for the order).

    Costs one request when the prefix holds at most 1000 objects, else one delimiter
    listing per directory (:func:`~s3ckpt.catalog.scan.scan_checkpoints`, never a page per
    1000 objects) plus a GET of each committed manifest for its size and ranks, and, where
    in-flight records were listed, a ``HeadBucket`` for the store's clock. A manifest whose
    directory shows no metadata object (every s3ckpt commit writes one just before its
    manifest) is read too: one that is not s3ckpt's (:class:`ForeignObjectError`) makes
    its directory ``foreign``, never committed, listed with ``include_uncommitted`` only
    (else reported in ``problems``). ``details`` reads every manifest, for exact ranks,
    items and save id (an unreadable manifest marks its checkpoint ``damaged`` instead of
    failing the listing). What could not be listed is appended to ``problems`` (logged
    when it is None).
    """
    scanned = await scan_checkpoints(store, location)
    if include_uncommitted and (problem := await add_uploads(store, location, scanned)):
        _report(problem, problems)
    groups = [g for g in scanned.groups.values() if g.committed or include_uncommitted]
    # In-flight records are judged by the store's clock; asked only when there are some.
    now = await store_time(store) if any(g.saving for g in groups) else time.time()
    manifests: list[Read] = await bounded(
        [lambda g=g: _maybe_manifest(store, child(location, g.name), g, details) for g in groups]
    )
    manifests = [_damaged_if_ours(g, m) for g, m in zip(groups, manifests, strict=True)]
    if not include_uncommitted:
        for foreign in (m for m in manifests if isinstance(m, ForeignObjectError)):
            _report(f"{foreign} (ls --all lists it as foreign)", problems)
    ours = [
        (g, m)
        for g, m in zip(groups, manifests, strict=True)
        if include_uncommitted or not isinstance(m, ForeignObjectError)
    ]
    replaced = superseded(
        Candidate(g.name, g.newest)
        for g, m in ours
        if g.committed and not isinstance(m, ForeignObjectError)
    )
    infos = [_info(location, g, m, now, replaced.get(g.name), details) for g, m in ours]
    return sorted(infos, key=lambda i: (natural_key(i.name), i.time, i.name))


def _damaged_if_ours(group: Group, read: Read) -> Read:
    """A manifest that is not s3ckpt's beside an s3ckpt metadata object (which a commit
    writes just before its manifest) is an s3ckpt checkpoint whose manifest was replaced:
    listed ``damaged`` (``ls`` exits 1), not ``foreign``. Beside a stopped save's data
    objects alone it stays ``foreign``. The commands that delete refuse both."""
    if isinstance(read, ForeignObjectError) and any(o.rank is None for o in group.objects):
        return f"unreadable manifest: {read}"
    return read


def _report(problem: str, problems: list[str] | None) -> None:
    if problems is None:
        log.warning("%s", problem)
    else:
        problems.append(problem)


def _suspect(group: Group) -> bool:
    """A committed directory whose listing shows no metadata object: every s3ckpt commit
    writes one just before its manifest, so the manifest may be another tool's."""
    return group.suspect


async def _maybe_manifest(
    store: ObjectStore, location: S3URI, group: Group, details: bool = True
) -> Read:
    """The manifest, None if there is none (or it is not needed: the listing saw every
    object, all of them s3ckpt's, and no details were asked for), why it is unreadable,
    or the error saying it is not s3ckpt's."""
    if not group.committed or not (details or group.shallow or _suspect(group)):
        return None
    try:
        return await read_manifest(store, location)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as exc:
        return str(exc)
    except ForeignObjectError as exc:
        return exc


async def _ours(
    store: ObjectStore, location: S3URI, groups: list[Group], foreign: list[str] | None = None
) -> list[Group]:
    """The committed ``groups`` whose manifest is s3ckpt's, as far as the listing and a
    GET of each suspect manifest (:func:`_suspect`) tell: no other is a checkpoint. Why
    each other one is not s3ckpt's is appended to ``foreign``."""
    found = await bounded(
        [lambda g=g: _maybe_manifest(store, child(location, g.name), g, False) for g in groups]
    )
    if foreign is not None:
        foreign += [str(m) for m in found if isinstance(m, ForeignObjectError)]
    return [g for g, m in zip(groups, found, strict=True) if not isinstance(m, ForeignObjectError)]


async def acommitted_names(store: ObjectStore, location: S3URI) -> dict[str, str | None]:
    """The committed checkpoints under ``location``, each with the name of the one that
    supersedes it after a rollback (None: current; see :mod:`s3ckpt.catalog.retention`).

    The listing of :func:`alist_checkpoints` without its manifest GETs: names and commit
    times are all it needs, so it costs one request up to 1000 objects under the prefix
    and one per directory past that, what a training loop may afford to wait for. Only a
    manifest whose directory shows no metadata object is read: a foreign one is left out.
    """
    scanned = await scan_checkpoints(store, location)
    groups = await _ours(store, location, [g for g in scanned.groups.values() if g.committed])
    replaced = superseded(Candidate(g.name, g.newest) for g in groups)
    return {g.name: replaced.get(g.name) for g in groups}


def committed_names(
    uri: str | S3URI, *, config: S3Config | None = None, **options: Any
) -> dict[str, str | None]:
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
    store, location = open_store(uri, config, options, require_prefix=True)
    return io_loop().run(ais_committed(store, location))


def list_checkpoints(
    uri: str | S3URI,
    *,
    include_uncommitted: bool = False,
    details: bool = False,
    problems: list[str] | None = None,
    config: S3Config | None = None,
    **options: Any,
) -> list[CheckpointInfo]:
    store, location = open_store(uri, config, options, require_prefix=False)
    return io_loop().run(
        alist_checkpoints(
            store,
            location,
            include_uncommitted=include_uncommitted,
            details=details,
            problems=problems,
        )
    )


# -- show ---------------------------------------------------------------------------------


def show_checkpoint(
    uri: str | S3URI, *, config: S3Config | None = None, **options: Any
) -> Manifest:
    """The committed manifest at ``uri``, with every item listed (format 2 reads them from
    the index objects)."""
    store, location = open_store(uri, config, options, require_prefix=True)
    return io_loop().run(_committed_with_items(store, location))


async def _committed_with_items(store: ObjectStore, location: S3URI) -> Manifest:
    return await with_items(store, location, await read_committed(store, location))


# -- rm and prune -------------------------------------------------------------------------


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
    store, location = open_store(uri, config, options, require_prefix=True)
    return io_loop().run(aremove_checkpoint(store, location, progress=progress))


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
    not s3ckpt's is no candidate either (read as :func:`alist_checkpoints` reads them, and
    again just before any delete: :func:`~s3ckpt.catalog.unpublish.unpublish`): why is in
    :attr:`PruneReport.foreign`, and :class:`ForeignObjectError` is raised when it is
    ``location`` itself."""
    listed = await scan_checkpoints(store, location)
    committed = [g for g in listed.groups.values() if g.committed]
    foreign: list[str] = []
    groups = {g.name: g for g in await _ours(store, location, committed, foreign)}
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
            [lambda g=g: _maybe_manifest(store, child(location, g.name), g, False) for g in victims]
        )
        removed = [
            Removed(
                g.name,
                str(child(location, g.name)),
                *_extent(g, m if isinstance(m, Manifest) else None),
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
