import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from s3ckpt import CheckpointExistsError, unwrap
from s3ckpt.dcp.compat import item_nbytes, narrow, storage_copier


def test_a_shard_is_sized_by_its_chunk_not_the_whole_tensor():
    item = WriteItem(
        index=MetadataIndex("w", torch.Size([32, 0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([32, 0]), torch.Size([32, 48])),
            properties=TensorProperties(dtype=torch.bfloat16),
            size=torch.Size([64, 48]),
        ),
    )
    assert item_nbytes(item) == 32 * 48 * 2


def test_unwrap_returns_the_first_failing_ranks_error():
    error = CheckpointExistsError("exists")
    wrapped = CheckpointException("failed", {1: (error, None), 3: (RuntimeError("x"), None)})
    assert unwrap(wrapped) is error
    plain = ValueError("x")
    assert unwrap(plain) is plain


def test_narrow_selects_the_region_as_a_view():
    base = torch.arange(24).reshape(4, 6)
    region = narrow(base, (1, 2), (2, 3))
    assert torch.equal(region, base[1:3, 2:5])
    # A view: the same memory, so a write through it lands in the base, there and only there.
    assert region.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    region.fill_(-1)
    expected = torch.arange(24).reshape(4, 6)
    expected[1:3, 2:5] = -1
    assert torch.equal(base, expected)


def test_dcp_process_executor_names_used_to_stop_it_exist():
    """stop_async_save_process relies on these private names; fail loudly if torch renames them."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    from s3ckpt.dcp.compat import stop_async_save_process

    assert hasattr(executor, "_CHECKPOINT_PROCESS")
    assert hasattr(executor._CheckpointSaveProcessControlOpts, "TERMINATE")
    for name in ("_send", "__init__"):
        assert hasattr(executor._AsyncCheckpointProcess, name)
    assert stop_async_save_process() is False  # nothing running


def test_unwrap_recovers_a_metadata_failure_that_dcp_replaced():
    from s3ckpt import CheckpointNotFoundError
    from s3ckpt.dcp.compat import remember_metadata_failure

    error = CheckpointNotFoundError("no committed checkpoint at s3://b/x (no manifest)")
    replaced = AssertionError(f"metadata is None; global metadata read failed: {error}")
    remember_metadata_failure(error)
    try:
        assert unwrap(CheckpointException("load", {0: (replaced, None)})) is error
        assert unwrap(replaced) is error
        assert unwrap(AssertionError("something else")).args == ("something else",)
    finally:
        remember_metadata_failure(None)
    assert unwrap(replaced) is replaced


def test_dcp_storage_copier_keeps_buffers_until_closed():
    """``storage_copier`` is DCP's private ``StateDictStager``: a stage takes
    ``non_blocking`` and reuses the host buffer of a storage it copied before."""
    copier = storage_copier(pin_memory=False, share_memory=False)
    source = torch.arange(8.0)
    first = copier.stage({"w": source}, non_blocking=False)["w"]
    source.add_(1)
    second = copier.stage({"w": source}, non_blocking=True)["w"]
    assert second.data_ptr() == first.data_ptr()
    assert torch.equal(second, torch.arange(8.0) + 1)
    # every copy goes through _stage_untyped_storage, which records its source device
    assert copier.devices == {torch.device("cpu")}
    copier.close()
    # a DTensor is copied through these (a DTensor's spec, made again around its copy)
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.tensor import DTensor

    assert callable(StateDictStager._offload_tensor)
    assert callable(StateDictStager.deepcopy_with_tensor_offload)
    assert "_spec" in DTensor.__slots__


def test_the_private_names_the_checkpoint_process_relies_on_exist():
    """shard_write_items and default_store_host use these; fail loudly if torch renames them."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    from torch.distributed.checkpoint.utils import find_tensor_shard

    from s3ckpt.dcp.compat import default_store_host, is_sharded_tensor, shard_write_items

    assert callable(_create_write_items) and callable(find_tensor_shard)
    assert callable(dist.distributed_c10d._get_default_store)
    assert default_store_host() is None  # no default group here
    assert not is_sharded_tensor(torch.zeros(2))
    ((item, tensor),) = shard_write_items(_Checkpointable(torch.arange(4.0)))
    assert item.index.offset == torch.Size([2]) and torch.equal(tensor, torch.arange(4.0))


class _Checkpointable:
    """An object of DCP's ``_Checkpointable`` protocol: the second half of an 8-vector."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        offsets = torch.Size([2])
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=self.local.size()),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=torch.Size([8]),
                ),
            )
        ]

    def __get_tensor_shard__(self, index: object) -> torch.Tensor:
        return self.local


def test_a_metadata_failure_in_dcp_load_reaches_every_caller_as_itself(caplog):
    """``read_by_dcp_load`` pins the frame of ``dcp.load`` that reads the metadata: a reader
    that fails there hands DCP ``stand_in_metadata`` and raises at its next call, so DCP
    logs no warning with the traceback and carries the error itself, not its own
    ``AssertionError("metadata is None; ...")``. Called from anywhere else, it raises."""
    import logging
    import sys

    import torch.distributed.checkpoint as dcp

    from s3ckpt import CheckpointNotFoundError
    from s3ckpt.dcp.compat import StorageReader, read_by_dcp_load, stand_in_metadata

    missing = CheckpointNotFoundError("no committed checkpoint at s3://b/x (no manifest)")

    class Missing(StorageReader):
        failure = None

        def reset(self, checkpoint_id=None): ...

        def read_metadata(self):
            if not read_by_dcp_load(sys._getframe(1)):
                raise missing
            self.failure = missing
            return stand_in_metadata()

        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
            raise self.failure

        def prepare_local_plan(self, plan): return plan  # fmt: skip

        def prepare_global_plan(self, plans): return plans  # fmt: skip

        def read_data(self, plan, planner): raise AssertionError("no read")  # fmt: skip

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id): return True  # fmt: skip

    with pytest.raises(CheckpointNotFoundError):
        Missing().read_metadata()
    with (
        caplog.at_level(logging.WARNING),
        pytest.warns(UserWarning, match="disabled"),  # DCP's, for every no_dist call
        pytest.raises(CheckpointException) as info,
    ):
        dcp.load({"w": torch.zeros(2)}, storage_reader=Missing(), no_dist=True)
    assert unwrap(info.value) is missing
    assert [failure for failure, _ in info.value.failures.values()] == [missing]
    assert "metadata is not found" not in caplog.text
