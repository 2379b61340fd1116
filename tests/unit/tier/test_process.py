"""``TierSave.result`` raises s3ckpt errors only, as ``CheckpointManager`` does."""

from __future__ import annotations

from concurrent.futures import CancelledError, Future

import pytest
from torch.distributed.checkpoint import CheckpointException

from s3ckpt import BucketNotFoundError, CheckpointError, TierSave


def _save(error: BaseException | None = None) -> TierSave:
    done: Future = Future()
    if error is not None:
        done.set_exception(error)
    held: Future = Future()
    held.set_result(None)
    return TierSave(step=4, to_s3=True, held=held, replicated=held, done=done)


def test_a_dcp_failure_without_an_s3ckpt_error_is_a_checkpoint_error_chained_to_it():
    cause = RuntimeError("planner broke")
    failure = CheckpointException("save", {0: cause})
    with pytest.raises(
        CheckpointError, match=r"^the save of step 4 failed: RuntimeError: planner broke"
    ) as raised:
        _save(failure).result(timeout=5)
    assert raised.value.__cause__ is failure
    plain = ValueError("not a tensor")
    with pytest.raises(CheckpointError, match="ValueError: not a tensor") as raised:
        _save(plain).result(timeout=5)
    assert raised.value.__cause__ is plain


def test_the_s3ckpt_error_inside_is_raised_itself():
    missing = BucketNotFoundError("no such bucket: s3://b")
    with pytest.raises(BucketNotFoundError) as raised:
        _save(CheckpointException("save", {0: missing})).result(timeout=5)
    assert raised.value is missing
    with pytest.raises(BucketNotFoundError):
        _save(missing).result(timeout=5)


def test_a_timeout_or_a_cancelled_save_is_not_a_failure_of_it():
    with pytest.raises(TimeoutError):
        _save().result(timeout=0.01)
    cancelled = _save()
    cancelled.done.cancel()
    with pytest.raises(CancelledError):
        cancelled.result(timeout=5)
