"""``Ranks`` without torch.distributed: this process alone, rank 0 of a world of one."""

from __future__ import annotations

import pytest

from s3ckpt.background.ranks import Ranks
from s3ckpt.errors import BucketNotFoundError


def test_a_lone_process_is_rank_0_of_one_and_shares_no_group():
    ranks = Ranks(None)
    assert (ranks.rank, ranks.world, ranks.distributed) == (0, 1, False)
    assert ranks.shared() is None
    assert ranks.gather("mine") == ["mine"]
    assert ranks.any(True) and not ranks.any(False)


def test_rank_0s_answer_is_returned_and_its_error_raised():
    ranks = Ranks(None)
    assert ranks.from_rank0([3, 5]) == [3, 5]
    assert ranks.from_rank0(None) is None
    error = BucketNotFoundError("no bucket")
    with pytest.raises(BucketNotFoundError) as info:
        ranks.from_rank0(error)
    assert info.value is error
