"""Checkpoints cross torch releases: written on one, loaded on the other, both ways; and
what only newer releases have (``TensorProperties.strides``, ``CheckpointableTensor``).

``make test`` runs this module in both of its torch environments and names the other
environment's python in ``S3CKPT_OTHER_TORCH_PYTHON``, so every run covers 2.13 -> newest
and newest -> 2.13. Run by hand without it, the cross-release tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import _release_worker as release
import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(release.__file__)


def _other_python() -> str:
    named = os.environ.get("S3CKPT_OTHER_TORCH_PYTHON")
    if not named:
        pytest.skip("S3CKPT_OTHER_TORCH_PYTHON names no other torch environment (make test does)")
    path = Path(named) if Path(named).is_absolute() else ROOT / named
    if not path.exists():
        pytest.fail(f"S3CKPT_OTHER_TORCH_PYTHON={named}: no such python")
    return str(path)


def _run_other(command: str, *args: str, s3: dict[str, Any]) -> str:
    done = subprocess.run(
        [_other_python(), str(WORKER), command, *args],
        env={**os.environ, "S3CKPT_TEST_S3": json.dumps(s3)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_checkpoint_written_on_the_other_release_loads_here(s3_prefix, s3_options, make_reader):
    version = _run_other("save", s3_prefix, s3=s3_options)
    assert version.split("+")[0] != torch.__version__.split("+")[0], "the same release twice"
    written = json.loads(_run_other("keys", s3_prefix, s3=s3_options))
    expected = release.common_keys(release.release_state(), written)
    assert len(expected) >= 12, sorted(expected)
    loaded = release._target(expected)
    dcp.load(loaded, storage_reader=make_reader(s3_prefix), no_dist=True)
    assert release.differences(expected, loaded) == []


def test_a_checkpoint_written_here_loads_on_the_other_release(s3_prefix, make_writer, s3_options):
    state = release.release_state()
    dcp.save(state, storage_writer=make_writer(s3_prefix), no_dist=True)
    shared = sorted(set(json.loads(_run_other("keys", s3_prefix, s3=s3_options))) & set(state))
    version = _run_other("load", s3_prefix, json.dumps(shared), s3=s3_options)
    assert version.split("+")[0] != torch.__version__.split("+")[0]


def test_strides_are_recorded_where_torch_records_them_and_loads_ignore_them(
    s3_prefix, make_writer, make_reader
):
    transposed = torch.arange(48, dtype=torch.float32).reshape(6, 8).t()
    metadata = dcp.save({"t": transposed}, storage_writer=make_writer(s3_prefix), no_dist=True)
    properties = make_reader(s3_prefix).read_metadata().state_dict_metadata["t"].properties
    if hasattr(properties, "strides"):  # torch 2.15 and later
        assert properties.strides == metadata.state_dict_metadata["t"].properties.strides
        assert properties.strides == transposed.stride()
    loaded = {"t": torch.zeros(8, 6)}
    dcp.load(loaded, storage_reader=make_reader(s3_prefix), no_dist=True)
    assert torch.equal(loaded["t"], transposed)


def _checkpointable(tensor: torch.Tensor, **fields: Any) -> torch.Tensor:
    for name, value in fields.items():
        setattr(tensor, name, value)
    return tensor


@pytest.mark.skipif(
    not hasattr(dcp, "CheckpointableTensor"), reason="CheckpointableTensor came with torch 2.14"
)
def test_checkpointable_tensors_save_their_global_shards(s3_prefix, make_writer, make_reader):
    """A plain tensor declaring two shards of a global (8, 4) tensor, with a padding row
    between them, saves as those shards and loads into a full tensor and back into a
    tensor declaring the same shards."""
    local = torch.arange(36, dtype=torch.float32).reshape(9, 4)
    fields = {
        "global_shape": (8, 4),
        "global_offsets": ((0, 0), (4, 0)),
        "local_offsets": ((0, 0), (5, 0)),
        "local_sizes": ((4, 4), (4, 4)),
    }
    full = torch.cat([local[0:4], local[5:9]])
    dcp.save(
        {"w": _checkpointable(local.clone(), **fields)},
        storage_writer=make_writer(s3_prefix),
        no_dist=True,
    )
    stored = make_reader(s3_prefix).read_metadata().state_dict_metadata["w"]
    assert tuple(stored.size) == (8, 4) and len(stored.chunks) == 2
    whole = {"w": torch.zeros(8, 4)}
    dcp.load(whole, storage_reader=make_reader(s3_prefix), no_dist=True)
    assert torch.equal(whole["w"], full)
    sharded = {"w": _checkpointable(torch.full((9, 4), -1.0), **fields)}
    dcp.load(sharded, storage_reader=make_reader(s3_prefix), no_dist=True)
    assert torch.equal(sharded["w"][0:4], local[0:4]) and torch.equal(sharded["w"][5:9], local[5:9])
    assert torch.equal(sharded["w"][4], torch.full((4,), -1.0)), "the padding row was written"


def test_this_torch_is_one_the_docs_list():
    table = (ROOT / "docs" / "compatibility.md").read_text()
    assert f"| {torch.__version__.split('+')[0]} |" in table, torch.__version__
