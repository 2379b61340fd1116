"""Thread mode's GIL tuning is on where the engine runs in the trainer's process and off
in the checkpoint process, and a save comes back whole either way."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from _switch_writer import SwitchReporting

from s3ckpt import CheckpointProcess


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{n}": torch.randn(64, 64, generator=g) for n in range(8)}


def _loaded(uri: str, make_reader, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    into = {name: torch.empty_like(value) for name, value in like.items()}
    dcp.load(into, storage_reader=make_reader(uri))
    return into


def test_the_switch_is_on_in_the_trainer_and_off_in_the_checkpoint_process(
    s3_prefix, s3_options, make_reader, tmp_path
):
    marker = tmp_path / "switch"
    trainer_state = _state(1)
    dcp.save(
        trainer_state,
        storage_writer=SwitchReporting(f"{s3_prefix}/thread", str(marker), **s3_options),
    )
    assert marker.read_text() == "on"
    for name, value in _loaded(f"{s3_prefix}/thread", make_reader, trainer_state).items():
        assert torch.equal(value, trainer_state[name])

    process_state = _state(2)
    with CheckpointProcess() as process:
        writer = SwitchReporting(f"{s3_prefix}/process", str(marker), **s3_options)
        process.async_save(process_state, storage_writer=writer).result(timeout=200)
    assert marker.read_text() == "off"
    for name, value in _loaded(f"{s3_prefix}/process", make_reader, process_state).items():
        assert torch.equal(value, process_state[name])
