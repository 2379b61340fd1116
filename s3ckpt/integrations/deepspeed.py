"""DeepSpeed checkpoints on S3 through s3ckpt: ``S3CheckpointEngine``.

DeepSpeed's ``engine.save_checkpoint(save_dir, tag)`` writes each file of a checkpoint
(the model states on data-parallel rank 0, ``mp_rank_00_model_states.pt``; with ZeRO one
optimizer shard per data-parallel rank, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``)
through ``engine.checkpoint_engine``: ``create(info)``, ``save(state_dict, path)`` per
file, ``commit(info)``, and ``load(path)`` when loading. DeepSpeed has no registry for
engines; :func:`attach` puts an :class:`S3CheckpointEngine` on an engine after
``deepspeed.initialize``::

    import deepspeed
    from s3ckpt.integrations.deepspeed import attach, load_checkpoint, save_checkpoint

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    attach(engine, endpoint_url="https://flashblade.example.com")
    load_checkpoint(engine, "s3://ckpt/run1")                 # the tag `latest` names
    ...
    save_checkpoint(engine, "s3://ckpt/run1", client_state={"step": step})  # every rank

How a save becomes one s3ckpt checkpoint per tag, ``s3://ckpt/run1/<tag>``:

* ``save`` keeps the state dict it is given (references, no copy: DeepSpeed changes no
  state between its saves and the commit) under the file's name;
* ``commit``, on every rank: the ranks first agree (one ``all_gather_object`` of every
  rank's folder, files and errors: the barrier DeepSpeed has not before ``commit``, so no
  rank uploads before every rank's ``save`` calls are done, and a bad save fails every
  rank alike), then save all files of all ranks in one ``dcp.save`` over the group,
  each file's tensors as DCP items named ``<file>/<path>`` plus its pickled skeleton
  (:func:`~s3ckpt.integrations.nested.nested_items`). The manifest is
  written last, by the coordinator, once every rank's data is in: a crash before it
  leaves nothing visible, and the tag saved before stays whole. Saving a tag again
  replaces it atomically;
* DeepSpeed writes its ``latest`` file with ``open()`` after ``commit``, which an
  ``s3://`` folder cannot take: :func:`save_checkpoint` calls DeepSpeed with
  ``save_latest=False`` and the commit writes ``<save_dir>/latest`` (the tag, as
  DeepSpeed's file holds it) as an object, after the manifest, from rank 0; every rank
  learns whether that worked. A plain ``engine.save_checkpoint("s3://...")`` (whose
  ``save_latest`` is ``True``) is refused on every rank before anything is written;
* ``load`` reads one file back (its items only) from the committed tag;
  :func:`load_checkpoint` resolves ``latest`` from S3 (rank 0 reads it, the group shares
  it) before DeepSpeed's ``load_checkpoint``, which would look for a local file.

The group: the world group of ``deepspeed.comm`` (``get_world_group()``, torch's
``WORLD``), the group DeepSpeed's own barriers in ``save_checkpoint`` use and whose
every rank calls it. Every rank of it writes files of the tag (model states per
model-parallel rank, ZeRO shards per data-parallel rank), so the data-parallel group
alone would miss some. ``makedirs`` creates nothing (S3 has no folders; no local
``s3:`` folder appears), and DeepSpeed's three local-file calls on the folder are
redirected in :mod:`s3ckpt.integrations.compat_deepspeed`.

Not covered (refused by :func:`attach`): pipeline engines, MoE layers, NVMe optimizer
offload, node-local storage, universal checkpoints, and DeepSpeed's own writer engines
(``checkpoint.writer``, DataStates), which replace the default engine themselves.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:
    from deepspeed import comm as ds_comm
except ImportError as exc:
    raise ImportError(
        "s3ckpt.integrations.deepspeed needs DeepSpeed: pip install 's3ckpt[deepspeed]' "
        "(DeepSpeed 0.19 is an sdist; on a CPU-only host: DS_BUILD_OPS=0 pip install "
        "--no-build-isolation deepspeed)"
    ) from exc
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ObjectNotFoundError,
)
from s3ckpt.integrations import compat_deepspeed
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
        **options: Any,
    ) -> None:
        super().__init__(config_params=None)
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
        DeepSpeed's own ``latest`` file, before anything is written."""
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
        """Save every rank's files as one checkpoint per tag, then ``latest``."""
        try:
            items = self._items()
            folder = self._agree_on_folder()
            if folder is None:
                log.warning("nothing was saved for tag %s: no checkpoint written", info.tag)
                return True
            writer = S3StorageWriter(
                folder, config=self.config, overwrite=True, **self.writer_options
            )
            dcp.save(items, storage_writer=writer, process_group=self.group)
            log.info("committed %s (%d files on this rank)", folder, len(self.pending))
            if self.latest_requested:
                self._write_latest(info)
            return True
        finally:
            self.info, self.pending, self.problems = None, {}, []

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state dict saved as ``path`` (a file of a committed tag), tensors on the
        CPU or ``map_location``."""
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
        mine = (sorted(folders), sorted(self.pending), list(self.problems))
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        problems = [f"rank {r}: {p}" for r, (_, _, ps) in enumerate(everyone) for p in ps]
        seen: dict[str, int] = {}
        for rank, (_, uris, _) in enumerate(everyone):
            for uri in uris:
                if uri in seen:
                    problems.append(f"{uri} was saved by ranks {seen[uri]} and {rank}")
                seen.setdefault(uri, rank)
        all_folders = sorted({f for fs, _, _ in everyone for f in fs})
        if len(all_folders) > 1:
            problems.append(f"the files of one checkpoint lie in several folders: {all_folders}")
        if problems:
            raise ConfigError("this checkpoint cannot be saved: " + "; ".join(problems))
        return all_folders[0] if all_folders else None

    def _write_latest(self, info: CheckpointCommitInfo) -> None:
        """``<save_dir>/latest`` from the group's rank 0; every rank raises if it failed."""
        failure: list[str | None] = [None]
        if dist.get_rank(self.group) == 0:
            location = S3URI.parse(folder_uri(info.save_dir), require_prefix=False)
            store = ObjectStore(self.config, location.bucket)
            try:
                io_loop().run(store.put(location.key(LATEST), str(info.tag).encode()))
            except Exception as exc:
                failure = [f"{type(exc).__name__}: {exc}"]
                dist.broadcast_object_list(failure, group=self.group, group_src=0)
                raise
        dist.broadcast_object_list(failure, group=self.group, group_src=0)
        if failure[0] is not None:
            raise CheckpointError(
                f"tag {info.tag} is committed, but rank 0 could not update "
                f"{info.save_dir}/{LATEST}: {failure[0]}"
            )


