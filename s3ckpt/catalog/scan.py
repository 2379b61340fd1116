"""Grouping a recursive listing into checkpoints, and the I/O the catalog operations share.

One ``ListObjectsV2`` over a prefix (1000 keys a page) sees every checkpoint below it, so
listing N checkpoints costs pages, not N requests. Keys are recognised by the on-store
format (``docs/format.md``); the directory holding them names the checkpoint:

* ``<name>/manifest.json``: the commit, so ``<name>`` is a committed checkpoint;
* ``<name>/metadata-<save_id>.pkl``, ``<name>/data/[<hex>/]r<rank>-<save_id>-<n>.bin`` and
  ``<name>/index/[<hex>/]r<rank>-<save_id>.json``: objects of a save into ``<name>``;
  without a manifest they form an uncommitted checkpoint (a save in flight, or one that
  died);
* ``<name>/.s3ckpt-saving-<save_id>``: the in-flight record of a save into ``<name>``
  (:mod:`s3ckpt.transfer.inflight`): refreshed recently, a save is running there;
* ``<name>/.s3ckpt-claim-<save_id>``: a claim on the commit, on stores without
  conditional writes (:mod:`s3ckpt.transfer.commit`);
* ``<name>/.s3ckpt-probe-<hex>``: left by an interrupted conditional-write probe.

Anything else is not s3ckpt's and is never counted or deleted: a name close to these but
not of their form (``data/model.bin``, ``data/r0-1-0.bin``, ``metadata.pkl``) is another
tool's. A ``manifest.json`` whose body is not s3ckpt's makes its directory *foreign*, no
checkpoint (:func:`s3ckpt.format.manifest.s3ckpt_body`; read by the operations, not here).
``name`` is relative to the listed prefix and may contain slashes; ``""`` is the prefix
itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from s3ckpt.catalog.reporting import Reporter
from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.errors import CheckpointNotFoundError, StorageError
from s3ckpt.format.layout import CLAIM_PREFIX, LEASE_S, SAVING_PREFIX
from s3ckpt.format.manifest import Manifest
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES
from s3ckpt.s3.loop import bounded
from s3ckpt.s3.store import ObjectMeta, ObjectStore, PendingUpload
from s3ckpt.transfer.commit import PROBE_PREFIX, read_manifest

DELETE_BATCH = 1000  # keys per DeleteObjects request, S3's maximum
_PARALLEL = 8  # manifest GETs, directory listings or DeleteObjects batches in flight
SMALL_LISTING = 1000  # one ListObjectsV2 page: beyond it, scan_checkpoints lists by level
_SAVE_FOLDERS = ("data", "index")  # folders of a save's objects inside a checkpoint

_DIR = r"^(?:(?P<dir>.*)/)?"
_MANIFEST = re.compile(_DIR + r"manifest\.json$")
_METADATA = re.compile(_DIR + r"metadata-(?P<save>[0-9a-f]+)\.pkl$")
_PROBE = re.compile(_DIR + re.escape(PROBE_PREFIX) + r"[0-9a-f]+$")
_SAVING = re.compile(_DIR + re.escape(SAVING_PREFIX) + r"[0-9a-f]+$")
_CLAIM = re.compile(_DIR + re.escape(CLAIM_PREFIX) + r"[0-9a-f]+$")
# As layout.data_key and index_key write them: ranks of 5 digits or more, parts of 4 or more.
_DATA = re.compile(
    _DIR + r"data/(?:[0-9a-f]{1,3}/)?r(?P<rank>\d{5,})-(?P<save>[0-9a-f]+)-\d{4,}\.bin$"
)
_INDEX = re.compile(_DIR + r"index/(?:[0-9a-f]{1,3}/)?r(?P<rank>\d{5,})-(?P<save>[0-9a-f]+)\.json$")


def timestamp(meta: ObjectMeta) -> float:
    """LastModified as seconds since the epoch (0 when the server sent none)."""
    value: datetime | None = meta.last_modified
    return value.timestamp() if value is not None else 0.0


@dataclass(frozen=True)
class SaveKey:
    """A metadata or data object, with what its name says about the save that wrote it."""

    meta: ObjectMeta
    save_id: str
    rank: int | None  # None for the metadata object


@dataclass
class Group:
    """The s3ckpt objects found in one checkpoint directory."""

    name: str
    manifest: ObjectMeta | None = None
    objects: list[SaveKey] = field(default_factory=list)
    uploads: list[PendingUpload] = field(default_factory=list)  # open multipart uploads
    saving: list[ObjectMeta] = field(default_factory=list)  # in-flight records
    claims: list[ObjectMeta] = field(default_factory=list)  # commit claims
    shallow: bool = False  # listed without its data and index objects (scan_checkpoints)

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    def in_flight(self, now: float, lease: float = LEASE_S) -> bool:
        """Whether a save is running here: an in-flight record refreshed within ``lease``
        (``LastModified`` from the server's clock, and ``now`` too: callers read it from
        the store, :mod:`s3ckpt.catalog.clock`, never from this machine).

        In a committed directory, only records written since the commit count: a save
        killed before it, then saved again by a resumed run, leaves one, and a live save
        rewrites its record every ``HEARTBEAT_S``. ``LastModified`` has whole seconds, so a
        record of the commit's own second counts too (an overwrite may have started
        then), unless it is the committed save's own (that save has committed, and died
        before deleting its record), which the listing tells only where
        :meth:`committed_save` is sure of it."""
        committed_at = timestamp(self.manifest) if self.manifest is not None else None
        own = self.committed_save() if committed_at is not None else None
        return any(
            now - timestamp(m) < lease
            and (committed_at is None or timestamp(m) >= committed_at)
            and not (own is not None and m.key.endswith(SAVING_PREFIX + own))
            for m in self.saving
        )

    def committed_save(self) -> str | None:
        """The save id the manifest names, where the listing alone is sure of it; else None.

        The committed save wrote its metadata object just before its manifest, so in the
        commit's second or earlier; a save that started after the commit writes its own
        later, but within the same second when it is quick: ``LastModified`` has whole
        seconds. So the hint (:meth:`committed_save_hint`) is sure when its metadata is
        the only newest one not written after the manifest, and older than the commit's
        second or the only one at all; a metadata object of the commit's second beside
        older ones may be a running overwrite's, and then nothing is sure."""
        if self.manifest is None:
            return None
        commit = timestamp(self.manifest)
        before = [o for o in self.objects if o.rank is None and timestamp(o.meta) <= commit]
        if not before:
            return None
        newest = max(timestamp(o.meta) for o in before)
        at_newest = {o.save_id for o in before if timestamp(o.meta) == newest}
        if len(at_newest) > 1 or (newest >= commit and len({o.save_id for o in before}) > 1):
            return None
        return at_newest.pop()

    @property
    def suspect(self) -> bool:
        """Committed, and its listing shows no metadata object: every s3ckpt commit writes
        one just before its manifest, so the manifest may be another tool's (read it to
        tell, :func:`s3ckpt.format.manifest.check_s3ckpt`)."""
        return self.committed and self.committed_save_hint() is None

    @property
    def bytes(self) -> int:
        return sum(o.meta.size for o in self.objects) + (self.manifest.size if self.manifest else 0)

    @property
    def newest(self) -> float:
        """Time of the latest write: the commit time for a committed checkpoint, else the
        newest object (how long an uncommitted save has been silent)."""
        if self.manifest is not None:
            return timestamp(self.manifest)
        started = (u.initiated.timestamp() for u in self.uploads if u.initiated is not None)
        written = (timestamp(m) for m in [*(o.meta for o in self.objects), *self.saving])
        return max([*written, *started], default=0.0)

    def save_ids(self) -> set[str]:
        return {o.save_id for o in self.objects}

    def committed_save_hint(self) -> str | None:
        """The save id the manifest most likely names, guessed from the listing alone.

        The coordinator writes the metadata object just before the manifest, so it is the
        save whose metadata is the newest one not written after the manifest. Exact only
        when read from the manifest; good enough to count ranks in ``ls``.
        """
        if self.manifest is None:
            return None
        commit = timestamp(self.manifest)
        metadata = [o for o in self.objects if o.rank is None]
        before = [o for o in metadata if timestamp(o.meta) <= commit] or metadata
        if not before:
            return None
        return max(before, key=lambda o: timestamp(o.meta)).save_id

    def ranks(self, save_id: str | None) -> int | None:
        """How many ranks wrote data objects for ``save_id``."""
        if save_id is None:
            return None
        ranks = {o.rank for o in self.objects if o.save_id == save_id and o.rank is not None}
        return len(ranks) or None


