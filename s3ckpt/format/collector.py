"""Building a save's records with the cyclic garbage collector paused.

A save builds a few large object graphs that live for milliseconds: DCP's metadata
unpickled to check that it loads (:func:`s3ckpt.dcp.metadata_pickle.check_loadable`, tens
of thousands of objects for a few hundred items), the same metadata pickled, and a rank's
index as dicts before its JSON. Built with the collector running, each burst of
allocations set off young collections while the graph was alive, and every one of them
moved the whole graph a generation up; a few saves of that and the interpreter ran a full
collection of the trainer's heap, with the GIL held on s3ckpt's thread while a training
loop beside a thread-mode save waits (docs/decisions/0008-thread-mode-gil.md).

None of these graphs holds a reference cycle: reference counting frees them the moment
the record is built, and the interpreter's allocation count falls back as they go. So
they are built with automatic collection paused, and nothing is left for the collector
to do. The pause is process-wide (the collector has no other switch): threads building
at once share one pause, and collection resumes when the last one is done, unless it was
off when the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_builders = 0
_resume = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic garbage collection off while the block runs (see the module docstring)."""
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
