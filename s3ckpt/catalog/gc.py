"""Garbage collection: what failed or abandoned saves left behind, after a grace period.

A save that dies before its commit leaves data objects, maybe a metadata object, and open
multipart uploads; nothing references them, so readers never see them, but they cost
storage. ``gc`` removes, under a prefix:

* multipart uploads of s3ckpt data objects initiated more than ``grace`` ago (aborted);
* uncommitted checkpoints (objects without a manifest) whose newest object, newest open
  upload and newest in-flight record are older than ``grace``;
* objects in a committed checkpoint's directory that its manifest does not list (the
  previous save of an overwrite, a rank that failed during one) once they and the
  manifest that replaced them are older than ``grace``, so that loads that started before
  an overwrite finish undisturbed;
* in-flight records and conditional-write probes older than ``grace``, and commit claims
  older than :data:`CLAIM_GRACE`, whatever ``grace``.

On a bucket with versioning on, it then deletes by version id the versions of s3ckpt's
objects that are deleted (:func:`_purge_versions` says which deletes it follows,
:mod:`s3ckpt.catalog.purge` which versions are s3ckpt's), so the space is freed: one
``ListObjectVersions`` of the prefix more.

It never deletes a manifest, and never touches a directory where a save is in flight: one
whose in-flight record was refreshed within its lease (:mod:`s3ckpt.transfer.inflight`),
or with a multipart upload started inside the grace period. ``LastModified`` and
``Initiated`` come from the server's clock, and so does ``now`` (:mod:`s3ckpt.catalog.clock`):
a host whose clock is off ages nothing wrongly. Reading manifests
costs one GET per committed checkpoint whose directory holds objects of more than one
save; all other decisions come from the listing.

The CLI refuses a grace below :data:`MIN_SAFE_GRACE` unless forced: the grace is also what
protects loads reading a checkpoint that an overwrite just replaced, and saves written by
s3ckpt releases that kept no in-flight record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from s3ckpt.catalog.clock import store_time
from s3ckpt.catalog.grace import DEFAULT_GRACE, MIN_SAFE_GRACE
from s3ckpt.catalog.purge import keeps_versions, own_versions
from s3ckpt.catalog.reporting import SILENT, Reporter
from s3ckpt.catalog.scan import (
    Group,
    Scan,
    bookkeeping_name,
    child,
    data_directory,
    delete_keys,
    list_uploads,
    manifest_directory,
    open_store,
    relative,
    scan,
    single_save_name,
    timestamp,
)
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import CorruptCheckpointError, ForeignObjectError, StorageError
from s3ckpt.format.layout import LEASE_S
from s3ckpt.s3.loop import bounded, io_loop
from s3ckpt.s3.store import ObjectMeta, ObjectStore, PendingUpload
from s3ckpt.s3.versions import ObjectVersion, delete_versions, list_versions
from s3ckpt.transfer.commit import CLAIM_MAX_AGE_S, read_manifest

# A writer gives up a claim it has held for CLAIM_MAX_AGE_S (its own clock) before writing
# the manifest; removing claims only well after that keeps the claim protocol safe.
CLAIM_GRACE = CLAIM_MAX_AGE_S + MIN_SAFE_GRACE


@dataclass(frozen=True)
class Garbage:
    """Objects deleted (or deletable, in a dry run) for one reason in one directory."""

    name: str  # checkpoint directory, relative to the prefix
    reason: str  # "uncommitted", "unreferenced", "record", "claim" or "probe"
    keys: tuple[str, ...]
    bytes: int
    age: float  # seconds since the newest of them was written


@dataclass(frozen=True)
class AbortedUpload:
    """An open multipart upload that ``gc`` aborted (or, in a dry run, would abort):
    its object's ``key``, its ``upload_id`` and its ``age`` in seconds."""

    key: str
    upload_id: str
    age: float


@dataclass
class GcReport:
    """What :func:`collect_garbage` found and removed under a prefix (in a dry run: would
    remove); ``objects`` and ``bytes`` total the deleted ``garbage``."""

    grace: float
    dry_run: bool
    uploads: list[AbortedUpload] = field(default_factory=list)
    garbage: list[Garbage] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # directories skipped, and why
    in_flight: list[str] = field(default_factory=list)  # directories left alone: saves running
    # On a bucket with versioning on: noncurrent versions and delete markers of s3ckpt's
    # objects deleted by id, and their bytes (:mod:`s3ckpt.catalog.purge`)
    versions: int = 0
    version_bytes: int = 0

    @property
    def objects(self) -> int:
        return sum(len(g.keys) for g in self.garbage)

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.garbage)


