"""The strategies Megatron-core's ``dist_checkpointing`` saves and loads with, and the
writer they write through (the package's overview: :mod:`s3ckpt.integrations.megatron`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist

from s3ckpt.config import S3Config, make_config
from s3ckpt.dcp.compat import (
    MetadataIndex,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
    WriteResult,
    wrap_exception,
)
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import ConfigError
from s3ckpt.integrations.megatron.files import (
    CONFIG,
    S3Files,
    is_member_key,
    is_s3,
    member_bytes,
    member_key,
    s3_uri,
)

try:
    from s3ckpt.integrations.megatron import compat
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess
    if (exc.name or "").split(".")[0] != "megatron":
        raise
    from s3ckpt._install import install_hint

    raise ModuleNotFoundError(
        f"s3ckpt.integrations.megatron needs megatron-core, in {install_hint('megatron')}",
        name=exc.name,
    ) from exc

log = logging.getLogger(__name__)


def enable(config: S3Config | None = None, **options: Any) -> S3Files:
    """Turn s3ckpt's handling of ``s3://`` paths in Megatron on (idempotent) and give it
    ``config``: Megatron's small files and readers through the MSC hook, and the refusal
    of ``s3://`` paths by Megatron's own file system writer. The strategies call it."""
    resolved = make_config(config, **options)
    files = compat.install_files(lambda previous, was_on: S3Files(resolved, previous, was_on))
    files.config = resolved
    compat.install_writer_switch()
    return files


def _require_hook() -> None:
    """Refuse to go on when Megatron's MSC hook was turned off after the strategy enabled
    it: Megatron's own files of this save or load went to the local file system."""
    if compat.installed_files() is None:
        raise ConfigError(
            "Megatron's Multi-Storage Client feature was turned off after s3ckpt turned it "
            "on (Megatron-LM does so when it parses its arguments, unless --enable-msc): "
            "create the S3 strategies after that, or call "
            "s3ckpt.integrations.megatron.enable() again before saving or loading"
        )


