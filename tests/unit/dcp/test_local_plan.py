"""ReusingSavePlanner: DCP's default local plan, made once per layout of the state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from s3ckpt.dcp.local_plan import ReusingSavePlanner, state_layout


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.randn(8, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "optim": {"step": 3, "lr": [0.1, 0.2], "m": torch.ones(2, 2, dtype=torch.float64)},
        "flag": torch.tensor(True),
        "param": torch.nn.Parameter(torch.randn(3)),
    }


def _plans(planner: Any, state: dict[str, Any]) -> Any:
    planner.set_up_planner(state, is_coordinator=True)
    return planner.create_local_plan()


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Count calls of ``owner.name`` (a method) from now on."""
    calls = [0]
    original = getattr(owner, name)

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def _count_is_pinned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return _count_calls(monkeypatch, torch.Tensor, "is_pinned")


def test_every_save_gets_the_default_planners_plan_and_later_ones_ask_no_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = _state()
    reusing = ReusingSavePlanner()
    calls = _count_is_pinned(monkeypatch)
    first = _plans(reusing, state)
    assert calls[0] > 0  # the first plan is DCP's own
    for _ in range(3):
        calls[0] = 0
        plan = _plans(reusing, state)
        assert calls[0] == 0  # no tensor call that releases the GIL
        assert plan == _plans(DefaultSavePlanner(), state) == first
        assert plan.planner_data == first.planner_data  # the flattening's mappings
        assert reusing.plan is plan


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["model"].__setitem__("w", torch.randn(8, 5)),  # shape
        lambda s: s["model"].__setitem__("b", torch.zeros(4)),  # dtype
        lambda s: s["model"].__setitem__("w", s["model"]["w"].clone()),  # memory
        lambda s: s["model"].__setitem__("w", s["model"]["w"].requires_grad_()),
        lambda s: s["optim"]["m"].t_(),  # strides: the same memory, transposed in place
        lambda s: s["optim"].__setitem__("extra", 7),  # a new value
        lambda s: s["optim"].pop("m"),  # a value gone
        lambda s: s.__setitem__("flag", False),  # a tensor became an object
    ],
)
def test_a_state_whose_layout_changed_is_planned_again(change: Any) -> None:
    state = _state()
    reusing = ReusingSavePlanner()
    _plans(reusing, state)
    change(state)
    assert _plans(reusing, state) == _plans(DefaultSavePlanner(), state)


def test_pinned_memory_is_recorded_as_it_is() -> None:
    """Pinning belongs to the allocation, which the layout names by its address."""
    if not torch.cuda.is_available():
        state = {"w": torch.randn(4)}
        plan = _plans(ReusingSavePlanner(), state)
        assert plan.items[0].tensor_data.properties.pin_memory is False
        return
    pinned, pageable = torch.randn(4).pin_memory(), torch.randn(4)
    reusing = ReusingSavePlanner()
    for tensor, expected in ((pinned, True), (pageable, False), (pinned, True)):
        plan = _plans(reusing, {"w": tensor})
        assert plan.items[0].tensor_data.properties.pin_memory is expected


def test_a_tensor_subclass_is_planned_at_every_save() -> None:
    class Marked(torch.Tensor):
        pass

    state = {"w": torch.randn(4).as_subclass(Marked)}
    assert state_layout(state) is None
    assert _plans(ReusingSavePlanner(), state) == _plans(DefaultSavePlanner(), state)


def test_a_state_with_a_sharded_value_is_planned_at_every_save() -> None:
    class Checkpointable:
        """DCP's ``_Checkpointable`` protocol: it makes its own write items."""

        def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
            return []

    assert state_layout({"w": torch.randn(2), "shard": Checkpointable()}) is None


def test_letting_go_of_the_state_keeps_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    reusing = ReusingSavePlanner()
    first = _plans(reusing, state)
    reusing.let_go()
    assert reusing.state_dict == {}  # no tensor of the last save held any more
    calls = _count_is_pinned(monkeypatch)
    assert _plans(reusing, state) == first and calls[0] == 0


def _global(planner: Any, plans: list[Any]) -> Any:
    return planner.create_global_plan(plans)


def _count_global_planning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return _count_calls(monkeypatch, DefaultSavePlanner, "create_global_plan")


def test_the_global_plan_of_unchanged_local_plans_is_handed_out_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = _state()
    reusing = ReusingSavePlanner()
    calls = _count_global_planning(monkeypatch)
    first_plans, first_metadata = _global(reusing, [_plans(reusing, state)])
    assert calls[0] == 1
    for _ in range(3):
        calls[0] = 0
        plans, metadata = _global(reusing, [_plans(reusing, state)])
        assert calls[0] == 0  # no deduplication, no metadata made, no validation
        default = DefaultSavePlanner()
        expected_plans, expected_metadata = _global(default, [_plans(default, state)])
        assert plans == expected_plans == first_plans
        assert metadata == expected_metadata == first_metadata
        assert (reusing.global_plan, reusing.metadata) == (plans, metadata)


