"""``ls``: the checkpoints under a prefix, one :class:`CheckpointInfo` row each, oldest first.

A row comes from the listing and, for a committed checkpoint, its manifest where the
listing cannot tell (:mod:`s3ckpt.catalog.ownership`); it says what a save that stopped
left there and when ``gc`` removes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from s3ckpt.catalog.clock import store_time
from s3ckpt.catalog.grace import DEFAULT_GRACE
from s3ckpt.catalog.ownership import Read, extent, maybe_manifest
from s3ckpt.catalog.retention import Candidate, natural_key, superseded
from s3ckpt.catalog.scan import Group, add_uploads, child, open_store, scan_checkpoints, timestamp
from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import ForeignObjectError
from s3ckpt.format.layout import HEARTBEAT_S, LEASE_S, SAVING_PREFIX
from s3ckpt.format.manifest import Manifest
from s3ckpt.s3.loop import bounded, io_loop
from s3ckpt.s3.store import ObjectStore

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
    objects, size = extent(group, manifest)
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
        [lambda g=g: maybe_manifest(store, child(location, g.name), g, details) for g in groups]
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
        [
            Candidate(g.name, g.newest)
            for g, m in ours
            if g.committed and not isinstance(m, ForeignObjectError)
        ]
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


def list_checkpoints(
    uri: str | S3URI,
    *,
    include_uncommitted: bool = False,
    details: bool = False,
    problems: list[str] | None = None,
    config: S3Config | None = None,
    **options: Any,
) -> list[CheckpointInfo]:
    """The checkpoints under ``uri``, one :class:`CheckpointInfo` row each (``s3ckpt ls``;
    :func:`alist_checkpoints` run on the I/O loop, at its cost in requests).

    Args:
        uri: ``s3://bucket`` or ``s3://bucket/prefix``.
        include_uncommitted: also list directories without a committed manifest (saves
            running or stopped, another tool's ``manifest.json`` as ``foreign``), and count
            the open multipart uploads of s3ckpt's objects.
        details: read every manifest, for exact ranks, items and save id; an unreadable
            one marks its row ``damaged`` instead of failing the listing.
        problems: what could not be listed is appended here (logged when None).
        config: connection and tuning (:class:`~s3ckpt.S3Config`; the defaults when None).
        **options: :class:`~s3ckpt.S3Config`'s fields by name, over ``config``.

    Returns:
        The rows oldest first, in :mod:`~s3ckpt.catalog.retention`'s order (steps compared
        as numbers, then commit times).

    Raises:
        ~s3ckpt.errors.InvalidURIError: ``uri`` is not an ``s3://`` URI.
        ~s3ckpt.errors.ConfigError: an unknown or invalid option.
        ~s3ckpt.errors.StorageError: a listing failed (a missing bucket:
            :class:`~s3ckpt.errors.BucketNotFoundError`; refused credentials:
            :class:`~s3ckpt.errors.AccessDeniedError`).
    """
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