async def acollect_garbage(
    store: ObjectStore,
    location: S3URI,
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
    now: float | None = None,
    lease: float = LEASE_S,
    progress: Reporter = SILENT,
) -> GcReport:
    """Find and (unless ``dry_run``) remove garbage under ``location``; see the module docstring.

    ``lease``: how long after its last refresh an in-flight record still means a save is
    running. Shorten it only when the saves are known to be dead (their processes gone).
    """
    now = await store_time(store) if now is None else now
    cutoff = now - grace
    report = GcReport(grace, dry_run)
    uploads = await list_uploads(store, _list_prefix(location))
    if isinstance(uploads, str):
        report.problems.append(uploads)
        uploads = []
    listing = await scan(store, location)
    busy = _busy_directories(location, listing, uploads, cutoff, now, lease)
    report.in_flight = sorted(n for n in busy if n is not None and listing.groups.get(n))
    report.uploads = [
        _aborted(u, now)
        for u in uploads
        if _initiated(u) <= cutoff and data_directory(relative(location.prefix, u.key)) not in busy
    ]
    report.garbage = [
        *_uncommitted(listing, busy, cutoff, now),
        *await _unreferenced(store, location, listing, busy, cutoff, now, report.problems),
        *_records(listing, busy, cutoff, now - max(CLAIM_GRACE, grace), now),
        *_probes(location, listing, cutoff, now),
    ]
    if not dry_run:
        await _remove(store, report, progress)
    if await keeps_versions(store):
        await _purge_versions(store, location, listing, busy, report, cutoff)
    return report


async def _purge_versions(
    store: ObjectStore,
    location: S3URI,
    listing: Scan,
    busy: set[str | None],
    report: GcReport,
    cutoff: float,
) -> None:
    """On a bucket with versioning on, delete by id the versions of s3ckpt's objects that
    are deleted (:mod:`s3ckpt.catalog.purge` says which versions are s3ckpt's): those of
    the keys this run deleted, and of those deleted longer ago than the grace where no
    checkpoint could be restored from them: in-flight records, claims and probes, and a
    save's objects in a directory where no manifest was ever kept (no version of one is
    listed: a deleted checkpoint's data beside its manifest's old version may be someone's
    way back, after a delete by another tool). Directories where a save is in flight, or
    whose ``manifest.json`` may be another tool's (:attr:`Group.suspect`), are left alone.
    A dry run counts, the current versions of the keys it would delete as deleted."""
    removed = {k for g in report.garbage for k in g.keys}
    left_alone = {g.name for g in listing.groups.values() if g.suspect} | busy
    try:
        listed = [e async for e in list_versions(store, _list_prefix(location))]
    except StorageError as exc:
        report.problems.append(f"old versions not listed, so not deleted ({exc})")
        return
    rel = {e.key: relative(location.prefix, e.key) for e in listed}
    manifests = {manifest_directory(r) for r in rel.values()} - {None}

    def deleted(key: str, latest: ObjectVersion) -> bool:
        made = latest.last_modified.timestamp() if latest.last_modified else math.inf
        restorable = single_save_name(rel[key]) in manifests and not bookkeeping_name(rel[key])
        return key in removed or (made <= cutoff and not restorable)

    entries = [
        e
        for e in listed
        if single_save_name(rel[e.key]) not in left_alone
        and single_save_name(rel[e.key]) is not None
        and not (report.dry_run and e.key in removed and e.latest)
    ]
    chosen, kept = own_versions(entries, deleted, {})
    report.problems += kept
    if chosen and not report.dry_run:
        try:
            await delete_versions(store, chosen)
        except StorageError as exc:
            report.problems.append(f"old versions not deleted ({exc})")
            return
    report.versions, report.version_bytes = len(chosen), sum(e.size for e in chosen)


def _list_prefix(location: S3URI) -> str:
    return f"{location.prefix}/" if location.prefix else ""


def _initiated(upload: PendingUpload) -> float:
    """Start time of an upload; one the server gave no time for counts as just started."""
    return upload.initiated.timestamp() if upload.initiated is not None else math.inf


def _aborted(upload: PendingUpload, now: float) -> AbortedUpload:
    return AbortedUpload(upload.key, upload.upload_id, now - _initiated(upload))


def _busy_directories(
    location: S3URI,
    listing: Scan,
    uploads: list[PendingUpload],
    cutoff: float,
    now: float,
    lease: float,
) -> set[str | None]:
    """Checkpoint directories where a save is running (a live in-flight record, or an
    upload started inside the grace period): nothing in them is touched."""
    busy: set[str | None] = {None}  # None: not an s3ckpt data object, never touched
    busy.update(g.name for g in listing.groups.values() if g.in_flight(now, lease))
    for upload in uploads:
        if _initiated(upload) > cutoff:
            busy.add(data_directory(relative(location.prefix, upload.key)))
    return busy


def _garbage(name: str, reason: str, metas: list[ObjectMeta], now: float) -> Garbage:
    newest = max((timestamp(m) for m in metas), default=now)
    return Garbage(
        name, reason, tuple(m.key for m in metas), sum(m.size for m in metas), now - newest
    )


