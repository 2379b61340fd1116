"""``S3StorageReader``: DCP's StorageReader for checkpoints written by S3StorageWriter.

Lifecycle of a load (the order DCP calls in):

0. ``reset(checkpoint_id)`` (all ranks, when ``checkpoint_id`` is passed to ``dcp.load``).
1. ``read_metadata()`` (all ranks): reads the manifest (no manifest, no checkpoint:
   :class:`~s3ckpt.errors.CheckpointNotFoundError`), then DCP's metadata object it names,
   checked against the manifest's size and CRC32C and unpickled with a restricted
   unpickler (:mod:`s3ckpt.dcp_metadata`).
2. ``set_up_storage_reader(metadata, is_coordinator)`` (all ranks).
3. ``prepare_local_plan`` / ``prepare_global_plan``: unchanged; DCP's planner decides which
   stored chunks (or parts of chunks, when resharding) each rank needs.
4. ``read_data(plan, planner)`` (all ranks): turns every read item into a byte range,
   widened to whole checksum blocks, and fetches all of them with coalesced parallel
   ranged GETs (:mod:`s3ckpt.download`). Bytes go straight into the destination tensor
   when it is a contiguous CPU tensor of the stored shape; otherwise into a scratch buffer
   that is then copied (narrowed, moved to the device). Every block is verified against
   its CRC32C before the item is committed; a mismatch raises
   :class:`~s3ckpt.errors.CorruptCheckpointError` naming the object and the item.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from s3ckpt import dcp_metadata
from s3ckpt.checksums import StreamingCheck, verify_blocks
from s3ckpt.codec import byte_buffer, tensor_from_bytes, tensor_view
from s3ckpt.compat import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    ReadItem,
    StorageMeta,
    StorageReader,
    chunk_shapes,
    narrow,
)
from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.download import RangeReader, ReadTarget
from s3ckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from s3ckpt.layout import StoredItem
from s3ckpt.loop import io_loop
from s3ckpt.manifest import Manifest, read_manifest
from s3ckpt.store import ObjectStore


@dataclass(eq=False)
class _PendingRead:
    """One read item on its way: where its bytes land and how to finish it."""

    request: ReadItem
    stored: StoredItem
    span: tuple[int, int]  # block-aligned byte range of the item that is fetched
    wanted: tuple[int, int] | None  # contiguous sub-range needed, None: the whole chunk
    buffer: torch.Tensor  # uint8, receives the span
    destination: torch.Tensor | None  # None for BYTE_IO
    direct: bool  # buffer aliases the destination: nothing to copy
    view: memoryview = field(init=False)  # the buffer's bytes
    check: StreamingCheck = field(init=False)  # CRC32Cs computed as the bytes arrive

    def __post_init__(self) -> None:
        self.view = tensor_view(self.buffer)
        first, last = self.span
        block_size = self.stored.block_size
        self.check = StreamingCheck(
            self.stored.crc32c, block_size, first // block_size, last - first
        )


class S3StorageReader(StorageReader):
    """Load DCP checkpoints from ``s3://bucket/prefix``.

    Args:
        checkpoint_id: the location; may instead be passed to ``dcp.load(..., checkpoint_id=...)``.
        endpoint_url: the S3 endpoint.
        config: an :class:`~s3ckpt.config.S3Config`; keyword ``options`` override its fields.
        request_size: the largest ranged GET; larger ranges are split and fetched in parallel.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str] | None = None,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        request_size: int = 16 * 1024 * 1024,
        **options: Any,
    ) -> None:
        super().__init__()
        self.config = make_config(config, endpoint_url=endpoint_url, **options)
        self.location: S3URI | None = (
            S3URI.parse(checkpoint_id) if checkpoint_id is not None else None
        )
        self.request_size = request_size
        self.manifest: Manifest | None = None
        self.storage_data: dict[MetadataIndex, StoredItem] = {}
        self._shapes: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}

    def __repr__(self) -> str:
        return f"S3StorageReader({str(self.location)!r}, endpoint_url={self.config.endpoint_url!r})"

    # -- DCP lifecycle --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.location = S3URI.parse(checkpoint_id)
        self.manifest = None
        self.storage_data = {}

    def read_metadata(self) -> Metadata:
        location = self._require_location()
        manifest, body = io_loop().run(self._fetch_metadata(location))
        where = f"{location}/{manifest.metadata_key}"
        if len(body) != manifest.metadata_size:
            raise CorruptCheckpointError(
                f"{where} has {len(body)} bytes, the manifest says {manifest.metadata_size}"
            )
        verify_blocks(
            memoryview(body),
            (manifest.metadata_crc32c,),
            block_size=max(len(body), 1),
            first_block=0,
            what=where,
        )
        metadata = dcp_metadata.loads(body, where)
        self.manifest = manifest
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = manifest.save_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(
                f"checkpoint metadata at {self.location} has no storage data"
            )
        self.storage_data = metadata.storage_data
        self._shapes = chunk_shapes(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        location = self._require_location()
        pending = [self._prepare(request, planner) for request in plan.items]
        targets = [
            ReadTarget(
                location.key(p.stored.key),
                p.stored.offset + p.span[0],
                p.stored.offset + p.span[1],
                p.view,
                p,
                p.check,
            )
            for p in pending
        ]
        store = ObjectStore(self.config, location.bucket)
        for token in RangeReader(store, max_request_size=self.request_size).fetch(targets):
            self._finish(token, planner)  # type: ignore[arg-type]
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str | None:
        return str(self.location) if self.location else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith("s3://")

    # -- helpers ---------------------------------------------------------------------------

    def _require_location(self) -> S3URI:
        if self.location is None:
            raise ConfigError(
                "no checkpoint location: pass s3://bucket/prefix to S3StorageReader or dcp.load"
            )
        return self.location

    async def _fetch_metadata(self, location: S3URI) -> tuple[Manifest, bytes]:
        store = ObjectStore(self.config, location.bucket)
        try:
            manifest = await read_manifest(store, location)
        except FileNotFoundError as exc:
            await store.head_bucket()  # a missing bucket deserves its own error
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {location} (no manifest)"
            ) from exc
        try:
            body = await store.get(location.key(manifest.metadata_key))
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"{location} is committed but its metadata object is missing"
            ) from exc
        return manifest, body

    def _prepare(self, request: ReadItem, planner: LoadPlanner) -> _PendingRead:
        stored = self.storage_data[request.storage_index]
        if request.type == LoadItemType.BYTE_IO:
            return _PendingRead(
                request, stored, (0, stored.length), None, byte_buffer(stored.length), None, False
            )
        dtype, shape = self._shapes[request.storage_index]
        wanted = _contiguous_range(shape, request.storage_offsets, request.lengths, dtype.itemsize)
        first, last = stored.block_span(*(wanted or (0, stored.length)))
        destination = planner.resolve_tensor(request).detach()
        direct = (
            wanted == (0, stored.length)
            or (wanted is None and tuple(request.lengths) == tuple(shape))
        ) and _can_receive(destination, dtype, stored.length)
        buffer = _as_bytes_tensor(destination) if direct else byte_buffer(last - first)
        return _PendingRead(request, stored, (first, last), wanted, buffer, destination, direct)

    def _finish(self, pending: _PendingRead, planner: LoadPlanner) -> None:
        stored, request, check = pending.stored, pending.request, pending.check
        what = f"{self.location}/{stored.key} item {request.storage_index.fqn!r}"
        if not check.active:
            verify_blocks(
                pending.view,
                stored.crc32c,
                block_size=stored.block_size,
                first_block=check.first_block,
                what=what,
            )
        elif check.bad_block is not None:
            raise CorruptCheckpointError(f"checksum mismatch in {what} (block {check.bad_block})")
        if pending.destination is None:
            planner.load_bytes(request, io.BytesIO(pending.view.tobytes()))
            return
        if not pending.direct:
            pending.destination.copy_(self._source(pending))
        planner.commit_tensor(request, pending.destination)

    def _source(self, pending: _PendingRead) -> torch.Tensor:
        dtype, shape = self._shapes[pending.request.storage_index]
        first = pending.span[0]
        if pending.wanted is not None:
            start, end = pending.wanted
            return tensor_from_bytes(
                pending.buffer[start - first : end - first], dtype, tuple(pending.request.lengths)
            )
        chunk = tensor_from_bytes(pending.buffer, dtype, shape)
        return narrow(chunk, pending.request.storage_offsets, pending.request.lengths)


def _contiguous_range(
    shape: torch.Size, offsets: torch.Size, lengths: torch.Size, itemsize: int
) -> tuple[int, int] | None:
    """Byte range of the region ``offsets``/``lengths`` in a C-contiguous chunk, if it is one range."""
    ndim = len(shape)
    if ndim == 0:
        return (0, itemsize)
    d = ndim - 1
    while d >= 0 and offsets[d] == 0 and lengths[d] == shape[d]:
        d -= 1
    if any(lengths[i] != 1 for i in range(d)):
        return None
    strides = [1] * ndim
    for i in range(ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    numel = 1
    for n in lengths:
        numel *= n
    start = sum(o * s for o, s in zip(offsets, strides, strict=True)) * itemsize
    return (start, start + numel * itemsize)


def _can_receive(destination: torch.Tensor, dtype: torch.dtype, nbytes: int) -> bool:
    return (
        destination.device.type == "cpu"
        and destination.dtype == dtype
        and destination.is_contiguous()
        and destination.numel() * destination.element_size() == nbytes
        and not destination.is_conj()
        and not destination.is_neg()
    )


def _as_bytes_tensor(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
