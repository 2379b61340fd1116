"""Everything s3ckpt takes from Lightning beyond its public API, in one place.

The S3 strategies mirror what Lightning's own sharded strategies do around
``dcp.save``/``dcp.load``; these are the private pieces of Lightning they reuse, so that
the state they save and restore is exactly Lightning's (pinned by
``tests/integration/test_lightning_sharded.py``):

* ``lightning.fabric.strategies.fsdp._get_sharded_state_dict_context``: the
  ``SHARDED_STATE_DICT`` context FSDP (version 1) reads and loads sharded state in;
* ``LightningOptimizer._optimizer``: the optimizer a ``LightningOptimizer`` wraps (what
  ``torch.distributed.checkpoint.state_dict`` needs);
* ``lightning.fabric.strategies.strategy._validate_keys_for_strict_loading``: Fabric's
  error for a requested key the checkpoint lacks.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.pytorch.core.optimizer import LightningOptimizer


def sharded_state_dict_context(module: torch.nn.Module) -> AbstractContextManager[Any]:
    """FSDP's sharded state-dict context for ``module``, as Lightning enters it."""
    return _get_sharded_state_dict_context(module)


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    if isinstance(optimizer, LightningOptimizer):
        return optimizer._optimizer
    return optimizer


def check_requested_keys(requested: Iterable[str], stored: Iterable[str], strict: bool) -> None:
    """Fabric's ``KeyError`` when ``strict`` and a requested key is not in the checkpoint."""
    _validate_keys_for_strict_loading(requested, stored, strict=strict)
