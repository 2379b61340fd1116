"""Which committed directories under a prefix are s3ckpt's checkpoints, as the listing
and, where it cannot tell, a GET of the manifest say; and what a checkpoint occupies.

Every s3ckpt commit writes its metadata object just before its manifest: a committed
directory whose listing shows none may hold another tool's ``manifest.json``, which is
no checkpoint (:class:`~s3ckpt.errors.ForeignObjectError`), and is read to find out.
"""

from __future__ import annotations

from s3ckpt.catalog.scan import Group, child
from s3ckpt.config import S3URI
from s3ckpt.errors import CorruptCheckpointError, ForeignObjectError
from s3ckpt.format.manifest import Manifest
from s3ckpt.s3.loop import bounded
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import read_manifest


def extent(group: Group, manifest: Manifest | None) -> tuple[int, int]:
    """Objects and bytes of a checkpoint: the committed save's when the manifest was read,
    else what the listing saw."""
    if manifest is not None and group.manifest is not None:
        return len(manifest.all_keys()) + 1, manifest.total_bytes + group.manifest.size
    return len(group.objects) + (1 if group.committed else 0), group.bytes


# What reading a manifest for ``ls`` found: the manifest, why it is damaged (str), that it
# is not s3ckpt's, or None (no manifest, or it need not be read).
Read = Manifest | str | ForeignObjectError | None


def suspect(group: Group) -> bool:
    """A committed directory whose listing shows no metadata object: every s3ckpt commit
    writes one just before its manifest, so the manifest may be another tool's."""
    return group.suspect


async def maybe_manifest(
    store: ObjectStore, location: S3URI, group: Group, details: bool = True
) -> Read:
    """The manifest, None if there is none (or it is not needed: the listing saw every
    object, all of them s3ckpt's, and no details were asked for), why it is unreadable,
    or the error saying it is not s3ckpt's."""
    if not group.committed or not (details or group.shallow or suspect(group)):
        return None
    try:
        return await read_manifest(store, location)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as exc:
        return str(exc)
    except ForeignObjectError as exc:
        return exc


async def only_ours(
    store: ObjectStore, location: S3URI, groups: list[Group], foreign: list[str] | None = None
) -> list[Group]:
    """The committed ``groups`` whose manifest is s3ckpt's, as far as the listing and a
    GET of each suspect manifest (:func:`suspect`) tell: no other is a checkpoint. Why
    each other one is not s3ckpt's is appended to ``foreign``."""
    found = await bounded(
        [lambda g=g: maybe_manifest(store, child(location, g.name), g, False) for g in groups]
    )
    if foreign is not None:
        foreign += [str(m) for m in found if isinstance(m, ForeignObjectError)]
    return [g for g, m in zip(groups, found, strict=True) if not isinstance(m, ForeignObjectError)]
