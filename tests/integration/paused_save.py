"""A save held between its uploads and its commit, for the tests of what maintenance and
the catalog do while a save is in flight."""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed.checkpoint as dcp


class PausedSave:
    """A save of ``state`` whose objects are written and whose commit waits until
    :meth:`release`; each wait is bounded by ``timeout_s``."""

    def __init__(self, writer: Any, state: dict[str, Any], timeout_s: float = 120) -> None:
        self.uploaded, self._go = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self._timeout_s = timeout_s
        commit = writer.finish

        def finish(metadata: Any, results: Any) -> Any:
            self.uploaded.set()
            assert self._go.wait(timeout_s)
            return commit(metadata, results)

        writer.finish = finish
        self.thread = threading.Thread(target=self._run, args=(writer, state))
        self.thread.start()
        assert self.uploaded.wait(timeout_s)

    def _run(self, writer: Any, state: dict[str, Any]) -> None:
        try:
            dcp.save(state, storage_writer=writer)
        except BaseException as exc:
            self.error = exc

    def release(self) -> None:
        self._go.set()
        self.thread.join(self._timeout_s)
        assert self.error is None, self.error