def _uncommitted(listing: Scan, busy: set[str | None], cutoff: float, now: float) -> list[Garbage]:
    return [
        _garbage(g.name, "uncommitted", [*(o.meta for o in g.objects), *g.saving], now)
        for g in listing.groups.values()
        if not g.committed and (g.objects or g.saving) and g.name not in busy and g.newest <= cutoff
    ]


async def _unreferenced(
    store: ObjectStore,
    location: S3URI,
    listing: Scan,
    busy: set[str | None],
    cutoff: float,
    now: float,
    problems: list[str],
) -> list[Garbage]:
    """Old objects in committed directories that the manifest does not list."""
    mixed = [
        g
        for g in listing.groups.values()
        if g.committed and g.name not in busy and len(g.save_ids()) > 1
    ]

    async def check(group: Group) -> Garbage | None:
        where = child(location, group.name)
        try:
            manifest = await read_manifest(store, where)
        except (FileNotFoundError, CorruptCheckpointError) as exc:
            problems.append(f"{where}: manifest unreadable, left alone ({exc})")
            return None
        except ForeignObjectError as exc:
            problems.append(f"{where}: left alone: {exc}")
            return None
        listed = {where.key(k) for k in manifest.all_keys()}
        replaced_at = timestamp(group.manifest) if group.manifest else now
        stale = [
            o.meta
            for o in group.objects
            if o.meta.key not in listed and max(timestamp(o.meta), replaced_at) <= cutoff
        ]
        return _garbage(group.name, "unreferenced", stale, now) if stale else None

    found = await bounded([lambda g=g: check(g) for g in mixed])
    return [g for g in found if g is not None]


def _records(
    listing: Scan, busy: set[str | None], cutoff: float, claim_cutoff: float, now: float
) -> list[Garbage]:
    """In-flight records left in committed directories by saves that stopped (those of
    uncommitted ones go with their objects), and claims of commits that died."""
    found = []
    for group in listing.groups.values():
        if group.name in busy:
            continue
        records = [m for m in group.saving if group.committed and timestamp(m) <= cutoff]
        claims = [m for m in group.claims if timestamp(m) <= claim_cutoff]
        found += [_garbage(group.name, "record", records, now)] if records else []
        found += [_garbage(group.name, "claim", claims, now)] if claims else []
    return found


def _probes(location: S3URI, listing: Scan, cutoff: float, now: float) -> list[Garbage]:
    old = [p for p in listing.probes if timestamp(p) <= cutoff]
    by_dir: dict[str, list[ObjectMeta]] = {}
    for probe in old:
        by_dir.setdefault(relative(location.prefix, probe.key).rpartition("/")[0], []).append(probe)
    return [_garbage(name, "probe", metas, now) for name, metas in by_dir.items()]


async def _remove(store: ObjectStore, report: GcReport, progress: Reporter) -> None:
    keys = [k for g in report.garbage for k in g.keys]
    progress.start("collecting garbage", len(keys) + len(report.uploads), "objects")

    async def abort(upload: AbortedUpload) -> None:
        await store.abort_multipart(upload.key, upload.upload_id)
        progress.advance(1)

    await bounded([lambda u=u: abort(u) for u in report.uploads])
    await delete_keys(store, keys, progress)
    progress.finish()


def collect_garbage(
    uri: str | S3URI,
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
    lease: float = LEASE_S,
    progress: Reporter = SILENT,
    config: S3Config | None = None,
    **options: Any,
) -> GcReport:
    """Remove what failed or abandoned saves left under ``uri`` once it is older than
    ``grace`` (``s3ckpt gc``; :func:`~s3ckpt.catalog.gc.acollect_garbage` run on the I/O
    loop; what counts as garbage: :mod:`s3ckpt.catalog.gc`).

    It never deletes a manifest, and never touches a directory where a save is in flight.

    Args:
        uri: ``s3://bucket`` or ``s3://bucket/prefix``.
        grace: seconds that garbage must have aged, by the store's clock. It also protects
            loads still reading a checkpoint an overwrite replaced; the CLI refuses less
            than :data:`~s3ckpt.catalog.grace.MIN_SAFE_GRACE` unless forced, this
            function does not.
        dry_run: find and report, delete nothing.
        lease: seconds after its last refresh that an in-flight record still means a save
            is running; shorten it only when those saves are known to be dead.
        progress: told how many objects are deleted and uploads aborted as they go.
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        The uploads aborted and the objects deleted, by directory and reason (in a dry
        run, what would be), the directories left alone because a save is in flight, the
        versions deleted by id on a bucket with versioning on, and the problems met
        (directories skipped, a store that cannot list uploads).

    Raises:
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: a listing, abort or delete failed (a missing bucket:
            :class:`~s3ckpt.errors.BucketNotFoundError`).
    """
    store, location = open_store(uri, config, options, require_prefix=False)
    return io_loop().run(
        acollect_garbage(
            store, location, grace=grace, dry_run=dry_run, lease=lease, progress=progress
        )
    )