def test_each_save_gets_metadata_of_its_own() -> None:
    """The storage fills a save's metadata in (its record); the next save's starts clean,
    whether the one filled in was planned or handed out again."""
    state = _state()
    reusing = ReusingSavePlanner()
    saves = [_global(reusing, [_plans(reusing, state)])[1]]
    for _ in range(3):
        filled = saves[-1]
        filled.storage_data = "a save's record"
        filled.state_dict_metadata["added"] = filled.state_dict_metadata["flag"]
        filled.planner_data["added"] = ("added",)
        saves.append(_global(reusing, [_plans(reusing, state)])[1])
        fresh = saves[-1]
        assert all(fresh is not earlier for earlier in saves[:-1])
        assert fresh.storage_data is None
        assert "added" not in fresh.state_dict_metadata and "added" not in fresh.planner_data


def test_a_changed_rank_plan_is_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans gathered from other ranks are compared as values: one changed, all replanned."""
    import copy

    state, other = _state(), {"other": torch.randn(5)}
    reusing = ReusingSavePlanner()
    ours = _plans(reusing, state)
    theirs = _plans(ReusingSavePlanner(), other)
    _global(reusing, [ours, copy.deepcopy(theirs)])
    calls = _count_global_planning(monkeypatch)
    _global(reusing, [_plans(reusing, state), copy.deepcopy(theirs)])  # unpickled anew
    assert calls[0] == 0
    grown = _plans(ReusingSavePlanner(), {**other, "more": torch.randn(2)})
    plans, metadata = _global(reusing, [_plans(reusing, state), grown])
    assert calls[0] == 1
    assert "more" in metadata.state_dict_metadata
    default = DefaultSavePlanner()
    assert plans == _global(default, [_plans(default, state), grown])[0]


def test_dcps_own_plan_caching_plans_as_dcp_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    if "enable_plan_caching" not in inspect.signature(DefaultSavePlanner.__init__).parameters:
        pytest.fail("this torch's DefaultSavePlanner has no enable_plan_caching")
    state = _state()
    reusing = ReusingSavePlanner(enable_plan_caching=True)
    reusing._cached_plans_key = "test_dcps_own_plan_caching"  # DCP keeps its caches per class
    calls = _count_global_planning(monkeypatch)
    for _ in range(2):
        _global(reusing, [_plans(reusing, state)])
    assert calls[0] == 2  # every call goes to DCP, which decides what it reuses


def test_items_resolve_to_what_the_default_planner_resolves() -> None:
    """Plain tensors and parameters are read straight from the state dict; bytes, a
    tensor subclass and an offset off the origin go the default planner's way, which
    resolves (or refuses) them the same."""

    class Marked(torch.Tensor):
        pass

    state = _state() | {"marked": torch.randn(2).as_subclass(Marked)}
    ours, theirs = ReusingSavePlanner(), DefaultSavePlanner()
    plan = _plans(ours, state)
    assert plan == _plans(theirs, state)
    for item in plan.items:
        mine, default = ours.resolve_data(item), theirs.resolve_data(item)
        if isinstance(default, torch.Tensor):
            assert mine is default
        else:
            assert mine.getvalue() == default.getvalue()  # the pickled bytes of a value
    tensor_item = next(i for i in plan.items if i.index.fqn == "model.w")
    off_origin = type(tensor_item)(
        index=type(tensor_item.index)("model.w", torch.Size([1, 0])),
        type=tensor_item.type,
        tensor_data=tensor_item.tensor_data,
    )
    for planner in (ours, theirs):
        with pytest.raises(ValueError, match="can't find by offset"):
            planner.resolve_data(off_origin)
        with pytest.raises(ValueError, match="Could not find FQN"):
            planner.resolve_data(type(tensor_item)(
                index=type(tensor_item.index)("nope", torch.Size([0, 0])),
                type=tensor_item.type, tensor_data=tensor_item.tensor_data,
            ))  # fmt: skip


def test_a_subclass_that_transforms_items_is_asked_for_every_item() -> None:
    class Doubling(ReusingSavePlanner):
        def transform_object(self, write_item: Any, object: Any) -> Any:
            return object * 2 if isinstance(object, torch.Tensor) else object

    state = {"w": torch.ones(3)}
    planner = Doubling()
    plan = _plans(planner, state)
    assert torch.equal(planner.resolve_data(plan.items[0]), torch.full((3,), 2.0))
