"""Reading a committed manifest, and the commit: writing the manifest last.

Data objects and DCP's metadata are written first, under keys unique to the save; the
coordinator then writes the manifest (:mod:`s3ckpt.format.manifest`). Readers, listings
and the CLI look at manifests only, so a save that died half-way is invisible.

Commit modes:

* ``create`` (the default): ``PutObject`` with ``If-None-Match: *``; of two writers racing
  for the same id exactly one wins and the other gets :class:`CommitConflictError`.
  Endpoints that do not honor the header (probed once per endpoint and bucket) use the
  fallback: HEAD, PUT, wait ``FALLBACK_SETTLE_S`` (1 s), then read the manifest back and
  check that it carries our save id. Of writers whose PUTs land within that second of
  each other, only the last keeps its manifest and all others get the error; unlike the
  conditional write, the fallback cannot stop a loser from briefly replacing the
  winner's manifest, and it costs the pause on every commit.
* ``overwrite``: the new manifest replaces the old in one PUT (S3 PUTs are atomic), so
  every reader sees either the complete old checkpoint or the complete new one; the old
  save's objects are deleted only after the switch.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from s3ckpt.config import S3URI
from s3ckpt.errors import (
    CommitConflictError,
    CorruptCheckpointError,
    PreconditionFailedError,
    StorageError,
)
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest
from s3ckpt.s3.store import ObjectStore

log = logging.getLogger(__name__)

FALLBACK_SETTLE_S = 1.0


async def read_manifest(store: ObjectStore, location: S3URI) -> Manifest:
    """The committed manifest at ``location``; ``ObjectNotFoundError`` if none."""
    key = location.key(MANIFEST_NAME)
    return Manifest.from_json(await store.get(key), f"s3://{store.bucket}/{key}")


# -- conditional-write support ----------------------------------------------------------

_conditional_support: dict[tuple[str | None, str], bool] = {}


async def supports_conditional_create(store: ObjectStore, location: S3URI) -> bool:
    """Whether the endpoint honors ``If-None-Match: *`` (probed once, then cached)."""
    if store.config.conditional_commit is not None:
        return store.config.conditional_commit
    cache_key = (store.config.endpoint_url, store.bucket)
    if cache_key not in _conditional_support:
        _conditional_support[cache_key] = await _probe(store, location)
    return _conditional_support[cache_key]


async def _probe(store: ObjectStore, location: S3URI) -> bool:
    key = location.key(f".s3ckpt-probe-{uuid.uuid4().hex}")
    try:
        await store.put(key, b"1", mode="create")
        try:
            await store.put(key, b"2", mode="create")
        except PreconditionFailedError:
            return True
        except StorageError as exc:  # e.g. 501 NotImplemented: the header is not understood
            log.info("endpoint rejected If-None-Match (%s); using the fallback commit", exc.code)
            return False
        log.warning("endpoint ignores If-None-Match: *; using the check-put-verify fallback commit")
        return False
    except StorageError as exc:
        if exc.code in ("NotImplemented", "501", "InvalidRequest", "InvalidArgument"):
            return False
        raise
    finally:
        try:
            await store.delete_many([key])
        except StorageError as exc:
            log.warning("could not delete probe object %s: %s", key, exc)


async def commit_manifest(
    store: ObjectStore, location: S3URI, manifest: Manifest, *, overwrite: bool
) -> None:
    """Make the checkpoint visible by writing its manifest (see the module docstring)."""
    key = location.key(MANIFEST_NAME)
    body = manifest.to_json()
    if overwrite:
        await _commit_overwrite(store, location, manifest, body)
    elif await supports_conditional_create(store, location):
        try:
            await store.put(key, body, mode="create", content_type="application/json")
        except PreconditionFailedError as exc:
            raise CommitConflictError(
                f"another writer committed s3://{store.bucket}/{key} first"
            ) from exc
    else:
        await _commit_fallback(store, location, manifest, body)


async def _commit_fallback(
    store: ObjectStore, location: S3URI, manifest: Manifest, body: bytes
) -> None:
    key = location.key(MANIFEST_NAME)
    if await store.exists(key):
        raise CommitConflictError(f"another writer committed s3://{store.bucket}/{key} first")
    await store.put(key, body, content_type="application/json")
    # Two writers that both passed the HEAD put within moments of each other; the last PUT
    # wins. Reading back only after a pause lets every writer of such a race see the
    # winner, so the loser learns it lost even when its own PUT came and went first.
    await asyncio.sleep(FALLBACK_SETTLE_S)
    committed = await read_manifest(store, location)
    if committed.save_id != manifest.save_id:
        raise CommitConflictError(
            f"another writer committed s3://{store.bucket}/{key} at the same time"
        )


async def _commit_overwrite(
    store: ObjectStore, location: S3URI, manifest: Manifest, body: bytes
) -> None:
    try:
        previous: Manifest | None = await read_manifest(store, location)
    except FileNotFoundError:
        previous = None
    except CorruptCheckpointError:
        previous = None
    await store.put(location.key(MANIFEST_NAME), body, content_type="application/json")
    if previous is not None and previous.save_id != manifest.save_id:
        stale = set(previous.all_keys()) - set(manifest.all_keys())
        try:
            await store.delete_many(sorted(location.key(k) for k in stale))
        except StorageError as exc:
            log.warning(
                "overwrote %s but could not delete the previous save's objects: %s", location, exc
            )
