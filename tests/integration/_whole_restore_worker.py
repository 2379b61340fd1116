"""A CPU training script as a user writes it, run in a fresh process per phase: the state
is ``{"model": model, "optim": optimizer, "sched": scheduler}``, the objects themselves.

    python _whole_restore_worker.py <how> save <config.json> <out.pt>
    python _whole_restore_worker.py <how> resume <config.json> <out.pt>

``save`` trains steps 1..SAVED, checkpoints after step SAVED, then goes on uninterrupted
to step LAST; ``resume`` builds a fresh model and optimizer (other initial weights), loads
the latest checkpoint and trains the same steps from there. Each writes the loss of
every step after the checkpoint, the weights and the optimizer state at the end, what the
load returned, the optimizer's state right after the load and the warnings of s3ckpt's
load report.

``how``: ``process`` / ``thread`` (CheckpointManager), ``tiered``
(TieredCheckpointProcess, restored from memory), ``dcp`` (plain dcp.save / dcp.load with
S3StorageWriter / S3StorageReader), ``fsdp`` (FSDP2 ``fully_shard`` on a one-rank gloo mesh,
CheckpointManager), ``fsdp2`` (the same on two gloo ranks), ``fresh`` (CheckpointManager,
the optimizer saved before its first step).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

SAVED, LAST = 3, 6


def build(seed: int, sharded: bool) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    )  # fmt: skip
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # two param groups, each with its own learning rate; a scheduler beside them
    optimizer = torch.optim.Adam(
        [
            {"params": list(model[0].parameters()) + list(model[2].parameters())},
            {"params": model[4].parameters(), "lr": 0.02, "weight_decay": 0.01},
        ],
        lr=0.01,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model: torch.nn.Module, optimizer: Any, scheduler: Any, step: int) -> float:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(5, 6, generator=generator)
    y = torch.randn(5, 3, generator=generator)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def local(value: Any) -> Any:
    return value.to_local() if hasattr(value, "to_local") else value


def optimizer_state(optimizer: Any) -> dict[int, dict[str, torch.Tensor]]:
    return {
        pid: {name: local(v).clone() for name, v in entry.items()}
        for pid, entry in optimizer.state_dict()["state"].items()
    }


class Reports(logging.Handler):
    """The warnings of s3ckpt's load report, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("s3ckpt.dcp.load_report").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(how: str, phase: str, config: dict[str, Any], out: Path) -> None:
    reports = Reports()
    sharded = how.startswith("fsdp")
    if sharded:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = out.with_name(f"{out.stem}-{rank}{out.suffix}")
    model, optimizer, scheduler = build(1 if phase == "save" else 2, sharded)
    state = {"model": model, "optim": optimizer, "sched": scheduler}
    record: dict[str, Any] = {"losses": {}}
    first = 1
    with Checkpoints(how, config) as checkpoints:
        if phase == "resume":
            record["loaded"] = checkpoints.load(state)
            record["after_load"] = optimizer_state(optimizer)
            first = record["loaded"] + 1
        for step in range(first, LAST + 1):
            if how == "fresh" and phase == "save" and step == 1:
                checkpoints.save(0, state)  # before the first step
                record["losses"] = {}
            record["losses"][step] = train_step(model, optimizer, scheduler, step)
            if phase == "save" and step == SAVED and how != "fresh":
                checkpoints.save(SAVED, state)
    record["weights"] = {k: local(v).clone() for k, v in model.state_dict().items()}
    record["optim"] = optimizer_state(optimizer)
    record["lrs"] = [group["lr"] for group in optimizer.param_groups]
    record["reports"] = reports.lines
    torch.save(record, out)
    if sharded:
        dist.destroy_process_group()


class Checkpoints:
    """Save and load the way each of the documented routes does."""

    def __init__(self, how: str, config: dict[str, Any]) -> None:
        self.how, self.uri, self.s3 = how, config["uri"], config["s3"]
        self.manager: Any = None
        self.tiered: Any = None
        if how in ("process", "thread", "fsdp", "fsdp2", "fresh"):
            from s3ckpt import CheckpointManager

            mode = "thread" if how == "thread" else "process"
            self.manager = CheckpointManager(self.uri, async_mode=mode, **self.s3)
        elif how == "tiered":
            from s3ckpt import MemoryTier, TieredCheckpointProcess

            tier = MemoryTier(keep=2, s3_every=1000, root=Path(config["root"]))
            self.tiered = TieredCheckpointProcess(self.uri, tier)

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        for owner in (self.manager, self.tiered):
            if owner is not None:
                owner.close()

    def save(self, step: int, state: dict[str, Any]) -> None:
        from s3ckpt import S3StorageWriter

        if self.manager is not None:
            self.manager.save(step, state)
            self.manager.wait()
        elif self.tiered is not None:
            self.tiered.async_save(state, step).result(timeout=120)
        else:
            writer = S3StorageWriter(f"{self.uri}/step-{step}", **self.s3)
            dcp.save(state, storage_writer=writer)

    def load(self, state: dict[str, Any]) -> int:
        from s3ckpt import S3StorageReader

        if self.manager is not None:
            return self.manager.load_latest(state)
        if self.tiered is not None:
            restored = self.tiered.restore_latest(state)
            assert restored is not None and restored.tier == "memory", restored
            return restored.step
        dcp.load(state, storage_reader=S3StorageReader(f"{self.uri}/step-{SAVED}", **self.s3))
        return SAVED


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(Path(sys.argv[3]).read_text()), Path(sys.argv[4]))
