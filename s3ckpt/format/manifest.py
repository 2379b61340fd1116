"""The manifest's schema: the JSON object written last, whose existence *is* the commit.

A checkpoint at ``s3://bucket/prefix`` exists if and only if ``prefix/manifest.json``
exists. It lists every data object of the save with its size and ETag, DCP's metadata
object with its size and CRC32C, and (format 2) every rank's index object with its size
and CRC32C, so tools without torch (the catalog, the CLI) can list, verify and clean up
checkpoints. The items themselves are in the index objects
(:mod:`s3ckpt.format.rank_index`): the manifest grows with ranks, not with items.
Format 1 listed every item here instead; it is still read (:attr:`Manifest.items`).
Writing the manifest, and the commit protocol around that, is :mod:`s3ckpt.transfer.commit`.

The schema is versioned; see ``docs/format.md``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from crc32c import crc32c

from s3ckpt._version import __version__
from s3ckpt.errors import CorruptCheckpointError, ForeignObjectError
from s3ckpt.format.layout import StoredItem, metadata_key

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "s3ckpt"
FORMAT_VERSION = 2
ITEMS_IN_MANIFEST = 1  # the last version that listed items in the manifest


@dataclass(frozen=True)
class ObjectEntry:
    key: str  # relative to the checkpoint prefix
    size: int
    etag: str
    rank: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ObjectEntry:
        """Parse one JSON object entry; unknown fields are ignored (``docs/format.md``)."""
        return cls(str(raw["key"]), int(raw["size"]), str(raw["etag"]), int(raw["rank"]))


@dataclass(frozen=True)
class IndexRef:
    """One rank's index object, as the manifest lists it (format 2)."""

    rank: int
    key: str  # relative to the checkpoint prefix
    size: int
    crc32c: int
    items: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> IndexRef:
        return cls(
            int(raw["rank"]),
            str(raw["key"]),
            int(raw["size"]),
            int(raw["crc32c"]),
            int(raw["items"]),
        )


@dataclass(frozen=True)
class ItemEntry:
    """One item in the manifest: which DCP item it is, and its :class:`StoredItem`.

    Where the bytes live and how to check them is one record, :class:`StoredItem`, the same
    one DCP's metadata pickles per item; the manifest adds what tools without torch need to
    show an item (its FQN, chunk, dtype and shape). In JSON the two are one flat object
    (``docs/format.md``); the stored item's ETag is its object's, listed once in ``objects``.
    """

    fqn: str
    chunk_offsets: tuple[int, ...]
    kind: str  # "tensor" or "bytes"
    dtype: str | None
    shape: tuple[int, ...] | None
    stored: StoredItem

    @property
    def label(self) -> str:
        """The FQN, plus the chunk's offsets when the tensor is sharded."""
        return f"{self.fqn}@{list(self.chunk_offsets)}" if any(self.chunk_offsets) else self.fqn

    def to_dict(self) -> dict[str, Any]:
        stored = self.stored
        return {
            "fqn": self.fqn,
            "chunk_offsets": list(self.chunk_offsets),
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
            "key": stored.key,
            "offset": stored.offset,
            "length": stored.length,
            "codec": stored.codec,
            "block_size": stored.block_size,
            "crc32c": list(stored.crc32c),
            "raw_length": stored.raw_length,
            "frames": list(stored.frames),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], etags: dict[str, str]) -> ItemEntry:
        """Parse one JSON item; unknown fields are ignored (``docs/format.md``)."""
        shape = raw.get("shape")
        stored = StoredItem(
            key=str(raw["key"]),
            offset=int(raw["offset"]),
            length=int(raw["length"]),
            crc32c=tuple(int(c) for c in raw["crc32c"]),
            block_size=int(raw["block_size"]),
            codec=str(raw["codec"]),
            etag=etags.get(str(raw["key"]), ""),
            raw_length=None if raw.get("raw_length") is None else int(raw["raw_length"]),
            frames=tuple(int(f) for f in raw.get("frames", ())),
        )
        return cls(
            fqn=str(raw["fqn"]),
            chunk_offsets=tuple(raw["chunk_offsets"]),
            kind=str(raw["kind"]),
            dtype=raw.get("dtype"),
            shape=tuple(shape) if shape is not None else None,
            stored=stored,
        )