# -- the engine-level helpers ---------------------------------------------------------------


def attach(
    engine: DeepSpeedEngine,
    *,
    endpoint_url: str | None = None,
    config: S3Config | None = None,
    writer_options: dict[str, Any] | None = None,
    reader_options: dict[str, Any] | None = None,
    trust_pickles: bool = False,
    **options: Any,
) -> S3CheckpointEngine:
    """Make ``engine`` (from ``deepspeed.initialize``) save and load ``s3://`` folders
    through s3ckpt; call it on every rank. Arguments as for :class:`S3CheckpointEngine`;
    its group is ``deepspeed.comm.get_world_group()``."""
    if not isinstance(engine, DeepSpeedEngine):
        raise ConfigError(f"attach() needs the engine deepspeed.initialize returns, got {engine!r}")
    current = engine.checkpoint_engine
    if not isinstance(current, (TorchCheckpointEngine, S3CheckpointEngine)):
        raise ConfigError(
            f"this engine saves through {type(current).__name__} (a checkpoint.writer or "
            f"DataStates configuration); {ENGINE_NAME} replaces DeepSpeed's default engine only"
        )
    unsupported = _unsupported(engine)
    if unsupported:
        raise ConfigError(f"{ENGINE_NAME} does not support {', '.join(unsupported)}")
    group = ds_comm.get_world_group()
    if dist.get_world_size(group) != engine.world_size:
        raise ConfigError(
            f"the world group has {dist.get_world_size(group)} ranks, the engine "
            f"{engine.world_size}: every rank of the group must run the engine"
        )
    checkpoints = S3CheckpointEngine(
        group=group,
        endpoint_url=endpoint_url,
        config=config,
        writer_options=writer_options,
        reader_options=reader_options,
        trust_pickles=trust_pickles,
        **options,
    )
    compat_deepspeed.route_s3_paths(
        engine, checkpoints.files, lambda ce: isinstance(ce, S3CheckpointEngine)
    )
    engine.checkpoint_engine = checkpoints
    return checkpoints


