"""What long catalog operations report their progress to.

Verify, prune and gc can run for minutes over many objects. They call a :class:`Reporter`
and never print: the CLI passes its progress bar (:class:`s3ckpt.cli.progress.Progress`),
library callers get :data:`SILENT` unless they ask for output.
"""

from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    """What long catalog operations call: ``start`` once, ``advance`` many, ``finish`` once."""

    def start(self, label: str, total: int, unit: str) -> None: ...
    def advance(self, amount: int) -> None: ...
    def finish(self) -> None: ...


class _Silent:
    def start(self, label: str, total: int, unit: str) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass


SILENT: Reporter = _Silent()
