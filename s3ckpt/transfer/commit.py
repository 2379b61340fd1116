"""Reading a committed manifest, and the commit: writing the manifest last.

Data objects and DCP's metadata are written first, under keys unique to the save; the
coordinator then writes the manifest (:mod:`s3ckpt.format.manifest`). Readers, listings
and the CLI look at manifests only, so a save that died half-way is invisible.

Commit modes (``docs/format.md`` states the protocol and its assumptions):

* ``create`` on a store that honours ``If-None-Match: *`` (probed once per endpoint and
  bucket, and again when the bucket's versioning state changes:
  :func:`supports_conditional_create`): one conditional ``PutObject``; of writers racing
  for the same id exactly one wins, the others get :class:`CommitConflictError`.
* ``create`` on a store without conditional writes (it ignores the header, or rejects it):
  the *claim* protocol. A writer PUTs its own claim object (a key unique to its save),
  then LISTs the claims, then HEADs the manifest. Alone and no manifest: it PUTs the
  manifest and only then deletes its claim. Otherwise it deletes its claim and, if no
  manifest exists yet, backs off and tries again. Two writers can never both be alone:
  each one's claim is in place before it lists, so of any two, the one that listed later
  sees the other's claim, and a claim stays in place until its writer's manifest is
  written. This needs strong read-after-write and list-after-write consistency and no
  timing at all; delays anywhere only cost retries.
* ``overwrite``: the new manifest replaces the old in one PUT (S3 PUTs are atomic), so
  every reader sees either the complete old checkpoint or the complete new one. The old
  save's objects stay: ``gc`` removes them once they have been unreferenced for its grace
  period, so loads that started before the switch finish undisturbed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid

from s3ckpt.config import S3URI
from s3ckpt.errors import (
    CommitConflictError,
    CorruptCheckpointError,
    IncompleteSaveError,
    PreconditionFailedError,
    StorageError,
)
from s3ckpt.format.layout import CLAIM_PREFIX, claim_key
from s3ckpt.format.manifest import MANIFEST_NAME, Manifest, check_s3ckpt
from s3ckpt.s3.error_mapping import UNSUPPORTED_CODES
from s3ckpt.s3.loop import bounded
from s3ckpt.s3.store import ObjectMeta, ObjectStore
from s3ckpt.s3.versions import delete_every_version, versioning
from s3ckpt.transfer.checked import Rereads

log = logging.getLogger(__name__)

CLAIM_ROUNDS = 8  # attempts of the claim protocol before a contended commit gives up
CLAIM_BACKOFF_S = 0.2  # first backoff; doubles per round, with full jitter
CLAIM_MAX_AGE_S = 600.0  # a claim held longer than this (own clock) is given up, not used
PROBE_PREFIX = ".s3ckpt-probe-"  # a probe object's name: this, then hex digits
PROBE_NAME = PROBE_PREFIX + "0" * 32  # as long as the conditional-write probe's (a uuid4's hex)


async def read_manifest(store: ObjectStore, location: S3URI) -> Manifest:
    """The committed manifest at ``location``; ``ObjectNotFoundError`` if none. A body that
    fails its own checksum or does not parse is read again (:mod:`s3ckpt.transfer.checked`)."""
    key = location.key(MANIFEST_NAME)
    where = f"s3://{store.bucket}/{key}"
    tries = Rereads()
    while True:
        body = await store.get(key)
        try:
            return Manifest.from_json(body, where)
        except CorruptCheckpointError as exc:
            tries.reread_or_raise(exc)


async def manifest_exists(store: ObjectStore, location: S3URI) -> bool:
    """Whether a manifest is committed at ``location``, from one GET of it.

    A GET, not a HEAD: its body tells s3ckpt's manifest from another tool's
    ``manifest.json`` (:class:`~s3ckpt.errors.ForeignObjectError`, raised), and its error
    a missing bucket (:class:`~s3ckpt.errors.BucketNotFoundError`, raised) from a missing
    manifest (False), which a HEAD's bodiless 404 cannot. A damaged s3ckpt manifest is
    committed all the same (True): it is not read again (:func:`check_s3ckpt`)."""
    key = location.key(MANIFEST_NAME)
    try:
        body = await store.get(key)
    except FileNotFoundError:  # ObjectNotFoundError; a missing bucket is not one
        return False
    check_s3ckpt(body, f"s3://{store.bucket}/{key}")
    return True


async def confirm_objects(store: ObjectStore, location: S3URI, sizes: dict[str, int]) -> None:
    """Check, with one listing per folder of the save (concurrently), that every object of
    a save exists with its size.

    ``sizes`` maps keys relative to ``location`` to their sizes. Anything missing means
    something deleted part of the save (``gc`` with too short a grace, a lifecycle rule):
    committing would publish a checkpoint that cannot load. ``data/`` and ``index/`` are
    listed side by side: at thousands of ranks each is several pages.
    """
    # A key's folder is its first segment ("data/", "index/"), or "" at the checkpoint's
    # own level, which is listed without descending into the folders.
    folders = sorted({key.split("/", 1)[0] + "/" if "/" in key else "" for key in sizes})

    async def listed(folder: str) -> dict[str, int]:
        if not folder:
            return {
                m.key: m.size
                async for m in store.list_level(location.key(""))
                if isinstance(m, ObjectMeta)
            }
        return {m.key: m.size async for m in store.list(location.key(folder))}

    found: dict[str, int] = {}
    for part in await bounded([lambda f=f: listed(f) for f in folders]):
        found.update(part)
    wrong = [
        f"{key} ({'missing' if location.key(key) not in found else 'wrong size'})"
        for key, size in sorted(sizes.items())
        if found.get(location.key(key)) != size
    ]
    if wrong:
        raise IncompleteSaveError(
            f"not committing {location}: {len(wrong)} object(s) of the save are gone or "
            f"changed: {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}"
        )


async def committed_save_id(store: ObjectStore, location: S3URI) -> str | None:
    """The save id the committed manifest names; None if nothing is committed."""
    try:
        return (await read_manifest(store, location)).save_id
    except FileNotFoundError:
        return None


# -- conditional-write support ----------------------------------------------------------

# (endpoint, bucket) -> (the bucket's versioning state when probed, whether honoured)
_conditional_support: dict[tuple[str | None, str], tuple[str, bool]] = {}


async def supports_conditional_create(store: ObjectStore, location: S3URI) -> bool:
    """Whether the endpoint honours ``If-None-Match: *`` now.

    Probed once per endpoint and bucket, and again whenever the bucket's versioning state
    differs from the one the probe ran under: a store may honour the header on a bucket
    without versioning and ignore it with versioning on (Ceph RGW does). So each call
    costs one ``GetBucketVersioning``, whatever the save's size; a store that refuses it
    (a policy without ``s3:GetBucketVersioning``) is probed at every call instead (three
    small requests). What remains is a switch between that request and the commit's PUT
    (``docs/compatibility.md``, "Versioned buckets")."""
    if store.config.conditional_commit is not None:
        return store.config.conditional_commit
    state = await _versioning_or_unknown(store)
    cache_key = (store.config.endpoint_url, store.bucket)
    known = _conditional_support.get(cache_key)
    if known is not None and known[0] == state and state != "unknown":
        return known[1]
    if known is not None and known[0] != state:
        log.warning(
            "versioning of s3://%s is %s, was %s when conditional writes were probed: "
            "probing again",
            store.bucket,
            state,
            known[0],
        )
    honoured = await _probe(store, location, versioned=state in ("Enabled", "Suspended"))
    _conditional_support[cache_key] = (state, honoured)
    return honoured


async def _versioning_or_unknown(store: ObjectStore) -> str:
    try:
        return await versioning(store)
    except StorageError as exc:
        log.info("cannot read the versioning of s3://%s (%s): probing", store.bucket, exc.code)
        return "unknown"


async def _probe(store: ObjectStore, location: S3URI, *, versioned: bool = False) -> bool:
    key = location.key(PROBE_PREFIX + uuid.uuid4().hex)
    try:
        await store.put(key, b"1", mode="create")
        try:
            await store.put(key, b"2", mode="create")
        except PreconditionFailedError:
            return True
        except StorageError as exc:  # e.g. 501 NotImplemented: the header is not understood
            log.info("endpoint rejected If-None-Match (%s); commits use claims instead", exc.code)
            return False
        log.warning("endpoint ignores If-None-Match: *; commits use claims instead")
        return False
    except StorageError as exc:
        if exc.code in UNSUPPORTED_CODES:
            return False
        raise
    finally:
        await _remove_probe(store, key, versioned)


async def _remove_probe(store: ObjectStore, key: str, versioned: bool) -> None:
    """Delete the probe object; on a versioned bucket each of its versions by id, which a
    plain delete would keep (all are the probe's: the name is its own)."""
    try:
        await (delete_every_version(store, key) if versioned else store.delete_many([key]))
    except StorageError as exc:
        log.warning("could not delete probe object %s: %s", key, exc)


async def commit_manifest(
    store: ObjectStore, location: S3URI, manifest: Manifest, *, overwrite: bool
) -> None:
    """Make the checkpoint visible by writing its manifest (see the module docstring)."""
    body = manifest.to_json()
    if overwrite:
        await _put_manifest(store, location, body)
    elif await supports_conditional_create(store, location):
        await _commit_conditional(store, location, body)
    else:
        await _commit_with_claim(store, location, manifest.save_id, body)


async def _put_manifest(store: ObjectStore, location: S3URI, body: bytes, **mode: str) -> None:
    await store.put(location.key(MANIFEST_NAME), body, content_type="application/json", **mode)


async def _commit_conditional(store: ObjectStore, location: S3URI, body: bytes) -> None:
    try:
        await _put_manifest(store, location, body, mode="create")
    except PreconditionFailedError as exc:
        raise _lost(store, location) from exc


def _lost(store: ObjectStore, location: S3URI) -> CommitConflictError:
    key = location.key(MANIFEST_NAME)
    return CommitConflictError(f"another writer committed s3://{store.bucket}/{key} first")


async def _commit_with_claim(
    store: ObjectStore, location: S3URI, save_id: str, body: bytes
) -> None:
    """The claim protocol (module docstring): commit once alone, else back off and retry."""
    rivals: list[str] = []
    for attempt in range(CLAIM_ROUNDS):
        rivals = await _claim_and_commit(store, location, save_id, body)
        if not rivals:
            return
        delay = random.uniform(0, CLAIM_BACKOFF_S * 2**attempt)
        log.info("commit of %s contended by %s; retrying in %.2f s", location, rivals, delay)
        await asyncio.sleep(delay)
    raise CommitConflictError(
        f"could not commit {location}: other saves kept claiming it ({', '.join(rivals)}); "
        "a claim left by a save that died is removed by `s3ckpt gc`"
    )


async def _claim_and_commit(
    store: ObjectStore, location: S3URI, save_id: str, body: bytes
) -> list[str]:
    """One round: the rival claims seen (empty: committed). Raises if a manifest exists."""
    claim = location.key(claim_key(save_id))
    claimed_at = time.monotonic()
    await store.put(claim, save_id.encode())
    try:
        listing = store.list(location.key(CLAIM_PREFIX))
        rivals = [m.key.rpartition(CLAIM_PREFIX)[2] async for m in listing if m.key != claim]
        if await store.exists(location.key(MANIFEST_NAME)):
            raise _lost(store, location)
        if rivals:
            return rivals
        # gc removes claims older than its grace (at least an hour): one held for longer
        # could have been removed, so it no longer excludes anyone.
        if time.monotonic() - claimed_at > CLAIM_MAX_AGE_S:
            raise CommitConflictError(f"commit of {location} stalled while holding its claim")
        await _put_manifest(store, location, body)
        return []
    finally:
        await _release(store, claim)


async def _release(store: ObjectStore, claim: str) -> None:
    try:
        await store.delete_many([claim])
    except StorageError as exc:  # it blocks other commits until gc removes it
        log.warning("could not delete commit claim %s: %s", claim, exc)
