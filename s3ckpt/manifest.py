"""The manifest: the object written last, whose existence *is* the commit.

A checkpoint at ``s3://bucket/prefix`` exists if and only if ``prefix/manifest.json``
exists. Data objects and DCP's metadata are written first, under keys unique to the
save; the coordinator then writes the manifest, listing every object with its size and
ETag and every item with its location and checksums. Readers, listings and the CLI look
at manifests only, so a save that died half-way is invisible.

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

The schema is versioned; see ``docs/format.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from s3ckpt.config import S3URI
from s3ckpt.errors import (
    CommitConflictError,
    CorruptCheckpointError,
    PreconditionFailedError,
    StorageError,
)
from s3ckpt.store import ObjectStore

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "s3ckpt"
FORMAT_VERSION = 1
FALLBACK_SETTLE_S = 1.0


@dataclass(frozen=True)
class ObjectEntry:
    key: str  # relative to the checkpoint prefix
    size: int
    etag: str
    rank: int


@dataclass(frozen=True)
class ItemEntry:
    fqn: str
    chunk_offsets: tuple[int, ...]
    kind: str  # "tensor" or "bytes"
    dtype: str | None
    shape: tuple[int, ...] | None
    key: str
    offset: int
    length: int
    codec: str
    block_size: int
    crc32c: tuple[int, ...]
    raw_length: int | None = None  # decoded size of a compressed item
    frames: tuple[int, ...] = ()  # stored size of each block's frame, compressed items only

    @property
    def size(self) -> int:
        """The item's raw (decoded) size."""
        return self.length if self.raw_length is None else self.raw_length


@dataclass(frozen=True)
class Manifest:
    save_id: str
    world_size: int
    metadata_key: str
    metadata_size: int
    metadata_crc32c: int
    objects: tuple[ObjectEntry, ...]
    items: tuple[ItemEntry, ...]
    created: float = field(default_factory=time.time)
    torch_version: str = ""
    s3ckpt_version: str = ""
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects) + self.metadata_size

    def all_keys(self) -> list[str]:
        """Every object key of this checkpoint, relative to its prefix, manifest excluded."""
        return [o.key for o in self.objects] + [self.metadata_key]

    def to_json(self) -> bytes:
        body = {"format": FORMAT_NAME, **asdict(self), "total_bytes": self.total_bytes}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            raw: dict[str, Any] = json.loads(data)
            if raw.get("format") != FORMAT_NAME:
                raise ValueError("not an s3ckpt manifest")
            if int(raw["version"]) > FORMAT_VERSION:
                raise ValueError(
                    f"format version {raw['version']} is newer than this s3ckpt supports ({FORMAT_VERSION})"
                )
            return cls(
                save_id=str(raw["save_id"]),
                world_size=int(raw["world_size"]),
                metadata_key=str(raw["metadata_key"]),
                metadata_size=int(raw["metadata_size"]),
                metadata_crc32c=int(raw["metadata_crc32c"]),
                objects=tuple(ObjectEntry(**o) for o in raw["objects"]),
                items=tuple(_item(i) for i in raw["items"]),
                created=float(raw["created"]),
                torch_version=str(raw.get("torch_version", "")),
                s3ckpt_version=str(raw.get("s3ckpt_version", "")),
                version=int(raw["version"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"unreadable manifest {where}: {exc}") from exc


_ITEM_FIELDS = {f.name for f in fields(ItemEntry)}


def _item(raw: dict[str, Any]) -> ItemEntry:
    shape = raw.get("shape")
    return ItemEntry(
        **{
            **{k: v for k, v in raw.items() if k in _ITEM_FIELDS},
            "chunk_offsets": tuple(raw["chunk_offsets"]),
            "shape": tuple(shape) if shape is not None else None,
            "crc32c": tuple(raw["crc32c"]),
            "frames": tuple(raw.get("frames", ())),
        }
    )


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


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


async def commit(
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
