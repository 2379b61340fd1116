"""Thread mode's GIL tuning behind one switch: on in the trainer's process, off in the
checkpoint process (its entry turns it off), and where it is off every piece takes the
plain path, with the same results."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from s3ckpt.dcp.local_plan import ReusingSavePlanner
from s3ckpt.dcp.writer import _let_go_of_state
from s3ckpt.transfer import thread_mode
from s3ckpt.transfer.thread_mode import (
    gil_tuned,
    joined,
    result_of,
    tune_for_gil,
)


@pytest.fixture
def switched_off() -> Iterator[None]:
    tune_for_gil(False)
    try:
        yield
    finally:
        tune_for_gil(True)


def test_the_switch_is_on_in_the_trainers_process() -> None:
    tune_for_gil(True)
    assert gil_tuned()


def test_switched_off_a_done_future_is_wrapped_as_asyncio_does(switched_off: None) -> None:
    async def main() -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        wakeups = [0]
        original = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
            wakeups[0] += 1
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        done: Future[str] = Future()
        done.set_result("upload-id")
        return await result_of(done), wakeups[0]

    result, wakeups = asyncio.run(main())
    assert result == "upload-id" and wakeups == 1


@pytest.mark.parametrize("tuned", [True, False], ids=["on", "off"])
def test_pieces_are_joined_byte_for_byte_either_way(tuned: bool) -> None:
    tune_for_gil(tuned)
    try:
        a, b = bytearray(os.urandom(10_000)), bytearray(os.urandom(3))
        pieces = [memoryview(a)[10:5_000], memoryview(b), memoryview(bytearray()), memoryview(a)]
        assert joined(pieces) == b"".join(pieces)
        assert joined([memoryview(b"xy"), memoryview(b"z")]) == b"xyz"
    finally:
        tune_for_gil(True)


def test_switched_off_the_planner_plans_every_save_as_the_default_does(
    switched_off: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.randn(4, 4), "b": torch.zeros(4), "step": 3}
    reusing = ReusingSavePlanner()
    pinned = [0]
    original = torch.Tensor.is_pinned

    def counting(self: torch.Tensor, *args: object, **kwargs: object) -> bool:
        pinned[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", counting)
    plans = []
    for _ in range(2):
        pinned[0] = 0
        reusing.set_up_planner(state, is_coordinator=True)
        plans.append(reusing.create_local_plan())
        assert pinned[0] > 0  # DCP's own description, every save
        global_plans, _ = reusing.create_global_plan([plans[-1]])
        assert reusing.resolve_data(global_plans[0].items[0]) is not None
    default = DefaultSavePlanner()
    default.set_up_planner(state, is_coordinator=True)
    assert plans[0] == plans[1] == default.create_local_plan()
    _let_go_of_state(reusing)
    assert reusing.state_dict  # nothing to free on the caller's thread in this process


def test_switched_on_the_writer_lets_go_of_the_state() -> None:
    tune_for_gil(True)
    reusing = ReusingSavePlanner()
    reusing.set_up_planner({"w": torch.randn(2)}, is_coordinator=True)
    _let_go_of_state(reusing)
    assert reusing.state_dict == {}
    assert thread_mode.gil_tuned()
