"""Writers the checkpoint-process tests hand to the checkpoint process, which imports this
module by name (the trainer's ``sys.path`` travels with it)."""

from __future__ import annotations

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
