"""DCP metadata is read with a restricted unpickler; these tests pin what torch pickles."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from s3ckpt.dcp import metadata_pickle as dcp_metadata
from s3ckpt.errors import CorruptCheckpointError, UntrustedPickleError
from s3ckpt.format.layout import StoredItem


def _real_metadata(tmp_path) -> Metadata:
    """Metadata produced by DCP itself, covering every dtype and a non-tensor item."""
    state = {f"t_{str(d).removeprefix('torch.')}": torch.zeros(2, 3, dtype=d) for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )}  # fmt: skip
    state["scalar"] = torch.tensor(1.0)
    state["extra"] = {"step": 3, "name": "x"}
    state["channels_last"] = torch.zeros(1, 3, 4, 4).to(memory_format=torch.channels_last)
    writer = dcp.FileSystemWriter(str(tmp_path))
    return dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(), no_dist=True)


def test_dcp_metadata_round_trips_through_the_restricted_unpickler(tmp_path):
    """Fails loudly when a torch release pickles Metadata with new globals (update
    s3ckpt/dcp/compat/metadata_globals.py)."""
    metadata = _real_metadata(tmp_path)
    metadata.storage_data = {index: StoredItem("k", 0, 1, (1,)) for index in metadata.storage_data}
    metadata.storage_meta = StorageMeta(checkpoint_id="s3://b/run/step-1", save_id="abc")
    restored = dcp_metadata.loads(dcp_metadata.dumps(metadata), "test")
    assert restored.state_dict_metadata == metadata.state_dict_metadata
    assert restored.storage_data == metadata.storage_data


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_hostile_pickle_is_refused():
    with pytest.raises(UntrustedPickleError, match=r"names posix\.system") as info:
        dcp_metadata.loads(pickle.dumps(_Exploit()), "s3://evil/metadata")
    assert "trust_pickles=True" in str(info.value)
    assert not isinstance(info.value, CorruptCheckpointError)


def test_a_pickle_of_something_else_is_refused():
    with pytest.raises(CorruptCheckpointError):
        dcp_metadata.loads(pickle.dumps({"not": "metadata"}), "s3://b/m")
