"""``s3ckpt import``: an existing checkpoint saved as an s3ckpt checkpoint.

Three local sources are recognised by their contents, not their names:

* a DCP checkpoint folder (``FileSystemWriter``'s, with its ``.metadata``), read through
  DCP's ``FileSystemReader`` (every item: tensors whole, whatever world size wrote it,
  and the non-tensor items);
* safetensors: one file, a folder of ``*.safetensors`` shards, or their
  ``model.safetensors.index.json``;
* a ``torch.save`` file of a (nested) dict of tensors and plain values, read with
  ``weights_only`` (never unpickling arbitrary objects) and memory-mapped.

The state is then written by ``dcp.save`` through
:class:`~s3ckpt.dcp.writer.S3StorageWriter`, so the import is committed atomically like any
save and loads with ``dcp.load``. Saving needs the whole state at once: an import holds the
checkpoint in memory (the torch file and the safetensors shards stay memory-mapped files).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file

from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.dcp.compat import CheckpointException, single_process, unwrap
from s3ckpt.dcp.consolidate import load_all, read_contents
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import NotACheckpointError
from s3ckpt.interop.formats import INDEX_NAME
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.commit import committed_save_id

DCP_METADATA = ".metadata"
_SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024  # what safetensors itself accepts


@dataclass
class ImportReport:
    """What an import saved; ``format``: ``dcp``, ``safetensors`` or ``torch``."""

    source: str
    destination: str
    format: str
    tensors: int
    bytes: int
    others: int


def import_checkpoint(
    source: str | os.PathLike[str],
    destination: str | S3URI,
    *,
    overwrite: bool = False,
    config: S3Config | None = None,
    **options: Any,
) -> ImportReport:
    """Save the checkpoint at local path ``source`` as an s3ckpt checkpoint at ``destination``.

    Raises :class:`~s3ckpt.errors.NotACheckpointError` if ``source`` is none of the
    formats above, :class:`~s3ckpt.errors.CheckpointExistsError` if ``destination`` is
    committed and ``overwrite`` is not set, :class:`~s3ckpt.errors.ForeignObjectError`
    (nothing written) if the ``manifest.json`` there is not s3ckpt's.
    """
    path = Path(source)
    location = destination if isinstance(destination, S3URI) else S3URI.parse(destination)
    kind, state = read_source(path)
    s3 = make_config(config, **options)
    if overwrite:  # the save replaces the manifest there: ForeignObjectError if not s3ckpt's
        io_loop().run(committed_save_id(ObjectStore(s3, location.bucket), location))
    writer = S3StorageWriter(str(location), config=s3, overwrite=overwrite)
    try:
        with single_process():
            dcp.save(state, storage_writer=writer, no_dist=True)
    except CheckpointException as exc:
        inner = unwrap(exc)
        if inner is exc:
            raise
        raise inner from exc
    tensors = [v for v in _leaves(state) if isinstance(v, torch.Tensor)]
    return ImportReport(
        str(path),
        str(location),
        kind,
        len(tensors),
        sum(t.nbytes for t in tensors),
        sum(1 for v in _leaves(state) if not isinstance(v, torch.Tensor)),
    )


def read_source(path: Path) -> tuple[str, dict[str, Any]]:
    """The format of ``path`` and the state it holds (module docstring)."""
    if not path.exists():
        raise NotACheckpointError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / DCP_METADATA).is_file():
            return "dcp", _read_dcp(path)
        shards = _safetensors_in(path)
        if shards:
            return "safetensors", _read_safetensors(shards)
        raise NotACheckpointError(
            f"{path} is not a checkpoint folder: it holds neither a DCP {DCP_METADATA} nor "
            "safetensors files"
        )
    if path.name.endswith(".json"):
        return "safetensors", _read_safetensors(_indexed_shards(path))
    if _is_safetensors(path):
        return "safetensors", _read_safetensors([path])
    return "torch", _read_torch(path)


def _read_dcp(path: Path) -> dict[str, Any]:
    def reader() -> dcp.FileSystemReader:
        return dcp.FileSystemReader(str(path))

    try:
        return load_all(reader, read_contents(reader()))
    except (CheckpointException, OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
        cause = unwrap(exc)
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise NotACheckpointError(
            f"{path}: DCP cannot read this checkpoint folder ({first})"
        ) from exc


def _safetensors_in(folder: Path) -> list[Path]:
    if (folder / INDEX_NAME).is_file():
        return _indexed_shards(folder / INDEX_NAME)
    return sorted(folder.glob("*.safetensors"))


def _indexed_shards(index: Path) -> list[Path]:
    """The shards a safetensors index maps tensors to."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise NotACheckpointError(f"{index} is not a safetensors index: {exc}") from exc
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise NotACheckpointError(f"{index} names shard(s) that are not there: {missing[:3]}")
    return [index.parent / n for n in names]


def _is_safetensors(path: Path) -> bool:
    """Whether the file starts like safetensors: a plausible header length, then ``{``."""
    with path.open("rb") as handle:
        head = handle.read(9)
    if len(head) < 9:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 0 < length <= _SAFETENSORS_HEADER_LIMIT and head[8:9] == b"{"


def _read_safetensors(shards: list[Path]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for shard in shards:
        try:
            tensors = load_file(str(shard))
        except (SafetensorError, OSError, ValueError) as exc:
            raise NotACheckpointError(f"{shard} is not a readable safetensors file: {exc}") from exc
        clash = sorted(set(tensors) & set(state))
        if clash:
            raise NotACheckpointError(f"{shard} repeats tensor(s) of another shard: {clash[:3]}")
        state.update(tensors)
    return state


def _read_torch(path: Path) -> dict[str, Any]:
    zipped = zipfile.is_zipfile(path)
    with path.open("rb") as handle:
        pickled = handle.read(1) == b"\x80"  # torch's older format: a pickle
    if not zipped and not pickled:
        raise NotACheckpointError(
            f"{path} is not a DCP checkpoint folder, safetensors file(s) or torch.save file"
        )
    try:  # torch's older, non-zip format cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as exc:
        raise NotACheckpointError(
            f"{path}: torch.load refused it with weights_only=True (it holds objects other "
            "than tensors and plain values); s3ckpt imports state dicts only"
        ) from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise NotACheckpointError(f"{path} is not a readable torch.save file: {first}") from exc
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in _leaves(state)):
        raise NotACheckpointError(f"{path} holds no dict of tensors ({type(state).__name__})")
    return state


def _leaves(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in _leaves(value)]
    if isinstance(state, (list, tuple)):
        return [leaf for value in state for leaf in _leaves(value)]
    return [state]
