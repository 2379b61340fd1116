"""DCP's storage copier that keeps its staging buffers (its private ``StateDictStager``),
recording the devices it copied from and copying a ``DTensor`` as its local tensor."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class StorageCopier(Protocol):
    """DCP's ``StateDictStager``: deep-copies a state dict to host memory, each tensor
    storage into a host buffer cached (weakly, by source storage) for the next copy.
    ``devices``: the device of every storage the last :meth:`stage` copied."""

    devices: set[torch.device]

    def stage(self, state_dict: Any, non_blocking: bool = False) -> Any: ...

    def close(self) -> None: ...


def storage_copier(*, pin_memory: bool, share_memory: bool) -> StorageCopier:
    """DCP's private ``StateDictStager``, which its ``DefaultStager`` wraps.

    Used directly because some torch releases (2.11 among them) make ``DefaultStager``
    close this copier after every stage: that frees the cached buffers, so nothing is
    reused, and breaks the next stage of any dict (``KeyError: <class 'type'>``).

    It also records the device of each storage it copies, through the one method every
    copy goes through (``_stage_untyped_storage``): non-blocking copies are complete only
    once each of those devices is synchronized, and tensors sit where no walk of dicts
    and attributes finds them (a ``ShardedTensor`` reports the CPU, its shards hold the
    data in slots). ``tests/unit/dcp/test_compat.py`` pins the names used.

    A ``DTensor`` is copied as its local tensor and made again around the copy: DCP's own
    walk asks a tensor subclass for its storage when its ``data_ptr()`` is not 0, and a
    ``DTensor`` over a view that starts inside its storage (a shard cut from a larger
    tensor or buffer) reports its offset there, while the wrapper has no storage to give:
    the copy fails with "invalid python storage" (torch 2.13 and 2.15).
    """
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.tensor import DTensor

    class RecordingCopier(StateDictStager):
        def __init__(self) -> None:
            super().__init__(pin_memory=pin_memory, share_memory=share_memory)
            self.devices: set[torch.device] = set()

        def stage(self, state_dict: Any, non_blocking: bool = False) -> Any:
            self.devices = set()
            return super().stage(state_dict, non_blocking=non_blocking)

        def _stage_untyped_storage(self, storage: Any, non_blocking: bool = False) -> Any:
            self.devices.add(storage.device)
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)

        def _offload_tensor(self, x: Any, memo: Any, non_blocking: bool = False) -> Any:
            if not isinstance(x, DTensor):
                return super()._offload_tensor(x, memo, non_blocking=non_blocking)
            local = self.deepcopy_with_tensor_offload(x.to_local(), memo, [], non_blocking)
            # its own spec: ``from_local`` would move the host copy back to the mesh's device
            copied = DTensor(local, x._spec, requires_grad=False)
            memo[id(x)] = copied
            return copied

    return RecordingCopier()