class S3SaveShardedStrategy(compat.TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save strategy writing ``s3://`` checkpoints with s3ckpt.

    Args:
        endpoint_url, config, options: the S3 connection, as for
            :class:`~s3ckpt.S3StorageWriter`.
        overwrite: replace a committed checkpoint at the same path atomically (Megatron
            saves over an existing directory too); False raises
            :class:`~s3ckpt.errors.CheckpointExistsError` instead.
        writer_options: further keyword arguments of every writer (``compression``...).
        backend, version, keep_only_main_replica, cached_metadata: as for
            ``TorchDistSaveShardedStrategy`` (``cached_metadata=True`` is
            ``--ckpt-assume-constant-structure``).
    """

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        overwrite: bool = True,
        writer_options: dict[str, Any] | None = None,
        keep_only_main_replica: bool = True,
        cached_metadata: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            backend,
            version,
            keep_only_main_replica=keep_only_main_replica,
            cached_metadata=cached_metadata,
        )
        self.s3_config = make_config(config, endpoint_url=endpoint_url, **options)
        self.overwrite = overwrite
        self.writer_options = dict(writer_options or {})
        # The save id the first save's plans carried: given again to every later plan so
        # that unchanged plans compare equal and Megatron's plan reuse can engage; each
        # save still writes under an id of its own (s3ckpt.dcp.save_identity).
        self.plan_id: str | None = None
        self.files = enable(self.s3_config)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        if not is_s3(checkpoint_dir):
            raise ConfigError(
                f"S3SaveShardedStrategy saves to s3://bucket/prefix paths, got {checkpoint_dir!r}"
            )
        _require_hook()
        self.files.config = self.s3_config
        uri = s3_uri(checkpoint_dir)
        members: dict[str, bytes] = {}
        if dist.get_rank() == 0:  # Megatron's coordinator and the rank writing common.pt
            members = self.files.take_pending(uri)
            members[CONFIG] = compat.checkpointing_config_json(self.backend, self.version)
        made: list[MegatronS3Writer] = []

        def make_writer(path: Any) -> MegatronS3Writer:
            writer = MegatronS3Writer(
                str(uri),
                config=self.s3_config,
                overwrite=self.overwrite,
                members=members,
                plan_id=self.plan_id,
                **self.writer_options,
            )
            made.append(writer)
            return writer

        with compat.writer_factory(make_writer):
            request = super().async_save(sharded_state_dict, checkpoint_dir)
        self.plan_id = made[0].plan_id
        return request


class S3LoadShardedStrategy(compat.TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load strategy reading ``s3://`` checkpoints with s3ckpt.

    ``process_group``: the ranks that call ``dist_checkpointing.load`` together (default:
    the whole world once it has more than one rank): its rank 0 reads the manifest and the
    metadata and broadcasts them (:class:`~s3ckpt.S3StorageReader`).
    """

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        config: S3Config | None = None,
        process_group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.s3_config = make_config(config, endpoint_url=endpoint_url, **options)
        self.process_group = process_group
        self.files = enable(self.s3_config)

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        if is_s3(checkpoint_dir):
            _require_hook()
        self.files.config = self.s3_config
        group = self.process_group
        if group is None and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.group.WORLD
        with self.files.load_group(group if is_s3(checkpoint_dir) else None):
            return super().load(sharded_state_dict, checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
        found = super().load_sharded_metadata(checkpoint_dir)
        return {key: value for key, value in found.items() if not is_member_key(key)}


# -- the writer ---------------------------------------------------------------------------------


class _StagedPlanner:
    """What ``write_assigned`` resolves items with in the worker: the staged values."""

    def __init__(self, values: dict[MetadataIndex, Any]) -> None:
        self.values = values

    def resolve_data(self, item: WriteItem) -> Any:
        return self.values[item.index]


def _stage(values: dict[MetadataIndex, Any]) -> dict[MetadataIndex, Any]:
    """Megatron's ``preload_fn``: tensors to host memory (GPU ones copied, CPU ones kept)."""
    staged = {
        index: value.to("cpu", non_blocking=True) if isinstance(value, torch.Tensor) else value
        for index, value in values.items()
    }
    if any(isinstance(v, torch.Tensor) and v.is_cuda for v in values.values()):
        torch.cuda.synchronize()
    return staged


def _write_staged(
    writer: MegatronS3Writer, rank: int, values: dict[MetadataIndex, Any], results: str
) -> None:
    """Megatron's ``async_fn``: the rank's items written; the results (or the failure)
    handed back to the trainer's writer: directly when run in its process, else through
    the file ``results`` (Megatron runs it in a forked process, or in a persistent worker
    it pickles the call to; a file serves both, and no pipe can fill up and block)."""
    try:
        outcome: Any = writer.write_assigned(writer.plan, _StagedPlanner(values), writer.assigned)
    except Exception as exc:
        log.warning("rank %d: writing %s failed: %s", rank, writer.checkpoint_id, exc)
        outcome = exc
    if os.getpid() == writer.owner_pid:
        writer.outcome = outcome
        return
    try:
        body = pickle.dumps(outcome)
    except Exception:  # an exception that does not pickle
        body = pickle.dumps(RuntimeError(repr(outcome)))
    with open(results + ".part", "wb") as f:
        f.write(body)
    os.replace(results + ".part", results)


class MegatronS3Writer(S3StorageWriter):
    """An :class:`~s3ckpt.S3StorageWriter` with what Megatron's async torch_dist saving
    calls: ``prepare_write_data`` (in the trainer: the rank's assignment and values),
    ``get_save_function_and_args`` (the ``preload_fn`` and ``async_fn`` of an
    ``AsyncRequest``), ``retrieve_write_results`` (in the finalization, before ``finish``,
    the commit). On the coordinator it adds Megatron's files (``common.pt``,
    ``metadata.json``) to the save as items of their own."""

    def __init__(
        self,
        checkpoint_id: str,
        *,
        members: dict[str, bytes] | None = None,
        plan_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(checkpoint_id, **kwargs)
        self.members = dict(members or {})
        self.plan_id = plan_id
        self.owner_pid = os.getpid()
        self.token = uuid.uuid4().hex
        self.plan: SavePlan | None = None
        self.assigned: Any = None
        self.values: dict[MetadataIndex, Any] = {}
        self.outcome: Any = None
        self.results = os.path.join(tempfile.gettempdir(), f"s3ckpt-megatron-{self.token}.pkl")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        present = {item.index.fqn for item in plan.items}
        added = [
            WriteItem(index=MetadataIndex(member_key(name)), type=WriteItemType.BYTE_IO)
            for name in sorted(self.members)
            if member_key(name) not in present
        ]
        return dataclasses.replace(plan, items=[*plan.items, *added]) if added else plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.plan_id is not None:
            self.save_id = self.plan_id
        return super().prepare_global_plan(plans)

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        self.plan = plan
        self.plan_id = getattr(plan.storage_data, "save_id", None)
        self.assigned = self.assignment(plan)
        self.values = {item.index: self._resolve(item, planner) for item in plan.items}

    def _resolve(self, item: WriteItem, planner: SavePlanner) -> Any:
        fqn = item.index.fqn
        if is_member_key(fqn):
            name = next(n for n in self.members if member_key(n) == fqn)
            return member_bytes(self.members[name])
        value = planner.resolve_data(item)
        return value.detach() if isinstance(value, torch.Tensor) else value

    def get_save_function_and_args(self) -> tuple[Any, Any, list[Any]]:
        if self.plan is None or not self.plan.items:
            return None, None, []
        return (
            functools.partial(_write_staged, self),
            functools.partial(_stage, self.values),
            [dist.get_rank(), self.values, self.results],
        )

    def retrieve_write_results(self) -> Any:
        if self.plan is None or not self.plan.items:
            return []
        outcome = self.outcome if self.outcome is not None else self._handed_back()
        self.values = {}
        if isinstance(outcome, BaseException):
            return wrap_exception(outcome)
        results: list[WriteResult] = outcome
        return results

    def _handed_back(self) -> Any:
        """This save's outcome, as the background write left it."""
        try:
            with open(self.results, "rb") as f:
                outcome = pickle.load(f)
        except FileNotFoundError:
            return RuntimeError(
                f"no write results for {self.checkpoint_id}: the background write of "
                "this rank did not finish (killed?)"
            )
        os.unlink(self.results)
        return outcome

    def __getstate__(self) -> dict[str, Any]:
        """Pickled into a persistent worker: its values travel as the call's arguments."""
        state = self.__dict__.copy()
        state["values"] = {}
        return state
