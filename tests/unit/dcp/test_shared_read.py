"""dcp.shared_read.check_received: bytes that arrived in device memory, checked back
through the bounce slabs (here CPU tensors; test_gpu.py runs it on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from s3ckpt.dcp.device_load import Slabs
from s3ckpt.dcp.shared_read import check_received
from s3ckpt.dcp.tensor_bytes import tensor_view
from s3ckpt.errors import CorruptCheckpointError
from s3ckpt.format.checksums import block_crcs

BLOCK = 4096


def arrived(nbytes: int, span: tuple[int, int], seed: int = 0) -> Any:
    """An item whose stored bytes are ``nbytes`` random bytes; ``span`` of them arrived."""
    stored = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))  # fmt: skip
    crcs = block_crcs(tensor_view(stored), BLOCK)
    return SimpleNamespace(
        raw=stored[span[0] : span[1]].clone(),
        span=span,
        stored=SimpleNamespace(block_size=BLOCK, crc32c=crcs),
        what="item 'w'",
    )


def test_intact_bytes_pass_through_more_pieces_than_slabs() -> None:
    items = [arrived(5 * BLOCK + 17, (0, 5 * BLOCK + 17)), arrived(3 * BLOCK, (0, 3 * BLOCK), 1)]
    regions = [arrived(6 * BLOCK, (2 * BLOCK, 5 * BLOCK), 2)]  # a resharded region's blocks
    check_received([(item, 1) for item in items + regions], Slabs(2 * BLOCK, 2, pinned=False))


@pytest.mark.parametrize("damaged_at", [0, 3 * BLOCK + 5, 5 * BLOCK + 16])
def test_a_damaged_byte_names_its_block_and_sender(damaged_at: int) -> None:
    item = arrived(5 * BLOCK + 17, (0, 5 * BLOCK + 17))
    item.raw[damaged_at] ^= 0xFF
    with pytest.raises(
        CorruptCheckpointError, match=rf"passed on by rank 3\) \(block {damaged_at // BLOCK}"
    ):
        check_received([(item, 3)], Slabs(2 * BLOCK, 2, pinned=False))


def test_damage_in_a_region_is_found_at_its_stored_block() -> None:
    item = arrived(6 * BLOCK, (2 * BLOCK, 5 * BLOCK))
    item.raw[BLOCK] ^= 1  # stored block 3
    with pytest.raises(CorruptCheckpointError, match=r"\(block 3,"):
        check_received([(item, 0)], Slabs(BLOCK, 2, pinned=False))
