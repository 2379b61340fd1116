"""Saves or loads the cross-release checkpoint on whatever torch runs this script.

``python _release_worker.py save|load URI`` with the endpoint and credentials in
``S3CKPT_TEST_S3`` (JSON); a load exits non-zero, naming the entry, when anything differs
from :func:`release_state`. The tests of :mod:`test_torch_releases` run it with the other
torch release's python, so a checkpoint written on one release is loaded on the other.
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

# Dtypes that every supported torch release defines (newer ones join where they exist).
_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int8", "uint8", "bool")
_NEWER = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2")


def release_state() -> dict[str, Any]:
    """A state with every kind of entry whose metadata differs between torch releases: many
    dtypes, a non-contiguous tensor (torch 2.15 records strides), a channels-last tensor,
    a scalar, bytes entries."""
    state: dict[str, Any] = {}
    for name in (*_DTYPES, *(n for n in _NEWER if hasattr(torch, n))):
        dtype = getattr(torch, name)
        raw = (torch.arange(64 * dtype.itemsize) * 13 % 251).to(torch.uint8)
        state[f"t.{name}"] = (raw % 2 if dtype == torch.bool else raw).view(dtype).reshape(8, -1)
    state["transposed"] = torch.arange(48, dtype=torch.float32).reshape(6, 8).t()
    state["channels_last"] = (
        torch.arange(96.0).reshape(2, 3, 4, 4).to(memory_format=torch.channels_last)
    )
    state["scalar"] = torch.tensor(2.5)
    state["extra"] = {"epoch": 3, "name": "run", "history": io.BytesIO(b"loss 0.5\n")}
    return state


def blank_like(tensor: torch.Tensor) -> torch.Tensor:
    """Zeros of ``tensor``'s dtype and shape, built from bytes: torch has no fill kernel for
    some dtypes (``float4_e2m1fn_x2``), which ``zeros_like`` and a deterministic
    ``empty_like`` need."""
    raw = torch.zeros(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    return raw.view(tensor.dtype).reshape(tensor.shape)


def _target(state: dict[str, Any]) -> dict[str, Any]:
    target: dict[str, Any] = {k: blank_like(v) for k, v in state.items() if k != "extra"}
    target["extra"] = {"epoch": 0, "name": "", "history": io.BytesIO()}
    return target


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def differences(expected: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """The entries of ``loaded`` that differ from ``expected``."""
    wrong = [
        key
        for key, tensor in expected.items()
        if key != "extra"
        and (loaded[key].dtype != tensor.dtype or _bytes(loaded[key]) != _bytes(tensor))
    ]
    extra, want = loaded["extra"], expected["extra"]
    if (extra["epoch"], extra["name"]) != (want["epoch"], want["name"]):
        wrong.append("extra")
    if extra["history"].getvalue() != want["history"].getvalue():
        wrong.append("extra.history")
    return wrong


def common_keys(state: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """``state`` less the tensors the other release cannot build (dtypes it lacks)."""
    return {k: v for k, v in state.items() if k in keys}


def main(argv: list[str]) -> int:
    from s3ckpt import S3StorageReader, S3StorageWriter

    command, uri = argv[1], argv[2]
    s3 = json.loads(os.environ["S3CKPT_TEST_S3"])
    if command == "keys":
        print(json.dumps(sorted(release_state())))
        return 0
    if command == "save":
        dcp.save(release_state(), storage_writer=S3StorageWriter(uri, **s3), no_dist=True)
        print(torch.__version__)
        return 0
    keys = json.loads(argv[3])
    expected = common_keys(release_state(), keys)
    loaded = _target(expected)
    dcp.load(loaded, storage_reader=S3StorageReader(uri, **s3), no_dist=True)
    wrong = differences(expected, loaded)
    if wrong:
        print(f"torch {torch.__version__} loaded these entries wrong: {wrong}", file=sys.stderr)
        return 1
    print(torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