@dataclass(frozen=True)
class Manifest:
    save_id: str
    world_size: int
    metadata_key: str
    metadata_size: int
    metadata_crc32c: int
    objects: tuple[ObjectEntry, ...]
    # Format 1: every item. Format 2 keeps items in the index objects; the catalog fills
    # this in after reading them (``s3ckpt.transfer.rank_index.with_items``), never the JSON.
    items: tuple[ItemEntry, ...]
    created: float = field(default_factory=time.time)
    torch_version: str = ""
    s3ckpt_version: str = ""
    version: int = FORMAT_VERSION
    indexes: tuple[IndexRef, ...] = ()

    @classmethod
    def of_save(
        cls,
        save_id: str,
        world_size: int,
        metadata: bytes,
        objects: tuple[ObjectEntry, ...],
        indexes: tuple[IndexRef, ...],
        torch_version: str,
    ) -> Manifest:
        """The manifest (this format) of save ``save_id``, whose DCP metadata object is
        ``metadata`` (stored under :func:`~s3ckpt.format.layout.metadata_key`), written by
        this s3ckpt on torch ``torch_version``."""
        return cls(
            save_id=save_id,
            world_size=world_size,
            metadata_key=metadata_key(save_id),
            metadata_size=len(metadata),
            metadata_crc32c=crc32c(metadata),
            objects=objects,
            items=(),
            indexes=indexes,
            torch_version=torch_version,
            s3ckpt_version=__version__,
        )

    @property
    def total_bytes(self) -> int:
        return (
            sum(o.size for o in self.objects)
            + sum(i.size for i in self.indexes)
            + self.metadata_size
        )

    @property
    def item_count(self) -> int:
        return sum(i.items for i in self.indexes) if self.indexes else len(self.items)

    @property
    def items_listed(self) -> bool:
        """Whether :attr:`items` is complete: always in format 1, in format 2 once the
        index objects have been read."""
        return self.version <= ITEMS_IN_MANIFEST or len(self.items) == self.item_count

    def all_keys(self) -> list[str]:
        """Every object key of this checkpoint, relative to its prefix, manifest excluded."""
        return [o.key for o in self.objects] + [i.key for i in self.indexes] + [self.metadata_key]

    def etags(self) -> dict[str, str]:
        return {o.key: o.etag for o in self.objects}

    def to_json(self) -> bytes:
        """The manifest object; format 2 lists no items (they are in the index objects)."""
        body = {
            "format": FORMAT_NAME,
            **asdict(replace(self, items=(), indexes=())),
            "total_bytes": self.total_bytes,
        }
        if self.version <= ITEMS_IN_MANIFEST:
            body["items"] = [item.to_dict() for item in self.items]
            del body["indexes"]
        else:
            del body["items"]
            body["indexes"] = [asdict(i) for i in self.indexes]
        return sealed(json.dumps(body, separators=(",", ":")).encode())

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse a manifest object. :class:`ForeignObjectError` at once for a body that
        is not s3ckpt's (:func:`s3ckpt_body`); :class:`CorruptCheckpointError` for one
        that is, damaged (a checksum mismatch, a field missing), which is worth a re-read."""
        raw = s3ckpt_body(data, where)
        try:
            if int(raw["version"]) > FORMAT_VERSION:
                raise ValueError(
                    f"format version {raw['version']} is newer than this s3ckpt supports ({FORMAT_VERSION})"
                )
            objects = tuple(ObjectEntry.from_dict(o) for o in raw["objects"])
            etags = {o.key: o.etag for o in objects}
            version = int(raw["version"])
            listed = raw["items"] if version <= ITEMS_IN_MANIFEST else ()
            return cls(
                save_id=str(raw["save_id"]),
                world_size=int(raw["world_size"]),
                metadata_key=str(raw["metadata_key"]),
                metadata_size=int(raw["metadata_size"]),
                metadata_crc32c=int(raw["metadata_crc32c"]),
                objects=objects,
                items=tuple(ItemEntry.from_dict(i, etags) for i in listed),
                created=float(raw["created"]),
                torch_version=str(raw.get("torch_version", "")),
                s3ckpt_version=str(raw.get("s3ckpt_version", "")),
                version=version,
                indexes=tuple(IndexRef.from_dict(i) for i in raw.get("indexes", ())),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"unreadable manifest {where}: {exc}") from exc


# A manifest carries the CRC32C of its own bytes as its first member, ahead of the body it
# covers (``{"manifest_crc32c":N,`` + the body after its ``{``), so a reader checks it
# before parsing a byte and a flipped byte anywhere is caught. Manifests written before
# it start with the body itself; readers of those releases ignore the extra member.
_SEAL = b'{"manifest_crc32c":'
_UNSEALED_START = b'{"format":'


def sealed(body: bytes) -> bytes:
    """``body`` (a JSON object starting ``{"format":``) with its CRC32C in front."""
    return b"%s%d,%s" % (_SEAL, crc32c(body), body[1:])


def unsealed(data: bytes, where: str) -> bytes:
    """The body of a manifest object, its checksum checked (:func:`sealed`)."""
    if not data.startswith(_SEAL):
        if data.startswith(_UNSEALED_START):  # written by 0.1.0
            return data
        raise CorruptCheckpointError(f"unreadable manifest {where}: not an s3ckpt manifest")
    end = data.find(b",", len(_SEAL))
    claimed = data[len(_SEAL) : end]
    body = b"{" + data[end + 1 :]
    if end < 0 or not claimed.isdigit() or crc32c(body) != int(claimed):
        raise CorruptCheckpointError(f"checksum mismatch in manifest {where}")
    return body


def s3ckpt_body(data: bytes, where: str) -> dict[str, Any]:
    """The JSON object of a manifest that is s3ckpt's, its checksum checked when sealed.

    s3ckpt's manifests are sealed (:func:`sealed`) or, written by 0.1.0, start with
    ``{"format":"s3ckpt"``; both carry ``"format": "s3ckpt"`` and a ``version``. Any other
    body (not JSON, JSON without those fields, another tool's manifest) raises
    :class:`ForeignObjectError` naming ``where`` at once: it is not a checkpoint, and
    reading it again would not make it one. A sealed body that fails its checksum, a 0.1.0
    one cut short, or one whose opening is s3ckpt's but for one byte (damage in transit)
    short, raises :class:`CorruptCheckpointError`.
    """
    ours = data.startswith(_SEAL) or data.startswith(_UNSEALED_OURS)
    if not ours and (_one_off(data, _SEAL) or _one_off(data, _UNSEALED_OURS)):
        raise CorruptCheckpointError(f"unreadable manifest {where}: a byte of its opening is wrong")
    body = unsealed(data, where) if data.startswith(_SEAL) else data
    try:
        raw = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError included
        if ours:
            raise CorruptCheckpointError(f"unreadable manifest {where}: {exc}") from exc
        raise ForeignObjectError(_foreign(where, "not JSON")) from None
    if not isinstance(raw, dict):
        raise ForeignObjectError(_foreign(where, f"a JSON {type(raw).__name__}, not an object"))
    found = raw.get("format")
    if found is not None and found != FORMAT_NAME:
        raise ForeignObjectError(_foreign(where, f'JSON of another format, "format": {found!r}'))
    if found is None or "version" not in raw:
        raise ForeignObjectError(_foreign(where, 'JSON without s3ckpt\'s "format" and "version"'))
    return raw


_UNSEALED_OURS = _UNSEALED_START + b'"' + FORMAT_NAME.encode() + b'"'


def check_s3ckpt(data: bytes, where: str) -> None:
    """Raise :class:`ForeignObjectError` naming ``where`` if the manifest object ``data``
    is not s3ckpt's (:func:`s3ckpt_body`); return for one that is, intact or damaged.

    Every manifest s3ckpt writes opens with its seal (0.1.0's with ``{"format":"s3ckpt"``),
    which decides without parsing the body; only another opening is parsed."""
    if data.startswith((_SEAL, _UNSEALED_OURS)):
        return
    try:
        s3ckpt_body(data, where)
    except CorruptCheckpointError:  # s3ckpt's, damaged
        return


def _one_off(data: bytes, opening: bytes) -> bool:
    """Whether ``data`` opens with ``opening`` but for one byte: an s3ckpt manifest
    damaged in transit, to be read again, not taken for another tool's."""
    head = data[: len(opening)]
    if len(head) != len(opening):
        return False
    return sum(a != b for a, b in zip(head, opening, strict=True)) == 1


def _foreign(where: str, why: str) -> str:
    return f"{where} is not s3ckpt's ({why}): not a checkpoint; s3ckpt leaves it alone"


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]