def save_checkpoint(
    engine: DeepSpeedEngine,
    save_dir: str,
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """``engine.save_checkpoint`` into ``s3://`` ``save_dir`` (every rank), with
    ``latest`` written to S3 after the commit when ``save_latest``."""
    checkpoints = s3_engine(engine)
    folder = folder_uri(save_dir)
    checkpoints.latest_requested = save_latest
    try:
        return bool(
            engine.save_checkpoint(
                folder,
                tag=tag,
                client_state=client_state or {},
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        )
    finally:
        checkpoints.latest_requested = False


def load_checkpoint(
    engine: DeepSpeedEngine, load_dir: str, tag: Any = None, **options: Any
) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint`` from ``s3://`` ``load_dir`` (every rank): ``tag``, or
    the one ``<load_dir>/latest`` names; ``(None, None)`` if there is none yet, as
    DeepSpeed returns. ``options``: ``engine.load_checkpoint``'s (``load_optimizer_states``...)."""
    checkpoints = s3_engine(engine)
    folder = folder_uri(load_dir)
    if (
        engine.zero_optimization_partition_weights()
        and not options.get("load_optimizer_states", True)
        and not options.get("load_module_only", False)
    ):
        raise ConfigError(
            "ZeRO-3 with load_optimizer_states=False rebuilds weights from local files "
            "(zero_to_fp32); load the optimizer states too, or pass load_module_only=True"
        )
    if tag is None:
        tag = _shared_latest(checkpoints, folder)
        if tag is None:
            log.warning("no %s under %s: nothing to load", LATEST, folder)
            return None, None
    return engine.load_checkpoint(folder, tag=str(tag), **options)


def latest_tag(save_dir: str, *, config: S3Config | None = None, **options: Any) -> str | None:
    """The tag ``<save_dir>/latest`` names, or ``None`` (from any process, no engine)."""
    return S3CheckpointEngine(group=None, config=config, **options).latest_tag(save_dir)


def s3_engine(engine: Any) -> S3CheckpointEngine:
    """``engine``'s :class:`S3CheckpointEngine`, or a clear error if :func:`attach` was
    not called."""
    checkpoints = getattr(engine, "checkpoint_engine", None)
    if not isinstance(checkpoints, S3CheckpointEngine):
        raise ConfigError(
            f"the engine's checkpoint engine is {type(checkpoints).__name__}: call "
            "s3ckpt.integrations.deepspeed.attach(engine, ...) after deepspeed.initialize"
        )
    return checkpoints


def folder_uri(path: str | os.PathLike[str]) -> str:
    """``path`` as an ``s3://bucket/prefix`` URI; a local path gets a clear error."""
    text = os.fspath(path)
    if not text.startswith("s3://"):
        raise ConfigError(
            f"{ENGINE_NAME} saves to and loads from s3:// folders, got {text!r}; "
            "DeepSpeed's own engine (no attach()) writes local folders"
        )
    return str(S3URI.parse(text, require_prefix=False))


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


def _shared_latest(checkpoints: S3CheckpointEngine, folder: str) -> str | None:
    """``latest`` read by the group's rank 0 and shared, so every rank loads one tag."""
    group = checkpoints.group
    if group is None or dist.get_world_size(group) == 1:
        return checkpoints.latest_tag(folder)
    found: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            found = [("tag", checkpoints.latest_tag(folder))]
        except Exception as exc:
            dist.broadcast_object_list([("error", str(exc))], group=group, group_src=0)
            raise
    dist.broadcast_object_list(found, group=group, group_src=0)
    kind, value = found[0]
    if kind == "error":
        raise CheckpointError(f"rank 0 could not read {folder}/{LATEST}: {value}")
    return value


def _unsupported(engine: DeepSpeedEngine) -> list[str]:
    """What of ``engine``'s configuration writes files outside the engine's interface."""
    checks = {
        "pipeline parallelism (PipelineEngine)": isinstance(engine, PipelineEngine),
        "MoE layers": bool(engine.has_moe_layers),
        "NVMe optimizer offload": bool(engine.zero_nvme_offload_optimizer()),
        "node-local storage (use_node_local_storage)": bool(engine.use_node_local_storage()),
        "universal checkpoints (load_universal)": bool(engine.load_universal_checkpoint()),
    }
    return [name for name, present in checks.items() if present]
