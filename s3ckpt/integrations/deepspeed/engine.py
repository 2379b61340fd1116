"""``S3CheckpointEngine``: DeepSpeed's ``CheckpointEngine`` interface over s3ckpt.

One tag's way through it (what :mod:`s3ckpt.integrations.deepspeed` describes in full):
``create`` refuses what cannot work on every rank alike, ``save`` keeps each file's state
dict, ``commit`` agrees across the group and stores every rank's files in one
``dcp.save`` whose last step writes ``latest``; ``load`` reads one file back. With ``async_save``,
``commit`` returns once the files are copied into memory shared with the rank's
checkpoint process (:class:`~s3ckpt.CheckpointProcess`), which uploads and commits them
while training goes on, ``latest`` last. The next
``create``, ``load`` or :meth:`S3CheckpointEngine.wait` waits for that save, and a failure
of it is raised at the next ``create`` on every rank alike. The helpers around
an engine (``attach``, ``save_checkpoint``, ``load_checkpoint``) are in
:mod:`s3ckpt.integrations.deepspeed`, which checks that DeepSpeed is installed first.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from s3ckpt.background.process import CheckpointProcess
from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ObjectNotFoundError,
)
from s3ckpt.integrations.nested import SKELETON_KEY, load_nested, nested_items
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore

log = logging.getLogger(__name__)

LATEST = "latest"
ENGINE_NAME = "S3CheckpointEngine"
# The classes DeepSpeed pickles into its ZeRO optimizer files (besides tensors and
# containers): loaded with torch's weights-only unpickler, which builds these and
# refuses any other global unless the engine trusts the bucket.
DEEPSPEED_GLOBALS = (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)


class S3CheckpointEngine(CheckpointEngine):
    """DeepSpeed's ``CheckpointEngine`` over s3ckpt; folders are ``s3://bucket/prefix``.

    Args:
        group: the process group every rank of the engine is in (:func:`attach` passes
            ``deepspeed.comm.get_world_group()``); ``None`` only loads, a commit is refused.
        endpoint_url, config, options: the store, as for :class:`~s3ckpt.S3StorageWriter`.
        writer_options: keyword arguments of every :class:`~s3ckpt.S3StorageWriter`
            (``compression="zstd"``...).
        reader_options: keyword arguments of every :class:`~s3ckpt.S3StorageReader`.
        trust_pickles: unpickle any Python global in the files' non-tensor state
            (DeepSpeed's own engine does, ``weights_only=False``); by default only
            torch's weights-only set plus :data:`DEEPSPEED_GLOBALS`.
        async_save: upload from the rank's checkpoint process, after ``commit`` returns.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        writer_options: dict[str, Any] | None = None,
        reader_options: dict[str, Any] | None = None,
        trust_pickles: bool = False,
        async_save: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(config_params=None)
        self.async_save = async_save
        self._process: CheckpointProcess | None = None
        self._inflight: threading.Event | None = None  # set once the background save is over
        self._failure: str | None = None  # the last background save's, until agreed on
        self.name = ENGINE_NAME
        self.config = make_config(config, endpoint_url=endpoint_url, **options)
        self.group = group
        self.writer_options = dict(writer_options or {})
        self.reader_options = dict(reader_options or {})
        self.trust_pickles = trust_pickles
        self.latest_requested = False  # set by save_checkpoint() around DeepSpeed's save
        self.pending: dict[str, Any] = {}  # file URI -> state dict, this rank, this save
        self.problems: list[str] = []  # bad saves, reported to every rank at the commit
        self.info: CheckpointCommitInfo | None = None

    # -- DeepSpeed's interface ----------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """A save starts (every rank). Refuses, on every rank alike, a local folder and
        DeepSpeed's own ``latest`` file, before anything is written; waits for the
        background save before (``async_save``)."""
        self._settle()
        folder_uri(info.save_dir)
        if info.save_latest:
            raise ConfigError(
                f"DeepSpeed would write {info.save_dir}/latest with open(), which an s3:// "
                "folder cannot take: save with s3ckpt.integrations.deepspeed.save_checkpoint"
                "(engine, save_dir, ...) (it writes `latest` to S3 after the commit), or "
                "pass save_latest=False"
            )
        self.info, self.pending, self.problems = info, {}, []

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing to create: S3 has no folders (and no local ``s3:`` folder appears)."""

    def save(self, state_dict: Any, path: str) -> None:
        """Keep ``state_dict`` for the commit; problems are raised there, on every rank."""
        try:
            uri = file_uri(path)
        except ConfigError as exc:
            self.problems.append(str(exc))
            return
        if self.info is None:
            self.problems.append(f"{uri} was saved outside a checkpoint (no create() first)")
        elif uri in self.pending:
            self.problems.append(f"{uri} was saved twice in one checkpoint")
        self.pending[uri] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Save every rank's files as one checkpoint per tag; ``latest`` is written as its
        last step, so a save is over (synchronous or not) only once ``latest`` names it."""
        try:
            items = self._items()
            folder = self._agree_on_folder()
            if folder is None:
                log.warning("nothing was saved for tag %s: no checkpoint written", info.tag)
                return True
            after_commit = {latest_uri(info.save_dir): str(info.tag).encode()}
            writer = S3StorageWriter(
                folder,
                config=self.config,
                overwrite=True,
                after_commit=after_commit if self.latest_requested else None,
                **self.writer_options,
            )
            if self.async_save:
                self._start_upload(items, writer, info.tag)
                return True
            dcp.save(items, storage_writer=writer, process_group=self.group)
            log.info("committed %s (%d files on this rank)", folder, len(self.pending))
            return True
        finally:
            self.info, self.pending, self.problems = None, {}, []

    def wait(self) -> None:
        """Wait for the background save (``async_save``); raises its failure on this rank."""
        self._settle()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise CheckpointError(failure)

    def _start_upload(self, items: dict[str, Any], writer: Any, tag: Any) -> None:
        """Copy ``items`` into shared memory and upload them from the checkpoint process."""
        if self._process is None:  # every rank commits its first tag together
            self._process = CheckpointProcess(self.group)
        future = self._process.async_save(items, storage_writer=writer)
        over = threading.Event()

        def finished(done: Future[Any]) -> None:
            try:
                error = done.exception()
                if error is not None:
                    log.error("the background save of tag %s failed: %s", tag, error)
                    self._failure = f"the background save of tag {tag} failed: {error}"
                else:
                    log.info("committed %s in the background", writer.location)
            finally:
                over.set()

        self._inflight = over
        future.add_done_callback(finished)

    def _settle(self) -> None:
        """Wait for the background save, if one is in flight (its outcome: ``_failure``)."""
        over, self._inflight = self._inflight, None
        if over is not None:
            over.wait()

    def close(self) -> None:
        """Wait for the background save, then stop the checkpoint process."""
        self._settle()
        process, self._process = self._process, None
        if process is not None:
            process.close()

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state dict saved as ``path`` (a file of a committed tag), tensors on the
        CPU or ``map_location``."""
        self._settle()
        folder, _, name = file_uri(path).rpartition("/")
        reader = S3StorageReader(folder, config=self.config, **self.reader_options)
        metadata = reader.read_metadata()
        held = _file_names(metadata)
        if name not in held:
            raise CheckpointNotFoundError(
                f"{folder} holds no file {name} (it holds: {', '.join(held) or 'none'})"
            )
        with torch.serialization.safe_globals(list(DEEPSPEED_GLOBALS)):
            return load_nested(
                reader,
                weights_only=False if self.trust_pickles else None,
                map_location=map_location,
                prefix=name + "/",
                metadata=metadata,
            )

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        """False: each tensor is stored as its own elements, never a view's whole
        storage, so DeepSpeed need not clone state to the CPU before handing it over."""
        return False

    # -- s3ckpt's additions -------------------------------------------------------------

    def files(self, folder: str) -> list[str]:
        """The names of the files in the committed checkpoint ``folder``."""
        reader = S3StorageReader(folder_uri(folder), config=self.config, **self.reader_options)
        return _file_names(reader.read_metadata())

    def latest_tag(self, save_dir: str) -> str | None:
        """The tag ``<save_dir>/latest`` names (written after its commit), or ``None``."""
        location = S3URI.parse(folder_uri(save_dir), require_prefix=False)
        store = ObjectStore(self.config, location.bucket)
        try:
            body = io_loop().run(store.get(location.key(LATEST)))
        except ObjectNotFoundError:
            return None
        return body.decode().strip() or None

    def _items(self) -> dict[str, Any]:
        """This rank's files as DCP items, ``<file>/<path>``; a file that cannot be split
        (its skeleton does not pickle) is a problem reported to every rank."""
        items: dict[str, Any] = {}
        for uri, state in self.pending.items():
            try:
                items.update(nested_items(state, prefix=uri.rpartition("/")[2] + "/"))
            except Exception as exc:
                self.problems.append(f"{uri} cannot be stored: {type(exc).__name__}: {exc}")
        return items

    def _agree_on_folder(self) -> str | None:
        """The one folder every rank's files lie in (``None``: no rank saved a file);
        every rank raises the same error when the ranks' saves do not fit together."""
        if self.group is None:
            raise ConfigError(
                f"{ENGINE_NAME} was made without a process group and only loads; "
                "attach(engine) gives it the engine's"
            )
        folders = {uri.rpartition("/")[0] for uri in self.pending}
        failure, self._failure = self._failure, None
        mine = (sorted(folders), sorted(self.pending), list(self.problems), failure)
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        failed = [f"rank {r}: {f}" for r, (*_, f) in enumerate(everyone) if f is not None]
        if failed:  # every rank raises it, then saves again in step at the next tag
            raise CheckpointError("; ".join(failed) + "; this tag is not saved")
        problems = [f"rank {r}: {p}" for r, (_, _, ps, _) in enumerate(everyone) for p in ps]
        seen: dict[str, int] = {}
        for rank, (_, uris, _, _) in enumerate(everyone):
            for uri in uris:
                if uri in seen:
                    problems.append(f"{uri} was saved by ranks {seen[uri]} and {rank}")
                seen.setdefault(uri, rank)
        all_folders = sorted({f for fs, *_ in everyone for f in fs})
        if len(all_folders) > 1:
            problems.append(f"the files of one checkpoint lie in several folders: {all_folders}")
        if problems:
            raise ConfigError("this checkpoint cannot be saved: " + "; ".join(problems))
        return all_folders[0] if all_folders else None


def folder_uri(path: str | os.PathLike[str]) -> str:
    """``path`` as an ``s3://bucket/prefix`` URI; a local path gets a clear error."""
    text = os.fspath(path)
    if not text.startswith("s3://"):
        raise ConfigError(
            f"{ENGINE_NAME} saves to and loads from s3:// folders, got {text!r}; "
            "DeepSpeed's own engine (no attach()) writes local folders"
        )
    return str(S3URI.parse(text, require_prefix=False))


def latest_uri(save_dir: str | os.PathLike[str]) -> str:
    """The URI of ``<save_dir>/latest``, the object naming the newest committed tag."""
    location = S3URI.parse(folder_uri(save_dir), require_prefix=False)
    return f"s3://{location.bucket}/{location.key(LATEST)}"


def file_uri(path: str | os.PathLike[str]) -> str:
    """A checkpoint file's ``s3://`` URI; it must lie in a folder below the bucket."""
    uri = folder_uri(path)
    if not S3URI.parse(uri, require_prefix=False).prefix.count("/"):
        raise ConfigError(f"{uri}: a checkpoint file lies in a folder below the bucket")
    return uri


def _file_names(metadata: Any) -> list[str]:
    """The files a checkpoint's DCP metadata holds: one skeleton item each."""
    suffix = "/" + SKELETON_KEY
    names = metadata.state_dict_metadata
    return sorted(name[: -len(suffix)] for name in names if name.endswith(suffix))
