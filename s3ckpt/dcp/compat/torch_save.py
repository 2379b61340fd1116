"""How to lay out a ``torch.save`` file without its tensors' bytes (for export): torch's
private ``FakeTensorMode`` and ``torch.serialization.skip_data``."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def save_skeleton(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], path: str) -> None:
    """A ``torch.save`` file of ``{name: tensor}`` with every tensor's bytes left out.

    The file has the final layout (pickle, one ``data/<n>`` zip record per tensor, in dict
    order, sized for its bytes) but no tensor is ever allocated: fake tensors stand in, and
    ``torch.serialization.skip_data`` leaves their records empty, for the export to fill
    in as the real tensors arrive. Relies on torch's private ``FakeTensorMode``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in tensors}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fake, path)
