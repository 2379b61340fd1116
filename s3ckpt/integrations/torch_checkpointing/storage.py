"""torch-checkpointing's ``Storage`` on S3, its configuration and the callbacks that commit
a save (the package's overview: :mod:`s3ckpt.integrations.torch_checkpointing`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_writer import CallbackArgs, CheckpointWriterConfig
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.errors import CheckpointNotFoundError, ConfigError
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.integrations.torch_checkpointing import commit
from s3ckpt.integrations.torch_checkpointing.files import (
    Committed,
    FileReader,
    FileWriter,
    Saving,
)
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.object_writer import PART_SIZE

log = logging.getLogger(__name__)

FILL_WORKERS = 8  # ranged GETs filling one file at a time (torch-checkpointing's mmap fill)


def manager_config(
    uri: str,
    *,
    config: S3Config | None = None,
    sync: bool = False,
    pre_finalize_callback: Callable[[CallbackArgs], None] | None = None,
    finalize_callback: Callable[[CallbackArgs], None] | None = None,
    **options: Any,
) -> CheckpointManager.Config:
    """A torch-checkpointing ``CheckpointManager.Config`` saving to checkpoints under
    ``uri`` (asynchronously unless ``sync``); ``options`` are :class:`S3Config`'s. Your
    own callbacks run after s3ckpt's (so a finalize callback sees the committed checkpoint
    on rank 0). Call it on every rank after ``init_process_group``."""
    storage = S3StorageConfig(uri, make_config(config, **options))
    writer = CheckpointWriterConfig(write_to_temp_dir=False)
    save = SyncCheckpointSaverConfig if sync else AsyncCheckpointSaverConfig
    return CheckpointManager.Config(
        save=save(writer_config=writer),
        storage_config=storage,
        pre_finalize_callback=Then(write_rank_index, pre_finalize_callback),
        finalize_callback=Then(commit_checkpoint, finalize_callback),
    )


@dataclass
class S3StorageConfig(StorageConfig):
    """Checkpoints under ``uri`` (``s3://bucket/run``), written by rank ``rank`` of
    ``world_size`` (default: the default process group's, else ``RANK``/``WORLD_SIZE``,
    else one process). Pickled into torch-checkpointing's checkpoint process, so the
    rank is taken where the config is made, in the trainer."""

    uri: str
    config: S3Config = field(default_factory=S3Config)
    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        S3URI.parse(self.uri)  # a bad URI fails here, not at the first save
        if self.rank is None or self.world_size is None:
            rank, world = _rank_and_world()
            self.rank = rank if self.rank is None else self.rank
            self.world_size = world if self.world_size is None else self.world_size

    def create_storage(self) -> S3Storage:
        return S3Storage(self)


@dataclass(frozen=True)
class Then:
    """A callback, then the user's (picklable, for the checkpoint process)."""

    first: Callable[[CallbackArgs], None]
    then: Callable[[CallbackArgs], None] | None = None

    def __call__(self, args: CallbackArgs) -> None:
        self.first(args)
        if self.then is not None:
            self.then(args)


def write_rank_index(args: CallbackArgs) -> None:
    """Before the barrier, every rank: its index object (what it wrote, where)."""
    _s3_storage(args).write_index(args.path)


def commit_checkpoint(args: CallbackArgs) -> None:
    """After the barrier: rank 0 writes the manifest; every rank forgets the save."""
    _s3_storage(args).commit(args.path)


class S3Storage(Storage):
    """torch-checkpointing's ``Storage`` for the checkpoints under one run (see the module).

    Paths are ``s3://bucket/run/<name>/<file>`` (``pathlib`` makes that ``s3:/...``;
    both are understood). Writes go to the save in flight of ``<name>``; reads, ``ls``,
    ``exists``, ``isdir`` and ``getsize`` see committed checkpoints only.
    """

    def __init__(self, config: S3StorageConfig) -> None:
        self._config = config
        self.run = S3URI.parse(config.uri)
        self.store = ObjectStore(config.config, self.run.bucket)
        self.rank = config.rank or 0
        self.world_size = config.world_size or 1
        self._lock = threading.Lock()
        self._saves: dict[str, Saving] = {}
        self._committed: dict[str, Committed] = {}

    @property
    def mmap_fill_workers(self) -> int | None:
        return FILL_WORKERS

    @property
    def mmap_fill_chunk_bytes(self) -> int | None:
        return PART_SIZE  # whole checksum blocks: each chunk lands in place, checked

    # -- writing ---------------------------------------------------------------------------

    def stream_write(self, path: Path) -> FileWriter:
        name, file = self._file(path)
        saving = self._saving(name)
        return FileWriter(saving, file, saving.open(self.store))

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as stream:
            stream.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """Nothing to do: S3 has no folders."""
        self._split(path)

    def write_index(self, path: Any) -> None:
        name, _ = self._split(path)
        with self._lock:
            saving = self._saves.get(name)
        if saving is None:  # a rank that wrote no file of this checkpoint
            saving = self._saving(name)
        io_loop().run(commit.write_index(self.store, saving))

    def commit(self, path: Any) -> None:
        name, _ = self._split(path)
        with self._lock:
            saving = self._saves.pop(name, None)
        if self.rank == 0:
            if saving is None:
                raise ConfigError(f"no save of {self.run.child(name)} was in flight on rank 0")
            io_loop().run(commit.commit(self.store, saving, self.world_size))

    def _saving(self, name: str) -> Saving:
        with self._lock:
            saving = self._saves.get(name)
            if saving is None:
                saving = Saving.start(self.store, self.run.child(name), self.rank)
                self._saves[name] = saving
            return saving

    # -- reading ---------------------------------------------------------------------------

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> FileReader:
        name, file = self._file(path)
        checkpoint = self._checkpoint(name)
        return FileReader(
            self.store, checkpoint.location, file, checkpoint.stored(self.store, file)
        )

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        with self.stream_read(path, read_args) as stream:
            return stream.readall()

    def getsize(self, path: Path) -> int:
        name, file = self._file(path)
        return self._checkpoint(name).stored(self.store, file).length

    def exists(self, path: Path) -> bool:
        name, file = self._split(path)
        if not name:
            return True  # the run: a prefix, always there
        checkpoint = self._checkpoint(name, refresh=not file, missing_ok=True)
        if checkpoint is None:
            return False
        return not file or file in checkpoint.names or _is_folder(file, checkpoint.names)

    def isdir(self, path: Path) -> bool:
        name, file = self._split(path)
        if not name:
            return True
        checkpoint = self._checkpoint(name, missing_ok=True)
        return checkpoint is not None and (not file or _is_folder(file, checkpoint.names))

    def ls(self, path: Path) -> list[str]:
        name, file = self._split(path)
        if not name:
            return sorted(commit.committed_names(self.store, self.run))
        prefix = f"{file}/" if file else ""
        names = self._checkpoint(name).names
        return sorted({n[len(prefix) :].split("/", 1)[0] for n in names if n.startswith(prefix)})

    def _checkpoint(self, name: str, *, refresh: bool = False, missing_ok: bool = False) -> Any:
        """The committed checkpoint ``name`` (read once, again with ``refresh``)."""
        with self._lock:
            known = None if refresh else self._committed.get(name)
        if known is not None:
            return known
        location = self.run.child(name)
        try:
            checkpoint = io_loop().run(commit.read_committed(self.store, location))
        except CheckpointNotFoundError:
            if missing_ok:
                return None
            raise
        with self._lock:
            self._committed[name] = checkpoint
        return checkpoint

    # -- removing and renaming -------------------------------------------------------------

    def delete(self, path: Path) -> None:
        name, file = self._file(path)
        with self._lock:
            saving = self._saves.get(name)
        if saving is None or file not in saving.files:
            raise ConfigError(
                f"{self.remap_path(path)} is not a file of a save in flight: a committed "
                "checkpoint is removed whole (rmdir, or s3ckpt rm)"
            )
        written = saving.files.pop(file)
        io_loop().run(self.store.delete_many([written.key]))

    def rmdir(self, path: Path) -> None:
        name, file = self._split(path)
        if not name or file:
            raise ConfigError(f"only a whole checkpoint is removed: {self.remap_path(path)}")
        io_loop().run(commit.remove(self.store, self.run.child(name)))
        with self._lock:
            self._committed.pop(name, None)

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        """A file renamed within one save in flight (what torch-checkpointing's own
        temporary files need): its record moves, nothing is copied. A checkpoint is
        never renamed: it is committed by its manifest, in place."""
        source, target = self._split(src_path), self._split(dst_path)
        with self._lock:
            saving = self._saves.get(source[0])
        if is_directory or source[0] != target[0] or saving is None:
            raise ConfigError(
                f"cannot rename {self.remap_path(src_path)}: checkpoints on S3 are committed "
                "in place by a manifest; use manager_config(), which sets "
                "CheckpointWriterConfig(write_to_temp_dir=False)"
            )
        if source[1] not in saving.files:
            raise FileNotFoundError(self.remap_path(src_path))
        saving.record(target[1], saving.files.pop(source[1]))

    # -- paths -----------------------------------------------------------------------------

    def remap_path(self, path: Path) -> str:
        text = str(path)
        if text.startswith("s3:/") and not text.startswith("s3://"):
            text = "s3://" + text[len("s3:/") :]
        return text

    def _split(self, path: Any) -> tuple[str, str]:
        """``(checkpoint name, file inside it)``; ``""`` for the run, or the checkpoint."""
        uri = S3URI.parse(self.remap_path(path), require_prefix=False)
        run = self.run.prefix
        if uri.bucket != self.run.bucket or not (
            uri.prefix == run or uri.prefix.startswith(run + "/")
        ):
            raise ConfigError(f"{uri} is not under this storage's run {self.run}")
        inside = uri.prefix[len(run) :].strip("/")
        name, _, file = inside.partition("/")
        if name == MANIFEST_NAME:
            raise ConfigError(f"{uri} is not a checkpoint name")
        return name, file

    def _file(self, path: Any) -> tuple[str, str]:
        name, file = self._split(path)
        if not name or not file:
            raise ConfigError(f"{self.remap_path(path)} is not a file inside a checkpoint")
        return name, file


def _is_folder(prefix: str, names: tuple[str, ...]) -> bool:
    return any(n.startswith(prefix.rstrip("/") + "/") for n in names)


def _s3_storage(args: CallbackArgs) -> S3Storage:
    if not isinstance(args.storage, S3Storage):
        raise ConfigError(
            f"s3ckpt's torch-checkpointing callbacks need its S3Storage, not {type(args.storage).__name__}"
        )
    return args.storage


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
