"""A writer that records, where it writes, whether the engine there tunes for the GIL
(:func:`s3ckpt.transfer.thread_mode.gil_tuned`). The checkpoint process imports this
module by name (the trainer's ``sys.path`` travels with it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from s3ckpt import S3StorageWriter
from s3ckpt.transfer.thread_mode import gil_tuned


class SwitchReporting(S3StorageWriter):
    """Writes ``on`` or ``off`` to ``marker`` when its ``write_data`` runs."""

    def __init__(self, uri: str, marker: str, **options: Any) -> None:
        super().__init__(uri, **options)
        self.marker = marker

    def write_data(self, plan: Any, planner: Any) -> Any:
        Path(self.marker).write_text("on" if gil_tuned() else "off")
        return super().write_data(plan, planner)
