"""Bit-exact comparison of restored training state, for the trainers' tests."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(got: Any, want: Any, where: str = "state", *, key_order: bool = False) -> None:
    """Equal bit for bit, with the same container types all the way down; ``key_order``:
    dicts also keep their keys, and the keys' types, in the same order."""
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        if key_order:
            assert list(got) == list(want), where
        else:
            assert sorted(map(str, got)) == sorted(map(str, want)), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]", key_order=key_order)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{index}]", key_order=key_order)
    else:
        assert got == want, where
