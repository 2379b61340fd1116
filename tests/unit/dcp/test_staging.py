"""HostStager: host copies whose buffers are kept from save to save."""

from __future__ import annotations

import torch
from slotted import Slotted

from s3ckpt import HostStager


class Config:
    """A class object in the state: what broke torch's DefaultStager on its second stage."""


def state(step: float) -> dict:
    weights = torch.full((64, 32), step)
    return {
        "model": {"w": weights, "w_t": weights.t(), "b": torch.arange(5) + int(step)},
        "extra": {"cls": Config, "step": int(step), "names": ("a", "b"), "none": None},
    }


def test_each_stage_is_a_copy_of_the_call_and_reuses_the_buffers():
    stager = HostStager()
    live = state(1.0)
    first = stager.stage(live)
    first_ptr = first["model"]["w"].data_ptr()
    assert torch.equal(first["model"]["w"], torch.full((64, 32), 1.0))
    live["model"]["w"].fill_(2.0)  # the next training step, after staging
    assert torch.equal(first["model"]["w"], torch.full((64, 32), 1.0))
    second = stager.stage(live)
    assert second["model"]["w"].data_ptr() == first_ptr  # same buffer, new values
    assert torch.equal(second["model"]["w"], torch.full((64, 32), 2.0))
    assert second["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()
    stager.close()


def test_views_share_their_staged_storage_and_other_values_survive():
    stager = HostStager()
    for step in (1.0, 2.0, 3.0):
        staged = stager.stage(state(step))
        model = staged["model"]
        assert torch.equal(model["w_t"], model["w"].t())
        assert model["w_t"].untyped_storage().data_ptr() == model["w"].untyped_storage().data_ptr()
        assert torch.equal(model["b"], torch.arange(5) + int(step))
        assert staged["extra"] == {
            "cls": Config,
            "step": int(step),
            "names": ("a", "b"),
            "none": None,
        }
    stager.close()


def test_dcp_is_told_there_is_nothing_to_wait_for_after_stage():
    """stage() returns a complete copy, so DCP must not call back to wait for one."""
    stager = HostStager(pin_memory=False)
    assert stager.should_synchronize_after_execute is False
    stager.synchronize_staging()  # nothing pending: returns at once
    stager.close()


def test_the_devices_to_synchronize_are_those_the_copies_came_from():
    """Every storage copied is recorded, wherever it sits (here in slots and attributes),
    and only those of the last stage."""
    stager = HostStager(pin_memory=False)
    staged = stager.stage({"shard": Slotted(torch.ones(3)), "t": torch.zeros(2)})
    assert torch.equal(staged["shard"].tensor, torch.ones(3))
    assert stager._copier.devices == {torch.device("cpu")}
    stager.stage({"step": 3})
    assert stager._copier.devices == set()
    stager.close()


def test_async_save_with_a_host_stager_saves_each_calls_values(tmp_path):
    import torch.distributed.checkpoint as dcp

    stager = HostStager()
    weights = torch.zeros(1000)
    for step in (1, 2, 3):
        weights.fill_(step)
        future = dcp.async_save({"w": weights}, checkpoint_id=tmp_path / str(step),
                                async_stager=stager, no_dist=True)  # fmt: skip
        weights.fill_(-1)
        getattr(future, "upload_completion", future).result()
    for step in (1, 2, 3):
        loaded = {"w": torch.empty(1000)}
        dcp.load(loaded, checkpoint_id=tmp_path / str(step), no_dist=True)
        assert torch.all(loaded["w"] == step)
    stager.close()
