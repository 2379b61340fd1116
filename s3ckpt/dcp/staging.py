"""``HostStager``: the copy of a state dict to host memory that an async save blocks on.

``dcp.async_save`` and :class:`s3ckpt.CheckpointManager` block the training loop only
while the state is copied off the accelerator; the upload runs in the background from the
copy. To keep that stall close to a bare device-to-host copy:

* **buffers are kept from save to save**: each tensor storage is copied into a host buffer
  cached (weakly, by source storage) by DCP's own copier, so a steady-state save allocates
  and pins nothing;
* **pinned and non-blocking with an accelerator**: copies into page-locked buffers are
  queued without waiting, then one ``synchronize`` per device holding tensors of the
  state waits for all of them;
* **shared memory** for process-mode saves, which hand the copy to another process.

Why not torch's ``DefaultStager``: several torch releases (2.11 among them) make it close
its copier after every stage, which frees the buffers (no reuse: each save allocates and
pins its whole state again) and makes the second stage of a dict fail with
``KeyError: <class 'type'>``. ``HostStager`` keeps one copier until :meth:`close`.

The contract of reused buffers, as with ``DefaultStager``: a save must finish uploading
before the next one stages (the buffers hold the copy being uploaded).
``CheckpointManager`` enforces that; callers of ``dcp.async_save`` wait on the previous
save's future first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.stateful import Stateful

from s3ckpt.dcp.compat import storage_copier


class HostStager(AsyncStager):
    """Stages state dicts into host buffers that are kept and reused across saves.

    ``pin_memory`` defaults to whether CUDA is available (page-locked memory is a CUDA
    host allocation); ``share_memory`` is for process-mode ``async_save``. Pass it as
    ``dcp.async_save(..., async_stager=HostStager())``; :meth:`close` frees the buffers.
    """

    # The copy is complete when stage() returns: nothing to wait for after execute.
    _synchronize_after_execute = False

    def __init__(self, *, pin_memory: bool | None = None, share_memory: bool = False) -> None:
        accelerator = torch.accelerator.current_accelerator()
        self._accelerator = None if accelerator is None else accelerator.type
        self._copier = storage_copier(
            pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
            share_memory=share_memory,
        )
        self._staged: Any = None  # the last copy, kept until the next stage (see stage)

    def stage(self, state_dict: Any) -> Any:
        """Copy ``state_dict`` to host memory; returns once every byte has landed.

        The previous copy's tensor objects (not their buffers, which are reused) are
        freed here, on the caller's thread between saves, not on the upload's thread
        beside the training loop: freeing a tensor lets the GIL go and takes it back, one
        hand-over per tensor there (docs/decisions/0008-thread-mode-gil.md)."""
        self._staged = None
        try:
            self._staged = self._copier.stage(
                state_dict, non_blocking=self._accelerator is not None
            )
            return self._staged
        finally:  # even after a failure: no copy may still run into a buffer freed later
            for device in self._copier.devices:  # each one copied from, not the current only
                if device.type == self._accelerator:
                    torch.accelerator.synchronize(device)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns a complete copy."""

    def close(self) -> None:
        """Free the cached host buffers; the stager must not be used afterwards."""
        self._staged = None
        self._copier.close()


class AlreadyStaged(AsyncStager):
    """Hands ``dcp.async_save`` a state dict its caller staged already (with a
    :class:`HostStager`), so that the caller sees a failed copy before DCP starts a save."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: the caller's copy is complete."""


def plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each :class:`Stateful` entry replaced by its ``state_dict()``,
    as DCP does before it stages or saves: the values of the call, ready to copy."""
    return {
        # a tensor first: Stateful is a runtime-checked protocol, a slow isinstance
        key: value.state_dict()
        if not isinstance(value, torch.Tensor) and isinstance(value, Stateful)
        else value
        for key, value in state_dict.items()
    }
