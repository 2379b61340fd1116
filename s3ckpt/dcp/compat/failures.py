"""How a rank's failure travels through DCP: the error inside its ``CheckpointException``,
the metadata-read failure ``dcp.load`` replaces with an ``AssertionError``, the frame of
``dcp.load`` that asks a reader for the metadata, and DCP's wrapping of a rank's failure
among gathered results."""

from __future__ import annotations

import functools
import threading
from types import CodeType, FrameType
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata


def unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised inside DCP's ``CheckpointException``, else ``exc`` itself.

    ``dcp.save``/``dcp.load`` collect each rank's exception into a ``CheckpointException``
    (a ``BaseException``); this returns the first failing rank's original s3ckpt error so
    callers can match on the documented hierarchy. ``dcp.load`` replaces a failure to read
    the metadata (no checkpoint, no access...) with its own ``AssertionError("metadata is
    None; ...")``, which quotes the message only; the reader records the original on its
    thread (:func:`remember_metadata_failure`), and it is returned here.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
    recorded = _metadata_failures.get(threading.get_ident())
    if isinstance(exc, AssertionError) and recorded is not None and str(recorded) in str(exc):
        return recorded
    return exc


_metadata_failures: dict[int, BaseException] = {}


def read_by_dcp_load(caller: FrameType | None) -> bool:
    """Whether ``caller``, the frame that called a reader's ``read_metadata``, is the
    planning step of ``dcp.load`` (``local_step`` in DCP's private ``_load_state_dict``).

    DCP catches a failure raised there, logs it on the root logger as a warning with its
    whole traceback ("Global metadata is not found. Falling back to rank local
    metadata."), then raises ``AssertionError("metadata is None; ...")`` in its place.
    A reader called from there returns :func:`stand_in_metadata` instead and raises its
    error from ``set_up_storage_reader``, DCP's next call, outside that ``try``: DCP then
    hands the error itself to every rank, and logs nothing. False on a torch whose
    ``_load_state_dict`` has no such step (the reader raises then, as anywhere else).
    """
    return caller is not None and caller.f_code is _dcp_load_step()


@functools.cache
def _dcp_load_step() -> CodeType | None:
    import inspect

    from torch.distributed.checkpoint import state_dict_loader

    load = getattr(state_dict_loader, "_load_state_dict", None)
    code = getattr(inspect.unwrap(load), "__code__", None) if load is not None else None
    for const in code.co_consts if code is not None else ():
        if isinstance(const, CodeType) and const.co_name == "local_step":
            return const
    return None


def stand_in_metadata() -> Metadata:
    """An empty ``Metadata``: what a reader whose metadata read failed gives ``dcp.load``'s
    planning step (:func:`read_by_dcp_load`); the planner only keeps it, and the reader
    raises its error at DCP's next call."""
    return Metadata(state_dict_metadata={})


def wrap_exception(exc: BaseException) -> Any:
    """``exc`` as DCP carries a rank's failure among gathered results (its private
    ``_wrap_exception``): what Megatron's async save finalization looks for in the write
    results of each rank (``_get_failure_dict``)."""
    from torch.distributed.checkpoint.api import _wrap_exception

    return _wrap_exception(exc)


def remember_metadata_failure(error: BaseException | None) -> None:
    """Record (or, with ``None``, clear) this thread's last metadata-read failure."""
    if error is None:
        _metadata_failures.pop(threading.get_ident(), None)
    else:
        _metadata_failures[threading.get_ident()] = error
