"""Freeing the space of s3ckpt's deletes on a bucket with versioning on.

On such a bucket (``Enabled``, or ``Suspended`` after it was) a delete adds a delete
marker and the bytes stay, as noncurrent versions (:mod:`s3ckpt.s3.versions`). So after
``rm``, ``prune`` and ``gc`` have deleted as they always do (readers stop seeing a
checkpoint at the same moment as on any bucket), they delete by version id the versions
that s3ckpt's own saves wrote at the keys they deleted. Which versions those are:

* a key of one save's own name (a data, index or metadata object, an in-flight record, a
  commit claim, a probe: :func:`s3ckpt.catalog.scan.single_save_name`) holds s3ckpt's
  versions when every version of it holds the same bytes as its first one (same size
  and ETag). The name carries the save's random id, so the save wrote it first; its
  retries and heartbeats rewrite the same bytes. A key with any other version (another
  writer wrote over s3ckpt's object) is left alone, all its versions and markers, and
  reported. A probe's name holds the probe's versions only, whatever their bytes (it
  writes twice to see what the store does);
* ``manifest.json`` (one name for every save into a checkpoint): only the versions with
  the ETag of the manifest the operation read and deleted (checked to be s3ckpt's
  first); the versions of earlier commits (overwrites) are left to a lifecycle rule.

Only a key whose current entry is a delete marker is touched (it is deleted: the
operation's own delete, or, for ``gc``, an older one it may follow:
:func:`s3ckpt.catalog.gc._purge_versions`), so no reader's view changes: a noncurrent
version never becomes current again once a newer entry exists.
The markers of a key whose versions are all deleted go too. A key's versions of
another writer keep its markers, so nothing of theirs reappears. Costs one
``ListObjectVersions`` of each deleted checkpoint (``rm``, ``prune``) or of the prefix
(``gc``), plus the deletes; on a bucket that never had versioning, one
``GetBucketVersioning`` and nothing else.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from s3ckpt.errors import StorageError
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.s3.store import ObjectStore
from s3ckpt.s3.versions import ObjectVersion, delete_versions, list_versions, versioning
from s3ckpt.transfer.commit import PROBE_PREFIX

log = logging.getLogger(__name__)


@dataclass
class Purged:
    """Versions deleted (or deletable, in a dry run) by id, and the keys left alone."""

    versions: int = 0
    bytes: int = 0
    kept: list[str] = field(default_factory=list)  # keys left alone, and why

    def add(self, other: Purged) -> None:
        self.versions += other.versions
        self.bytes += other.bytes
        self.kept += other.kept


async def keeps_versions(store: ObjectStore) -> bool:
    """Whether deletes on the bucket keep versions (versioning ``Enabled`` or
    ``Suspended``); False where the state cannot be read (logged: space then stays as
    noncurrent versions if there are any, which a lifecycle rule removes)."""
    try:
        return await versioning(store) != "never"
    except StorageError as exc:
        log.warning("cannot read the versioning of s3://%s (%s)", store.bucket, exc)
        return False


def own_versions(
    entries: list[ObjectVersion],
    deleted: Callable[[str, ObjectVersion], bool],
    manifest_etags: dict[str, str],
) -> tuple[list[ObjectVersion], list[str]]:
    """The entries (versions and markers) to delete by id, and the keys left alone with
    why (see the module docstring). ``entries``: a listing's, keys already chosen among
    s3ckpt's single-save names and ``manifest.json``; ``deleted(key, latest)``: whether
    the key's delete (its latest entry, a marker) is one to purge after;
    ``manifest_etags``: manifest key -> the ETag of the s3ckpt manifest deleted there."""
    by_key: dict[str, list[ObjectVersion]] = defaultdict(list)
    for entry in entries:
        by_key[entry.key].append(entry)
    chosen: list[ObjectVersion] = []
    kept: list[str] = []
    for key, found in sorted(by_key.items()):
        latest = [e for e in found if e.latest]
        if any(not e.marker for e in latest) or (latest and not deleted(key, latest[0])):
            continue  # a current version, or a delete not this operation's to follow
        versions = [e for e in found if not e.marker]
        markers = [e for e in found if e.marker]
        if key.rpartition("/")[2] == MANIFEST_NAME:
            etag = manifest_etags.get(key)
            ours = [v for v in versions if etag is not None and _same(v.etag, etag)]
        elif key.rpartition("/")[2].startswith(PROBE_PREFIX):
            ours = versions  # a probe writes other bytes over its own under its own name
        else:
            first = min(versions, key=_time, default=None)
            ours = [v for v in versions if first and (v.size, _bare(v.etag)) == _bytes(first)]
            if len(ours) < len(versions):
                kept.append(f"{key}: versions of other bytes than s3ckpt wrote; left alone")
                continue
        chosen += ours + (markers if len(ours) == len(versions) else [])
    return chosen, kept


async def purge(
    store: ObjectStore,
    prefix: str,
    wanted: Callable[[str], bool],
    deleted: Callable[[str, ObjectVersion], bool],
    manifest_etags: dict[str, str] | None = None,
    *,
    dry_run: bool = False,
) -> Purged:
    """List the versions under ``prefix``, keep those of keys ``wanted`` picks, and
    delete (unless ``dry_run``) the ones :func:`own_versions` chooses. A store that
    refuses the listing or the deletes (credentials without ``s3:ListBucketVersions`` or
    ``s3:DeleteObjectVersion``) leaves the versions where they are: said in ``kept``,
    not raised, since the command's own deletes are done."""
    try:
        entries = [e async for e in list_versions(store, prefix) if wanted(e.key)]
        chosen, kept = own_versions(entries, deleted, manifest_etags or {})
        if chosen and not dry_run:
            await delete_versions(store, chosen)
    except StorageError as exc:
        reason = (
            f"s3://{store.bucket}/{prefix}: old versions not deleted ({exc}); a lifecycle "
            "rule with NoncurrentVersionExpiration frees them"
        )
        log.warning("%s", reason)
        return Purged(kept=[reason])
    for reason in kept:
        log.warning("%s", reason)
    return Purged(len(chosen), sum(e.size for e in chosen), kept)


def _bare(etag: str) -> str:
    return etag.strip('"')


def _same(a: str, b: str) -> bool:
    return _bare(a) == _bare(b)


def _bytes(version: ObjectVersion) -> tuple[int, str]:
    return version.size, _bare(version.etag)


def _time(version: ObjectVersion) -> float:
    return version.last_modified.timestamp() if version.last_modified else 0.0
