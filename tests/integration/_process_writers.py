"""Writers the checkpoint-process tests hand to the checkpoint process, which imports this
module by name (the trainer's ``sys.path`` travels with it)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from s3ckpt import S3StorageWriter


class HeldAfterUpload(S3StorageWriter):
    """Uploads its objects, then writes ``marker`` and waits before the commit: a test
    kills the checkpoint process there, with every object written and nothing committed."""

    def __init__(self, uri: str, marker: str, **options: Any) -> None:
        super().__init__(uri, **options)
        self.marker = marker

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        written.wait()  # a torch.futures.Future: every object of this rank is written
        Path(self.marker).touch()
        time.sleep(600)  # killed long before
        return written


class StallOnThirdSave(S3StorageWriter):
    """The third save of this (checkpoint) process uploads its objects, leaves
    ``stalled-rank<R>`` (holding its location) in the folder named by the environment
    variable :attr:`MARKERS`, and stalls before its commit, for a test to kill it there."""

    MARKERS = "S3CKPT_TEST_STALL_MARKERS"
    saves = 0

    def write_data(self, plan: Any, planner: Any) -> Any:
        import torch.distributed as dist

        StallOnThirdSave.saves += 1
        written = super().write_data(plan, planner)
        if StallOnThirdSave.saves == 3:
            written.wait()  # this rank's objects are written
            rank = dist.get_rank() if dist.is_initialized() else 0
            marker = Path(os.environ[self.MARKERS]) / f"stalled-rank{rank}"
            marker.write_text(str(self.location))
            time.sleep(120)
        return written


class StalledInSecondPart(S3StorageWriter):
    """Every multipart upload's first part goes through; the second leaves ``marker`` and
    stalls, for a test to kill the checkpoint process with uploads open. The patch is
    made where the writer runs: in the checkpoint process."""

    def __init__(self, uri: str, marker: str, **options: Any) -> None:
        super().__init__(uri, **options)
        self.marker = marker

    def write_data(self, plan: Any, planner: Any) -> Any:
        import asyncio

        from s3ckpt.s3.multipart import MultipartUploads

        original, marker = MultipartUploads.upload_part, self.marker
        original_batch = MultipartUploads.try_parts

        async def stall() -> None:
            Path(marker).touch()
            await asyncio.sleep(600)

        async def stalled(
            store: Any, key: str, upload_id: str, number: int, *rest: Any, **options: Any
        ) -> Any:
            if number >= 2:
                await stall()
            return await original(store, key, upload_id, number, *rest, **options)

        async def stalled_batch(store: Any, key: str, upload_id: str, batch: Any) -> Any:
            if any(number >= 2 for number, _, _ in batch):  # the upload open, parts unsent
                await stall()
            return await original_batch(store, key, upload_id, batch)

        MultipartUploads.upload_part = stalled  # type: ignore[method-assign]
        MultipartUploads.try_parts = stalled_batch  # type: ignore[method-assign]
        return super().write_data(plan, planner)
