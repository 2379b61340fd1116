"""Checkpoints written by earlier releases keep loading.

``tests/fixtures/checkpoints/<version>/`` holds every object of small checkpoints written by
that release (one uncompressed, one zstd-compressed) and ``expected.pt`` the values saved.
DCP's metadata object pickles s3ckpt's per-item record by the import path it had then, so
these fixtures catch a module move that would strand existing checkpoints.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt.config import S3URI

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "checkpoints"
RELEASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def _upload(local_s3: Any, folder: Path, uri: str) -> None:
    location = S3URI.parse(uri)
    client = local_s3.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            key = location.key(path.relative_to(folder).as_posix())
            client.put_object(Bucket=location.bucket, Key=key, Body=path.read_bytes())


def _empty_like(expected: dict[str, Any]) -> dict[str, Any]:
    model = {name: torch.zeros_like(t) for name, t in expected["model"].items()}
    return {"model": model, "extra": {"epoch": 0, "name": "", "history": io.BytesIO()}}


def test_fixtures_are_present() -> None:
    assert RELEASES, f"no fixture checkpoints under {FIXTURES}"


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("variant", ["raw", "zstd"])
def test_checkpoint_of_an_earlier_release_loads(
    local_s3: Any, s3_prefix: str, make_reader: Any, release: str, variant: str
) -> None:
    folder = FIXTURES / release
    _upload(local_s3, folder / variant, s3_prefix)
    expected = torch.load(folder / "expected.pt", weights_only=True)
    state = _empty_like(expected)

    dcp.load(state, storage_reader=make_reader(s3_prefix))

    for name, tensor in expected["model"].items():
        assert state["model"][name].dtype == tensor.dtype
        assert torch.equal(state["model"][name], tensor), name
    assert state["extra"]["epoch"] == expected["extra"]["epoch"]
    assert state["extra"]["name"] == expected["extra"]["name"]
    assert state["extra"]["history"].getvalue() == expected["extra"]["history"]
