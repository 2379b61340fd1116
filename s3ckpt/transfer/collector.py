"""A save's short-lived records built with automatic garbage collection paused.

DCP's metadata (checked and pickled) and a rank's index are graphs of many small objects,
built and dropped at once: their allocations would set off collections of the whole heap,
a trainer's or a checkpoint process's with torch imported, with the GIL held, during the
save. Paused in both modes: in thread mode the training loop waits for those collections,
in the checkpoint process the save does (docs/decisions/0008-thread-mode-gil.md).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# None of these graphs holds a reference cycle: reference counting frees them the moment
# the record is built. The pause is process-wide (the collector has no other switch):
# threads building at once share one pause, and collection resumes when the last one is
# done, unless it was off when the first began.

_lock = threading.Lock()
_builders = 0
_resume = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic garbage collection off while the block runs."""
    global _builders, _resume
    with _lock:
        if _builders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _builders += 1
    try:
        yield
    finally:
        with _lock:
            _builders -= 1
            if _builders == 0 and _resume:
                gc.enable()
