"""DLIO's checkpoint workload on S3 through s3ckpt: ``S3ckptCheckpointing``.

DLIO (``dlio-benchmark``, the engine of MLPerf Storage) writes a checkpoint as a set of
states per rank (the model's, the optimizer's, one per layer) through a checkpointing
mechanism, and takes one of its own through ``checkpoint_mechanism_classname``: a
subclass of its ``BaseCheckpointing`` that builds tensors (``get_tensor``) and saves each
state (``save_state``); the newest DLIO also reads them back (``load_state``). This
mechanism saves every state as one s3ckpt checkpoint under the checkpoint folder (DCP
with :class:`~s3ckpt.S3StorageWriter`: multipart uploads on the I/O loop, a manifest
committed last), so ``s3ckpt ls``, ``verify``, ``prune`` and ``gc`` see them like any
other, and reads them back with :class:`~s3ckpt.S3StorageReader`. Each rank saves its
own states and nothing else, with no collective (DLIO's ranks are MPI processes, not a
torch process group); a save returns once committed, as DLIO's ``torch.save`` mechanism
returns once written, so DLIO's timings are the store's.

The workload's configuration (YAML, as DLIO's own workloads): the dataset stays where
DLIO reads it (its local storage; DLIO's S3 storage type reads no data with PyTorch), the
checkpoints go to S3::

    checkpoint:
      checkpoint_folder: s3://my-bucket/dlio/llama3-8b
      checkpoint_mechanism_classname: s3ckpt.integrations.dlio.S3ckptCheckpointing

(with ``storage.storage_type: s3``, DLIO's own convention, ``my-bucket/dlio/llama3-8b``
works as well). DLIO's base class makes the checkpoint folder on its storage first; on
local storage this mechanism removes the empty ``./s3:`` directory that makes.

The endpoint and credentials come from the AWS environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, a profile), as for any s3ckpt client;
``S3CKPT_DLIO_WRITER_OPTIONS`` may hold a JSON object of :class:`~s3ckpt.S3StorageWriter`
options (``{"compression": "zstd"}``). A state saved again (a second run into the same
folder) replaces the committed one atomically, as DLIO's files are overwritten, unless
the options say ``"overwrite": false``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from dlio_benchmark.checkpointing.base_checkpointing import BaseCheckpointing
from dlio_benchmark.common.enumerations import StorageType
from dlio_benchmark.utils.config import ConfigArguments

from s3ckpt.dcp.compat import single_process
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import ConfigError

WRITER_OPTIONS_VARIABLE = "S3CKPT_DLIO_WRITER_OPTIONS"


class S3ckptCheckpointing(BaseCheckpointing):
    """DLIO's checkpointing mechanism over s3ckpt (see the module's docstring)."""

    _instance: S3ckptCheckpointing | None = None

    @staticmethod
    def get_instance() -> S3ckptCheckpointing:
        """The process's one mechanism, as DLIO asks for it."""
        if S3ckptCheckpointing._instance is None:
            S3ckptCheckpointing._instance = S3ckptCheckpointing()
        return S3ckptCheckpointing._instance

    def __init__(self) -> None:
        args = ConfigArguments.get_instance()
        self.folder = checkpoint_uri(args.checkpoint_folder, args.storage_type)
        self.writer_options = writer_options(os.environ.get(WRITER_OPTIONS_VARIABLE))
        self.saved: list[str] = []  # the checkpoints this process committed, in order
        shadow = LocalShadow(args.checkpoint_folder, args.storage_type)
        super().__init__("s3ckpt")
        shadow.remove()
        # DLIO's newest base class makes a folder per checkpoint on its storage; s3ckpt's
        # checkpoints need none (the 2.0.0 base class keeps no storage at all).
        self.checkpoint_storage = NoFolders()

    def get_tensor(self, size: int) -> torch.Tensor:
        """``size`` bytes of state, as DLIO's PyTorch mechanism makes them."""
        return torch.randint(high=1, size=(size,), dtype=torch.int8)

    def get_name(self, suffix: str) -> str:
        """The checkpoint that holds the state named ``suffix``."""
        return f"{self.folder}/{suffix}"

    def save_state(self, suffix: str, state: dict[str, Any]) -> None:
        uri = self.get_name(suffix)
        with single_process():
            dcp.save(
                state, storage_writer=S3StorageWriter(uri, **self.writer_options), no_dist=True
            )
        self.saved.append(uri)

    def load_state(self, suffix: str, state: dict[str, Any]) -> dict[str, Any]:
        """Read the state named ``suffix`` into ``state`` (its tensors, in place)."""
        with single_process():
            dcp.load(state, storage_reader=S3StorageReader(self.get_name(suffix)), no_dist=True)
        return state

    def checkpoint(self, epoch: int, step_number: int) -> None:
        super().checkpoint(epoch, step_number)

    def finalize(self) -> None:
        super().finalize()


def checkpoint_uri(folder: str, storage_type: Any) -> str:
    """``s3://bucket/prefix`` for DLIO's checkpoint folder: an ``s3://`` URI, or
    ``bucket/prefix`` with DLIO's S3 storage type."""
    folder = folder.rstrip("/")
    if folder.startswith("s3://"):
        return folder
    if storage_type != StorageType.S3:
        raise ConfigError(
            "S3ckptCheckpointing writes to S3: set checkpoint.checkpoint_folder to "
            f"s3://bucket/prefix (got {folder!r})"
        )
    return f"s3://{folder.lstrip('/')}"


class LocalShadow:
    """The local directory DLIO's base class makes for an ``s3://`` checkpoint folder on
    its local storage (``./s3:/bucket/prefix``), removed again where it made it."""

    def __init__(self, folder: str, storage_type: Any) -> None:
        self.path = Path(folder) if storage_type == StorageType.LOCAL_FS else None
        if self.path is not None and (not folder.startswith("s3://") or self.path.exists()):
            self.path = None  # a real local folder, or one that was there before

    def remove(self) -> None:
        """Remove the directories made for the folder, deepest first, while empty."""
        if self.path is None:
            return
        for directory in (self.path, *self.path.parents[:-1]):
            try:
                directory.rmdir()
            except OSError:  # not empty (someone else's), or not there
                return


class NoFolders:
    """DLIO's storage interface where a checkpoint needs no folder made for it."""

    def create_namespace(self, exist_ok: bool = False) -> bool:
        return True

    def create_node(self, id: str, exist_ok: bool = False) -> bool:
        return True


def writer_options(text: str | None) -> dict[str, Any]:
    """The writer options of :data:`WRITER_OPTIONS_VARIABLE` (a JSON object), overwriting
    unless they say otherwise."""
    try:
        options = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{WRITER_OPTIONS_VARIABLE} is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError(f"{WRITER_OPTIONS_VARIABLE} must be a JSON object of writer options")
    return {"overwrite": True, **options}
