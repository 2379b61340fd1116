"""A tiny progress reporter: a redrawn bar on a terminal, plain lines in logs.

Verify, prune and gc can run for minutes over many objects; an operator at a terminal
wants a bar, while a CI log or a pipe wants occasional whole lines (a bar's carriage
returns turn a log into one huge line). Output goes to stderr so that ``--json`` on stdout
stays parseable. :class:`Progress` implements the catalog's
:class:`~s3ckpt.catalog.reporting.Reporter`.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from s3ckpt.cli.humanize import human_bytes

_BAR_WIDTH = 30


class Progress:
    """Reports to ``stream`` (stderr): a bar when it is a TTY, else a line every ``interval`` s.

    Thread-safe: deletes advance it from the I/O loop thread, verify from the caller's.
    """

    def __init__(
        self, stream: TextIO | None = None, *, tty: bool | None = None, interval: float = 5.0
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval if not self.tty else 0.1
        self._lock = threading.Lock()
        self.label, self.total, self.unit, self.done = "", 0, "", 0
        self._last = 0.0
        self._drawn = False
        self._shown = -1

    def start(self, label: str, total: int, unit: str) -> None:
        with self._lock:
            self.label, self.total, self.unit, self.done = label, total, unit, 0
            self._last = time.monotonic()
            self._drawn, self._shown = False, -1

    def advance(self, amount: int) -> None:
        with self._lock:
            self.done += amount
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                self._emit()

    def finish(self) -> None:
        with self._lock:
            if self._drawn:  # only operations long enough to have shown progress end with a line
                if self._shown != self.done:
                    self._emit()
                if self.tty:
                    self.stream.write("\n")
                    self.stream.flush()

    def _emit(self) -> None:
        self._drawn, self._shown = True, self.done
        fraction = self.done / self.total if self.total else 1.0
        text = (
            f"{self.label}: {self._amount(self.done)}/{self._amount(self.total)} ({fraction:.0%})"
        )
        if self.tty:
            filled = int(_BAR_WIDTH * min(fraction, 1.0))
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            self.stream.write(f"\r[{bar}] {text}\x1b[K")
        else:
            self.stream.write(f"s3ckpt: {text}\n")
        self.stream.flush()

    def _amount(self, n: int) -> str:
        return human_bytes(n) if self.unit == "bytes" else f"{n} {self.unit}"
