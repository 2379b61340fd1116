"""Thread mode's GIL tuning, in one place behind one switch: :func:`gil_tuned`.

In thread mode the engine runs in the trainer's process, and its threads share the
interpreter with the training loop: the loop waits each time one of them holds the GIL
and each time one of them takes it back. The pieces here trade simplicity for fewer
hand-overs and shorter holds there (docs/decisions/0008-thread-mode-gil.md); none of them
shortened a save in the checkpoint process, which shares its interpreter with no training
loop, so there the switch is off and the engine takes the plain path (the collector's
pause, which did, runs in both: :mod:`s3ckpt.transfer.collector`):

* :func:`result_of`: a future already done read at once on the I/O loop, without the
  thread-safe hand-off that wakes the loop through its self-pipe;
* :func:`joined`: parts packed from small items joined without holding the GIL where the
  C helper is not built (a ``memmove`` per piece into an uninitialized ``bytes``);
* the reuse of a save's plans (:class:`~s3ckpt.dcp.local_plan.ReusingSavePlanner`) and
  the writer's letting go of the state once its items are written
  (:mod:`s3ckpt.dcp.writer`), which read the switch here.

The switch is on wherever the engine runs, unless the process says otherwise: the
checkpoint process's entry (:mod:`s3ckpt.background.process_side`) turns it off with
:func:`tune_for_gil` before it imports anything that saves.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

_tuned = True


def gil_tuned() -> bool:
    """Whether the engine shares its interpreter with a training loop (thread mode): the
    switch of every piece in this module."""
    return _tuned


def tune_for_gil(on: bool) -> None:
    """Set the switch for this process: off where no training loop shares the
    interpreter (the checkpoint process)."""
    global _tuned
    _tuned = on


# -- results read on the I/O loop -------------------------------------------------------


async def result_of(future: Future[T]) -> T:
    """``future``'s result, on the I/O loop. Where :func:`gil_tuned`, one already done is
    read at once: wrapped (``asyncio.wrap_future``), its copy is set through
    ``call_soon_threadsafe``, which wakes the loop through its self-pipe even from the
    loop's own thread, a GIL hand-over for nothing beside the training loop."""
    if gil_tuned() and future.done() and not future.cancelled():
        return future.result()
    return await asyncio.wrap_future(future)


# -- parts joined from pieces where the C helper is not built ---------------------------
#
# ``bytes.join`` copies with the GIL held, milliseconds per part packed from small items,
# during which a training loop's thread cannot run. The C helper
# (:mod:`s3ckpt.transfer._gather`) copies every piece with the GIL released once
# (docs/decisions/0006-part-sizes.md). Without it, the bytes object is allocated
# uninitialized (``PyBytes_FromStringAndSize(NULL, n)``, as ``join`` itself does) and
# filled by ``memmove`` through ctypes, which releases the GIL once per piece.

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_BYTES_DATA = sys.getsizeof(b"") - 1  # the offset of a bytes object's data (ob_sval)


def joined(pieces: list[memoryview]) -> bytes:
    """The pieces' bytes as one ``bytes``: copied with the GIL released per piece where
    :func:`gil_tuned` and every piece is writable (ctypes reaches only writable buffers),
    else by ``bytes.join``."""
    if not gil_tuned() or any(piece.readonly for piece in pieces):
        return b"".join(pieces)
    return _copy_joined(pieces)


def _copy_joined(pieces: list[memoryview]) -> bytes:
    result = _new_bytes(None, sum(len(piece) for piece in pieces))
    at = id(result) + _BYTES_DATA
    for piece in pieces:
        if len(piece):
            ctypes.memmove(at, ctypes.addressof(ctypes.c_char.from_buffer(piece)), len(piece))
            at += len(piece)
    return result
