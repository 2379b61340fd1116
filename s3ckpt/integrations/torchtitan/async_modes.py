"""What torchtitan expects of a save in each async mode, where the rank's checkpoint
process does the staging and the upload."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer import AsyncMode


def as_torchtitan_expects(upload: Future[Any], async_mode: Any) -> Any:
    """``async``: the upload's future; ``async_with_pinned_mem``: a response whose
    staging is already complete (the copy is done when the save returns)."""
    if async_mode == AsyncMode.ASYNC:
        return upload
    staged: Future[None] = Future()
    staged.set_result(None)
    return AsyncSaveResponse(staging_completion=staged, upload_completion=upload)


class StagedByTheCheckpointProcess:
    """Stands in torchtitan's ``stager`` slot: the checkpoint process does the staging."""

    def close(self) -> None:
        """Nothing to release: the checkpoint process owns the staging memory."""