@dataclass
class Scan:
    """Every checkpoint directory under a prefix, plus leftover probe objects."""

    groups: dict[str, Group] = field(default_factory=dict)
    probes: list[ObjectMeta] = field(default_factory=list)

    def group(self, name: str) -> Group:
        if name not in self.groups:
            self.groups[name] = Group(name)
        return self.groups[name]


def single_save_name(rel: str) -> str | None:
    """The checkpoint directory of ``rel`` (relative to the listed prefix) if it is a name
    s3ckpt gives one save's object (metadata, data, index, in-flight record, claim,
    probe: each carries the save's random id), else None."""
    for pattern in (_METADATA, _DATA, _INDEX, _SAVING, _CLAIM, _PROBE):
        if match := pattern.match(rel):
            return match["dir"] or ""
    return None


def bookkeeping_name(rel: str) -> bool:
    """Whether ``rel`` names an in-flight record, a commit claim or a probe: objects only
    s3ckpt writes and deletes, which no checkpoint needs once they are deleted."""
    return any(p.match(rel) for p in (_SAVING, _CLAIM, _PROBE))


def manifest_directory(rel: str) -> str | None:
    """The checkpoint directory of ``rel`` if it names a manifest, else None."""
    match = _MANIFEST.match(rel)
    return (match["dir"] or "") if match else None


