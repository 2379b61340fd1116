"""Megatron's own small files on S3: what its Multi-Storage Client hook sees.

Megatron-core reads and writes a few files itself, beside the tensors a strategy saves:
``common.pt`` (rank 0's non-sharded state, ``torch.save``), ``metadata.json`` (the
backend a checkpoint was saved with, written after the save) and, in Megatron-LM's
training loop, ``latest_checkpointed_iteration.txt`` (the tracker naming the step to
resume from, written after the save). With the MSC feature enabled it does so through
the module bound to ``megatron.core.msc_utils.msc``; :class:`S3Files` is bound there
(:func:`s3ckpt.integrations.megatron.compat.install_files`) and stores them thus:

* ``<checkpoint>/common.pt`` and ``<checkpoint>/metadata.json`` are items of the s3ckpt
  checkpoint itself (:func:`member_key`), committed by its manifest with the
  tensors: rank 0's ``torch.save`` of the common state is held here until the save
  strategy (same process, next call of ``dist_checkpointing.save``) takes it into the
  save (:meth:`S3Files.take_pending`); the strategy writes ``metadata.json`` itself, and
  Megatron's own write of it after the commit only checks that the committed bytes are
  the same. Read back (every rank's ``load_common``, ``maybe_load_config``) from the
  committed checkpoint: a checkpoint without a manifest has none of its files.
* ``<run>/latest_checkpointed_iteration.txt`` is a plain object, written when the file is
  closed and only if the step it names is committed (``iter_NNNNNNN/manifest.json``, or
  ``release/``): the tracker never points at a save that did not commit.
* Directories need no creating; a checkpoint directory exists once it is committed.

Nothing of an ``s3://`` path reaches the local file system; another ``s3://`` file
raises :class:`~s3ckpt.errors.ConfigError`. Every other path goes to what Megatron had
bound before (the real ``multistorageclient``, where it was enabled) or to the local
file system, as without s3ckpt. ``msc.torch.MultiStorageFileSystemReader`` (what
Megatron's torch_dist load strategy reads ``s3://`` checkpoints with) gives an
:class:`~s3ckpt.S3StorageReader`.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import pathlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from s3ckpt.config import S3URI, S3Config
from s3ckpt.dcp.compat import Metadata, single_process
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.errors import CheckpointNotFoundError, ConfigError
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore

log = logging.getLogger(__name__)

# The DCP item of a Megatron file inside a checkpoint is named as Megatron names a
# ShardedObject's (``<key>/shard_<offset>_<shape>``), so that Megatron's own listing of a
# checkpoint's objects parses it.
MEMBER_PREFIX = "__megatron_file__."
MEMBER_SUFFIX = "/shard_0_1"
COMMON = "common.pt"
CONFIG = "metadata.json"
MEMBERS = (COMMON, CONFIG)
TRACKER = "latest_checkpointed_iteration.txt"


def is_s3(path: Any) -> bool:
    """Whether ``path`` is an ``s3://`` location (also as ``s3:/``, what pathlib makes of it)."""
    return isinstance(path, str | os.PathLike) and os.fspath(path).startswith("s3:/")


def s3_uri(path: Any) -> S3URI:
    text = os.fspath(path)
    if not text.startswith("s3://"):
        text = "s3://" + text[len("s3:/") :]
    return S3URI.parse(text.rstrip("/"))


def parent_of(uri: S3URI) -> S3URI:
    return S3URI(uri.bucket, uri.prefix.rpartition("/")[0])


def member_key(name: str) -> str:
    return MEMBER_PREFIX + name + MEMBER_SUFFIX


def is_member_key(key: str) -> bool:
    return key.startswith(MEMBER_PREFIX)


