"""How s3ckpt calls DCP itself: a save without what ``dcp.save`` adds around its plan
(DCP's private ``_save_state_dict``), a single-process call without DCP's warning, and
stopping the background process of DCP's process-mode ``async_save``."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageWriter


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """A ``dcp.load``/``dcp.save`` asked to run on this process alone (``no_dist``), without
    the warning DCP gives every such call: here it is the intent, not a guess."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_plain(
    state_dict: dict[str, Any],
    storage_writer: StorageWriter,
    *,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
) -> Metadata:
    """``dcp.save`` of a state dict that holds no ``Stateful`` (a staged copy), through
    DCP's private ``_save_state_dict``: the same plan, collectives and storage lifecycle,
    without what ``dcp.save`` adds before it. ``dcp.save`` wraps each top-level value's
    ``state_dict()`` call in its method logger, which builds a ``uuid4`` (a ``getrandom``
    system call, so a release and retake of the GIL) and two log records per key: one
    retake per top-level key, from a thread beside the training loop in thread mode
    (docs/decisions/0008-thread-mode-gil.md). Where the private function is gone,
    ``dcp.save`` itself."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_saver

    save = getattr(state_dict_saver, "_save_state_dict", None)
    if save is None:
        with single_process() if no_dist else contextlib.nullcontext():
            return dcp.save(
                state_dict, storage_writer=storage_writer, planner=planner,
                process_group=process_group, no_dist=no_dist,
            )  # fmt: skip
    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    return save(
        state_dict=state_dict, storage_writer=storage_writer, planner=planner,
        process_group=process_group, no_dist=no_dist,
    )  # fmt: skip


def stop_async_save_process(timeout: float = 30.0) -> bool:
    """Stop DCP's process-mode ``async_save`` background process, if one is running.

    DCP starts that process on the first process-mode save and offers no public way to
    stop it; it would otherwise live until the interpreter exits. Uses DCP's private
    module; returns whether a process was stopped. ``tests/unit/dcp/test_compat.py`` pins the
    names used.
    """
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is None:
        return False
    try:
        process._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process._save_process.join(timeout=timeout)
    finally:
        if process._save_process.is_alive():
            process._save_process.terminate()
        executor._CHECKPOINT_PROCESS = None
    return True
