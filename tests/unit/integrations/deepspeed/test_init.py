"""Without DeepSpeed, importing its integration says which extra to install."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_without_deepspeed_the_integration_names_its_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails
    for name in ("s3ckpt.integrations.deepspeed", "s3ckpt.integrations.deepspeed.compat"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=r"pip install './s3ckpt\[deepspeed\]'"):
        importlib.import_module("s3ckpt.integrations.deepspeed")
