"""Python's cyclic garbage collector during a transfer.

A load creates several objects per item (plans, read targets, futures). Every so often
that allocation triggers a full collection, which walks every object the process holds,
torch's modules and DCP's metadata included: 0.15 to 0.4 s in a process with torch
imported, all of it holding the GIL, so the event loop stops receiving and the decode
workers stop handing work on. :func:`frozen_heap` moves the objects that exist when a load
starts out of the collector's reach (``gc.freeze``) and back when it ends, so collections
during the load only walk what the load itself allocated. Nothing goes uncollected: the
frozen objects are collected as before once they are back.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collections inside the block skip the objects that existed before it.

    Left alone when the collector is disabled or objects are already frozen (by the
    application, or by a load running in another thread): unfreezing those would undo a
    freeze that is not ours.
    """
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