def member_bytes(data: bytes) -> io.BytesIO:
    """A Megatron file as the DCP item that stores it: its bytes, ``torch.save``-d (DCP
    unpickles bytes items at load; ``bytes`` passes the weights-only check)."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    return buffer


def step_name(tracker_text: str) -> str:
    """The checkpoint directory a tracker's content names (Megatron-LM's naming)."""
    text = tracker_text.strip()
    if text == "release":
        return "release"
    try:
        return f"iter_{int(text):07d}"
    except ValueError:
        raise ConfigError(f"a tracker file names a step or 'release', got {text!r}") from None


class S3Files:
    """The module Megatron's MSC hook calls (``open``, ``Path``, ``os``, ``torch``)."""

    is_s3ckpt_files = True

    def __init__(self, config: S3Config, previous: Any, previous_enabled: bool) -> None:
        self.config = config
        self.previous = previous if previous_enabled else None
        self.previous_enabled = previous_enabled
        self.os = _Os(self)
        self.torch = _Torch(self)
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, bytes]] = {}
        self._load = threading.local()

    # -- what Megatron calls ---------------------------------------------------------------

    def open(self, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not is_s3(path):
            return (self.previous.open if self.previous else builtins.open)(
                path, mode, *args, **kwargs
            )
        uri = s3_uri(path)
        if any(flag in mode for flag in "wax+"):
            return _Upload(self, uri, binary="b" in mode)
        data = self.read(uri)
        return io.BytesIO(data) if "b" in mode else io.StringIO(data.decode())

    def Path(self, path: Any, *args: Any) -> Any:
        if not is_s3(path):
            return (self.previous.Path if self.previous else pathlib.Path)(path, *args)
        return S3Path(self, s3_uri(os.path.join(os.fspath(path), *map(os.fspath, args))))

    # -- the S3 side -------------------------------------------------------------------------

    def store(self, uri: S3URI) -> ObjectStore:
        return ObjectStore(self.config, uri.bucket)

    def read(self, uri: S3URI) -> bytes:
        """The bytes of an ``s3://`` file; ``FileNotFoundError`` when there is none."""
        name, parent = uri.prefix.rsplit("/", 1)[-1], parent_of(uri)
        if name in MEMBERS:
            data = self.read_member(parent, name)
            if data is None:
                raise FileNotFoundError(
                    f"{uri}: {parent} is not a committed checkpoint with {name}"
                )
            return data
        if name == TRACKER:
            return io_loop().run(self.store(uri).get(uri.prefix))
        raise self.unsupported(uri)

    def exists(self, uri: S3URI) -> bool:
        name, parent = uri.prefix.rsplit("/", 1)[-1], parent_of(uri)
        if name in MEMBERS:
            metadata = self.committed_metadata(parent)
            return metadata is not None and member_key(name) in metadata.state_dict_metadata
        if name == TRACKER:
            return io_loop().run(self.store(uri).exists(uri.prefix))
        return self.is_dir(uri)

    def is_dir(self, uri: S3URI) -> bool:
        """A committed checkpoint, or a run directory with a tracker."""
        store = self.store(uri)
        return io_loop().run(store.exists(uri.key(MANIFEST_NAME))) or io_loop().run(
            store.exists(uri.key(TRACKER))
        )

    def write(self, uri: S3URI, data: bytes) -> None:
        """An ``s3://`` file closed after writing (see the module's docstring)."""
        name, parent = uri.prefix.rsplit("/", 1)[-1], parent_of(uri)
        if name == COMMON:
            self.hold(parent, name, data)
        elif name == CONFIG:
            committed = self.read_member(parent, CONFIG)
            if committed != data:
                raise ConfigError(
                    f"{uri}: Megatron wrote {data!r} after the save, but {parent} "
                    f"{'committed ' + repr(committed) if committed else 'is not committed'}"
                )
        elif name == TRACKER:
            step = parent_of(uri).child(step_name(data.decode()))
            if not io_loop().run(self.store(step).exists(step.key(MANIFEST_NAME))):
                raise CheckpointNotFoundError(
                    f"refusing to write {uri}: it would name {step}, which is not committed"
                )
            io_loop().run(self.store(uri).put(uri.prefix, data))
        else:
            raise self.unsupported(uri)

    def unsupported(self, uri: S3URI) -> ConfigError:
        return ConfigError(
            f"{uri}: on s3:// Megatron's files are {', '.join(MEMBERS)} inside a checkpoint "
            f"saved with S3SaveShardedStrategy and the tracker {TRACKER}; s3ckpt stores no "
            "other file"
        )

    def committed_metadata(self, uri: S3URI) -> Metadata | None:
        try:
            return S3StorageReader(str(uri), config=self.config).read_metadata()
        except CheckpointNotFoundError:
            return None

    def read_member(self, uri: S3URI, name: str) -> bytes | None:
        """A Megatron file inside the checkpoint committed at ``uri``, or None."""
        reader = S3StorageReader(str(uri), config=self.config)
        try:
            metadata = reader.read_metadata()
        except CheckpointNotFoundError:
            return None
        key = member_key(name)
        if key not in metadata.state_dict_metadata:
            return None
        target: dict[str, Any] = {key: io.BytesIO()}
        with single_process():
            dcp.load(target, storage_reader=reader, no_dist=True)
        return target[key]

    # -- what a save strategy and a load strategy ask ---------------------------------------

    def hold(self, uri: S3URI, name: str, data: bytes) -> None:
        with self._lock:
            self._pending.setdefault(str(uri), {})[name] = data

    def forget(self, path: Any) -> None:
        """Drop what Megatron wrote for a save at ``path`` that was refused."""
        if is_s3(path):
            self.take_pending(s3_uri(path))

    def take_pending(self, uri: S3URI) -> dict[str, bytes]:
        """The files Megatron wrote for the checkpoint at ``uri`` before its save started."""
        with self._lock:
            return self._pending.pop(str(uri), {})

    @contextmanager
    def load_group(self, group: dist.ProcessGroup | None) -> Iterator[None]:
        """Within the block, readers built on this thread share reads over ``group``."""
        self._load.group = group
        try:
            yield
        finally:
            self._load.group = None

    def reader(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_s3(path):
            if self.previous:
                return self.previous.torch.MultiStorageFileSystemReader(path, *args, **kwargs)
            return FileSystemReader(path)
        group = getattr(self._load, "group", None)
        return MegatronReader(str(s3_uri(path)), config=self.config, process_group=group)


class MegatronReader(S3StorageReader):
    """An :class:`~s3ckpt.S3StorageReader` that keeps the metadata it read: Megatron's
    load strategy asks for it again after the load (its file system reader caches it)."""

    def read_metadata(self) -> Metadata:
        if self.metadata is None:
            self.metadata = super().read_metadata()
        return self.metadata


class S3Path:
    """What ``msc.Path`` gives for an ``s3://`` path: enough for Megatron's checks."""

    def __init__(self, files: S3Files, uri: S3URI) -> None:
        self.files, self.uri = files, uri

    def __str__(self) -> str:
        return str(self.uri)

    def __fspath__(self) -> str:
        return str(self.uri)

    def __truediv__(self, other: Any) -> S3Path:
        return S3Path(self.files, self.uri.child(os.fspath(other)))

    @property
    def name(self) -> str:
        return self.uri.prefix.rsplit("/", 1)[-1]

    def exists(self) -> bool:
        return self.files.exists(self.uri)

    def is_dir(self) -> bool:
        return self.files.is_dir(self.uri)

    def is_file(self) -> bool:
        return self.name in (*MEMBERS, TRACKER) and self.exists()

    def iterdir(self) -> Iterator[S3Path]:
        """The Megatron files of a committed checkpoint (none for anything else)."""
        metadata = self.files.committed_metadata(self.uri)
        names = () if metadata is None else MEMBERS
        for name in names:
            if metadata is not None and member_key(name) in metadata.state_dict_metadata:
                yield self / name


class _Upload(io.BytesIO):
    """An ``s3://`` file open for writing: stored by :meth:`S3Files.write` on close."""

    def __init__(self, files: S3Files, uri: S3URI, *, binary: bool) -> None:
        super().__init__()
        self.files, self.uri, self.binary = files, uri, binary

    def write(self, data: Any) -> int:  # text mode takes str
        return super().write(data if self.binary else data.encode())

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self.files.write(self.uri, data)

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            super().close()  # a failed write stores nothing


class _OsPath:
    def __init__(self, files: S3Files) -> None:
        self.files = files

    def exists(self, path: Any) -> bool:
        return self.files.exists(s3_uri(path)) if is_s3(path) else self._local.exists(path)

    def isfile(self, path: Any) -> bool:
        if is_s3(path):
            return S3Path(self.files, s3_uri(path)).is_file()
        return self._local.isfile(path)

    def isdir(self, path: Any, strict: bool = True) -> bool:
        if is_s3(path):
            return self.files.is_dir(s3_uri(path))
        if self.files.previous:
            return self.files.previous.os.path.isdir(path, strict=strict)
        return os.path.isdir(path)

    @property
    def _local(self) -> Any:
        return self.files.previous.os.path if self.files.previous else os.path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)


class _Os:
    def __init__(self, files: S3Files) -> None:
        self.files = files
        self.path = _OsPath(files)

    def makedirs(self, path: Any, *args: Any, **kwargs: Any) -> None:
        if is_s3(path):
            return  # prefixes need no creating
        (self.files.previous.os if self.files.previous else os).makedirs(path, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files.previous.os if self.files.previous else os, name)


class _Torch:
    def __init__(self, files: S3Files) -> None:
        self.files = files

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not is_s3(f):
            (self.files.previous.torch if self.files.previous else torch).save(
                obj, f, *args, **kwargs
            )
            return
        uri = s3_uri(f)
        if uri.prefix.rsplit("/", 1)[-1] != COMMON:
            raise self.files.unsupported(uri)
        buffer = io.BytesIO()
        torch.save(obj, buffer, *args, **kwargs)
        self.files.write(uri, buffer.getvalue())

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_s3(f):
            return (self.files.previous.torch if self.files.previous else torch).load(
                f, *args, **kwargs
            )
        return torch.load(io.BytesIO(self.files.read(s3_uri(f))), *args, **kwargs)

    def MultiStorageFileSystemReader(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self.files.reader(path, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files.previous.torch if self.files.previous else torch, name)
