"""Export and cp of checkpoints written by earlier releases (format 1: items listed in the
manifest) and of zstd-compressed ones, from the fixtures ``test_legacy_format`` loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_legacy_format import FIXTURES, RELEASES, _empty_like, _upload

from s3ckpt.interop import copy_checkpoint, export_checkpoint


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("variant", ["raw", "zstd"])
def test_earlier_release_exports_and_copies_bit_exact(
    local_s3: Any,
    s3_prefix: str,
    s3_options: dict[str, Any],
    make_reader: Any,
    tmp_path: Path,
    release: str,
    variant: str,
) -> None:
    folder = FIXTURES / release
    _upload(local_s3, folder / variant, f"{s3_prefix}/original")
    expected = torch.load(folder / "expected.pt", weights_only=True)

    export_checkpoint(f"{s3_prefix}/original", tmp_path, only="model", **s3_options)
    exported = load_file(tmp_path / "model.safetensors")
    assert sorted(exported) == sorted(expected["model"])
    for name, tensor in expected["model"].items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    copy_checkpoint(f"{s3_prefix}/original", f"{s3_prefix}/copy", **s3_options)
    state = _empty_like(expected)
    dcp.load(state, storage_reader=make_reader(f"{s3_prefix}/copy"))
    for name, tensor in expected["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    assert state["extra"]["epoch"] == expected["extra"]["epoch"]
