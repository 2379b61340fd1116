"""Aborting multipart uploads a save left open: the last step of every failed save.

A save that fails aborts the uploads it created, by their ids
(:meth:`~s3ckpt.transfer.upload.RankUploader`'s clean-up); an upload whose
CreateMultipartUpload answer never came is found by listing its key. When the process
that ran the save died, nobody is left in it to do so: its trainer aborts that rank's
uploads under the checkpoint instead (:func:`abort_rank_uploads`). Every abort runs
whatever the others did; what failed is reported at the end, for ``gc``.
"""

from __future__ import annotations

from s3ckpt.format.layout import is_rank_data
from s3ckpt.s3.loop import settled
from s3ckpt.s3.store import ObjectStore

CLEAN_UP_REQUESTS = 16  # aborts of one failed rank's uploads in flight at once


class CleanUpIncomplete(Exception):
    """What a clean-up after a failed save could not remove (``gc`` removes it later)."""


async def abort_upload(store: ObjectStore, key: str, upload_id: str) -> None:
    try:
        await store.abort_multipart(key, upload_id)
    except Exception as exc:
        raise CleanUpIncomplete(f"upload {upload_id} of {key} not aborted: {exc}") from exc


async def abort_listed_uploads(store: ObjectStore, key: str) -> None:
    """Abort the uploads of ``key`` a lost CreateMultipartUpload response left unknown."""
    try:
        found = [p.upload_id async for p in store.list_multipart_uploads(key) if p.key == key]
    except Exception as exc:
        raise CleanUpIncomplete(f"uploads of {key} not listed: {exc}") from exc
    for upload_id in found:
        await abort_upload(store, key, upload_id)


async def abort_rank_uploads(store: ObjectStore, prefix: str, rank: int) -> int:
    """Abort every open multipart upload of rank ``rank``'s data objects under ``prefix``
    (a checkpoint's keys, ``.../step-N/``); returns how many were aborted."""
    found = [
        upload
        async for upload in store.list_multipart_uploads(prefix)
        if is_rank_data(upload.key[len(prefix) :], rank)
    ]
    aborts = [lambda u=u: abort_upload(store, u.key, u.upload_id) for u in found]
    failures = [r for r in await settled(aborts, CLEAN_UP_REQUESTS) if isinstance(r, Exception)]
    if failures:
        raise CleanUpIncomplete("; ".join(str(f) for f in failures))
    return len(found)
