"""process_group.carriage: how a shared range travels, from the group's backend and the
destination's device type alone (every rank decides alike)."""

from __future__ import annotations

import pytest

from s3ckpt.dcp.process_group import Carry, carriage
from s3ckpt.transfer.shares import plan_shares

HOST, DEVICE = Carry.HOST, Carry.DEVICE


@pytest.mark.parametrize(
    ("backend", "cpu", "cuda"),
    [
        ("gloo", HOST, HOST),  # gloo sends host memory only: CUDA destinations as today
        ("cpu:gloo", HOST, HOST),  # get_backend_config of a gloo group on a CPU build
        ("cpu:gloo,cuda:gloo", HOST, HOST),
        ("cpu:gloo,cuda:nccl", HOST, DEVICE),  # a mixed load: each destination its way
        ("cuda:nccl,cpu:gloo", HOST, DEVICE),  # the order of the pairs does not matter
        ("CPU:Gloo, CUDA:NCCL", HOST, DEVICE),
        ("nccl", None, DEVICE),  # NCCL carries no host tensors: CPU ranges are not shared
        ("cuda:nccl", None, DEVICE),
        ("mpi", HOST, HOST),
        ("ucc", HOST, HOST),
    ],
)
def test_each_destination_travels_as_its_groups_backend_allows(backend, cpu, cuda) -> None:
    assert carriage(backend, "cpu") is cpu
    assert carriage(backend, "cuda") is cuda


def test_a_device_no_backend_carries_falls_back_to_host_memory() -> None:
    assert carriage("cpu:gloo,cuda:nccl", "xpu") is HOST
    assert carriage("cpu:gloo,xpu:xccl", "xpu") is HOST  # only NCCL is known to carry
    assert carriage("nccl", "xpu") is None  # and an NCCL-only group carries no host tensors


def test_plans_of_one_load_number_their_tags_apart() -> None:
    span = ("data/a", 0, 10)
    first = plan_shares([[span], [span]])
    second = plan_shares([[span], [span]], first_tag=len(first.owners))
    assert first.tags[span] == 0 and second.tags[span] == 1