def data_directory(rel: str) -> str | None:
    """The checkpoint directory of a data object key (relative), None if it is not one."""
    match = _DATA.match(rel)
    return (match["dir"] or "") if match else None


def relative(prefix: str, key: str) -> str:
    """``key`` relative to the listed ``prefix`` ("" for the whole bucket)."""
    return key[len(prefix) + 1 :] if prefix else key


def group_keys(prefix: str, metas: Iterable[ObjectMeta]) -> Scan:
    """Sort the listing of ``prefix`` into checkpoint groups (pure; see the module docstring)."""
    scan = Scan()
    for meta in metas:
        rel = relative(prefix, meta.key)
        if match := _MANIFEST.match(rel):
            scan.group(match["dir"] or "").manifest = meta
        elif match := _METADATA.match(rel):
            scan.group(match["dir"] or "").objects.append(SaveKey(meta, match["save"], None))
        elif match := _DATA.match(rel) or _INDEX.match(rel):
            save = SaveKey(meta, match["save"], int(match["rank"]))
            scan.group(match["dir"] or "").objects.append(save)
        elif match := _SAVING.match(rel):
            scan.group(match["dir"] or "").saving.append(meta)
        elif match := _CLAIM.match(rel):
            scan.group(match["dir"] or "").claims.append(meta)
        elif _PROBE.match(rel):
            scan.probes.append(meta)
    return scan


# -- I/O shared by the catalog operations ------------------------------------------------


def open_store(
    uri: str | S3URI, config: S3Config | None, options: dict[str, Any], *, require_prefix: bool
) -> tuple[ObjectStore, S3URI]:
    location = uri if isinstance(uri, S3URI) else S3URI.parse(uri, require_prefix=require_prefix)
    return ObjectStore(make_config(config, **options), location.bucket), location


def child(location: S3URI, name: str) -> S3URI:
    return location.child(name) if name else location


async def delete_keys(store: ObjectStore, keys: list[str], progress: Reporter) -> None:
    """Batched DeleteObjects, several batches in flight, advancing ``progress`` per batch."""
    batches = [keys[i : i + DELETE_BATCH] for i in range(0, len(keys), DELETE_BATCH)]

    async def delete(batch: list[str]) -> None:
        await store.delete_many(batch)
        progress.advance(len(batch))

    await bounded([lambda b=b: delete(b) for b in batches])


