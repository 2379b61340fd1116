"""Every dtype that DCP's own FileSystem backend round-trips on the running torch commits
and loads through s3ckpt: one checkpoint holding all of them, and each on its own.

The list is not written down: it is found at test time, by building a tensor of each
``torch.dtype`` the running torch defines from bytes and saving it through DCP's
``FileSystemWriter``/``FileSystemReader``, so a dtype that a new torch adds is covered the
day it can be saved.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from s3ckpt import UntrustedPickleError, unwrap

_ELEMENTS = 48


def _from_bytes(dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor of ``dtype`` whose bytes are a known pattern; ``None`` if torch cannot
    build one from bytes."""
    try:
        raw = (torch.arange(_ELEMENTS * dtype.itemsize, dtype=torch.int64) * 37 % 251).to(
            torch.uint8
        )
        if dtype == torch.bool:
            raw = raw % 2
        return raw.view(dtype).reshape(4, -1)
    except (RuntimeError, TypeError, ValueError):
        return None


def _blank_like(tensor: torch.Tensor) -> torch.Tensor:
    """A load target of ``tensor``'s dtype and shape, built from bytes (torch has no fill
    kernel for some dtypes, which a deterministic ``empty_like`` would call)."""
    raw = torch.zeros(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    return raw.view(tensor.dtype).reshape(tensor.shape)


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _dcp_round_trips(tensor: torch.Tensor) -> bool:
    """Whether DCP's FileSystem backend saves and loads ``tensor`` bit-exact."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            dcp.save({"t": tensor}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
            loaded = {"t": _blank_like(tensor)}
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
        except (Exception, CheckpointException):  # DCP's is a BaseException
            return False
    return _bytes_of(loaded["t"]) == _bytes_of(tensor)


@functools.cache
def dcp_dtypes() -> tuple[torch.dtype, ...]:
    """Every dtype of the running torch that DCP's FileSystem backend round-trips."""
    defined = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    found = []
    for dtype in sorted(defined, key=str):
        tensor = _from_bytes(dtype)
        if tensor is not None and _dcp_round_trips(tensor):
            found.append(dtype)
    return tuple(found)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_the_enumeration_finds_the_dtypes_large_models_train_with():
    names = {_name(d) for d in dcp_dtypes()}
    expected = {"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64"}
    expected |= {"float8_e8m0fnu", "float4_e2m1fn_x2"} & {
        _name(d) for d in vars(torch).values() if isinstance(d, torch.dtype)
    }
    assert expected <= names, sorted(names)


def test_one_checkpoint_holding_every_dtype_loads_bit_exact(s3_prefix, make_writer, make_reader):
    state = {_name(d): _from_bytes(d) for d in dcp_dtypes()}
    dcp.save(state, storage_writer=make_writer(s3_prefix), no_dist=True)
    loaded = {k: _blank_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=make_reader(s3_prefix), no_dist=True)
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype, key
        assert _bytes_of(loaded[key]) == _bytes_of(tensor), key


@pytest.mark.parametrize("dtype", dcp_dtypes(), ids=_name)
def test_each_dtype_on_its_own_loads_bit_exact(dtype, s3_prefix, make_writer, make_reader):
    tensor = _from_bytes(dtype)
    assert tensor is not None
    dcp.save({"t": tensor, "step": 3}, storage_writer=make_writer(s3_prefix), no_dist=True)
    loaded: dict[str, Any] = {"t": _blank_like(tensor), "step": 0}
    dcp.load(loaded, storage_reader=make_reader(s3_prefix), no_dist=True)
    assert loaded["t"].dtype == dtype and loaded["step"] == 3
    assert _bytes_of(loaded["t"]) == _bytes_of(tensor)


class _Annotation:
    """A custom class a planner might put in DCP's metadata."""


class _AnnotatingPlanner(DefaultSavePlanner):
    def create_global_plan(self, all_plans: list[Any]) -> Any:
        plans, metadata = super().create_global_plan(all_plans)
        metadata.planner_data = {"note": _Annotation()}
        return plans, metadata


def test_metadata_a_load_would_refuse_fails_the_save_before_it_commits(
    s3_prefix, make_writer, list_keys, pending_uploads
):
    with pytest.raises(BaseException) as info:
        dcp.save(
            {"w": torch.ones(8)},
            storage_writer=make_writer(s3_prefix),
            planner=_AnnotatingPlanner(),
            no_dist=True,
        )
    error = unwrap(info.value)
    assert isinstance(error, UntrustedPickleError), error
    assert error.refused == f"{__name__}._Annotation"
    assert "_Annotation" in str(error) and "nothing was committed" in str(error)
    assert list_keys(s3_prefix) == [] and pending_uploads(s3_prefix) == []