async def scan(store: ObjectStore, location: S3URI) -> Scan:
    """One paged recursive LIST of the prefix, grouped into checkpoints: every object
    (``gc`` needs them all)."""
    prefix = location.prefix
    return group_keys(prefix, [m async for m in store.list(f"{prefix}/" if prefix else "")])


async def scan_checkpoints(store: ObjectStore, location: S3URI) -> Scan:
    """The checkpoints under ``location`` (for ``ls``, retention and
    ``CheckpointManager.steps()``), in one request when the prefix holds at most 1000
    objects and with delimiter listings when it holds more.

    A recursive listing costs a sequential page per 1000 objects, and a checkpoint of a
    thousand ranks holds thousands. So past one page each level is listed with
    ``Delimiter="/"``: a directory costs one request whatever it holds (directories are
    listed concurrently), and ``data/`` and ``index/`` are never entered when the level
    above shows a manifest. A committed group found so holds its manifest, metadata
    objects, in-flight records and claims but not its data (:attr:`Group.shallow`: its
    size is the manifest's business). Directories with s3ckpt objects but no manifest (a
    save in flight, or one that died) are few and listed in full, like :func:`scan` does.
    """
    root = f"{location.prefix}/" if location.prefix else ""
    first: list[ObjectMeta] = []
    listing = store.list(root)
    try:
        async for meta in listing:
            first.append(meta)
            if len(first) == SMALL_LISTING:
                break
        else:
            return group_keys(location.prefix, first)
    finally:
        await listing.aclose()  # type: ignore[attr-defined]
    found = Scan()

    async def walk(folder: str) -> None:
        entries = [entry async for entry in store.list_level(folder)]
        level = group_keys(location.prefix, [e for e in entries if isinstance(e, ObjectMeta)])
        folders = [e for e in entries if isinstance(e, str)]
        name = relative(location.prefix, folder.rstrip("/")) if folder.rstrip("/") else ""
        here = level.groups.get(name)
        if here is not None and here.committed:
            here.shallow = True
            found.groups[name] = here
            folders = [f for f in folders if f.rsplit("/", 2)[-2] not in _SAVE_FOLDERS]
        elif here is not None or any(f.rsplit("/", 2)[-2] in _SAVE_FOLDERS for f in folders):
            deep = group_keys(location.prefix, [m async for m in store.list(folder)])
            found.groups.update(deep.groups)
            found.probes += deep.probes
            return
        found.probes += level.probes
        await bounded([lambda f=f: walk(f) for f in folders], _PARALLEL)

    await walk(root)
    return found


async def add_uploads(store: ObjectStore, location: S3URI, scanned: Scan) -> str | None:
    """Attach the open multipart uploads of s3ckpt data objects to their groups.

    A save killed in the middle of its first object leaves no object at all, only an open
    upload: without this, ``ls --all`` would not show it although ``gc`` will clean it.
    Returns a warning instead when the store cannot list uploads.
    """
    prefix = location.prefix
    uploads = await list_uploads(store, f"{prefix}/" if prefix else "")
    if isinstance(uploads, str):
        return uploads
    for upload in uploads:
        directory = data_directory(relative(prefix, upload.key))
        if directory is not None:
            scanned.group(directory).uploads.append(upload)
    return None


async def list_uploads(store: ObjectStore, prefix: str) -> list[PendingUpload] | str:
    """The open multipart uploads under ``prefix``, or, on a store that cannot list them
    (``ListMultipartUploads`` answered 501 or 405), a warning saying what that means."""
    try:
        return [u async for u in store.list_multipart_uploads(prefix)]
    except StorageError as exc:
        if exc.code not in UNSUPPORTED_CODES:
            raise
        return (
            f"this store cannot list multipart uploads ({exc.code}), so uploads left open by "
            "failed saves are not shown or aborted; an AbortIncompleteMultipartUpload "
            "lifecycle rule on the bucket removes them"
        )


async def read_committed(store: ObjectStore, location: S3URI) -> Manifest:
    """The committed manifest; :class:`CheckpointNotFoundError` if there is none."""
    try:
        return await read_manifest(store, location)
    except FileNotFoundError as exc:
        await store.head_bucket()  # a missing bucket deserves its own error
        raise CheckpointNotFoundError(f"no committed checkpoint at {location}") from exc
