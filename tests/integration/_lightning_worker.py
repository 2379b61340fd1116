"""One rank of the Lightning sharded-strategy tests: ``python _lightning_worker.py SPEC``.

The test starts two of these with torchrun's environment (``LOCAL_RANK``, ``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so Lightning's strategies find their processes
created already and launch none. ``SPEC`` is a JSON file: the S3 options, a prefix, a
report folder and the scenarios to run, in order, in this one process pair (each runs
its own Trainers or Fabric on the same process group). Each scenario leaves
``<name>-rank<R>.pt`` (``torch.save``) for the test to check: this rank's local shards of
the model and optimizer states at the points the test compares, bit for bit.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_regression import Regression
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from s3ckpt import catalog
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.integrations.lightning import (
    S3CheckpointIO,
    S3FabricModelParallelStrategy,
    S3ModelParallelStrategy,
    last_checkpoint,
)
from s3ckpt.integrations.lightning.sharded import META_KEY, unpack_metadata

BATCHES_PER_EPOCH = 2  # per rank: 4 samples a batch, 2 ranks


def shard(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 over the data-parallel dimension: each linear layer, then the whole."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def make_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


class ShardedModule(Regression):
    """Two linear layers sharded with FSDP2 in ``configure_model``; AdamW and a schedule."""

    samples = 8 * BATCHES_PER_EPOCH

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = make_net(seed)

    def configure_model(self) -> None:
        shard(self.net, self.device_mesh["data_parallel"])


def local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by a copy of this rank's shard."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().clone()
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: local(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local(value) for value in tree)
    return copy.deepcopy(tree)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": local(get_model_state_dict(model)),
        "optimizer": local(get_optimizer_state_dict(model, optimizer)),
    }


class Snapshot(Callback):
    """This rank's shards and the loop counters at the start and at the end of training."""

    def __init__(self) -> None:
        self.start: dict[str, Any] = {}
        self.end: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = self.state(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.end = self.state(trainer)

    @staticmethod
    def state(trainer: Trainer) -> dict[str, Any]:
        return {
            **sharded_state(trainer.strategy.model, trainer.optimizers[0]),
            "scheduler": copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }


class Run:
    """What every scenario shares: the spec, this rank, the report folder."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.s3 = spec["s3"]
        self.prefix = spec["prefix"]
        self.out = Path(spec["out"])
        self.rank = int(os.environ["LOCAL_RANK"])

    def strategy(self, **options: Any) -> S3ModelParallelStrategy:
        s3 = dict(self.s3)
        return S3ModelParallelStrategy(
            endpoint_url=s3.pop("endpoint_url"), s3_options=s3,
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo",
            **options,
        )  # fmt: skip

    def fit(
        self, dirpath: str, epochs: int, seed: int, ckpt_path: str | None = None, **options: Any
    ) -> Snapshot:
        snapshot = Snapshot()
        checkpoints = ModelCheckpoint(
            dirpath=dirpath, every_n_epochs=1, save_top_k=1, save_last=True,
            enable_version_counter=True,
        )  # fmt: skip
        Trainer(
            accelerator="cpu", devices=2, strategy=self.strategy(**options),
            max_epochs=epochs, callbacks=[checkpoints, snapshot],
            default_root_dir=self.out / f"root{self.rank}", logger=False,
            enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        ).fit(ShardedModule(seed), ckpt_path=ckpt_path)  # fmt: skip
        return snapshot

    def committed(self, prefix: str) -> list[str]:
        found = catalog.list_checkpoints(prefix, **self.s3)
        return sorted(info.name for info in found if info.committed)

    def report(self, name: str, **values: Any) -> None:
        torch.save(values, self.out / f"{name}-rank{self.rank}.pt")


def resume(run: Run, async_save: bool) -> None:
    """Two epochs, a new Trainer resumes from the newest checkpoint to a third; and the
    same three epochs uninterrupted."""
    name = "async" if async_save else "sync"
    prefix = f"{run.prefix}/{name}"
    uninterrupted = run.fit(f"{prefix}-uninterrupted", 3, seed=1, async_save=async_save)
    first = run.fit(prefix, 2, seed=1, async_save=async_save)
    last_step = saved_step(run, f"{prefix}/last.ckpt")  # fit returned: its last save is in
    after_first = run.committed(prefix)
    resume_from = last_checkpoint(prefix, **run.s3)
    resumed = run.fit(prefix, 3, seed=2, ckpt_path=resume_from, async_save=async_save)
    run.report(
        name, uninterrupted=uninterrupted.end, first=first.end, resumed_start=resumed.start,
        resumed_end=resumed.end, after_first=after_first, after_resume=run.committed(prefix),
        resume_from=resume_from, last_step=last_step,
    )  # fmt: skip


def saved_step(run: Run, uri: str) -> int:
    """The global step Lightning's metadata records in the checkpoint at ``uri``."""
    items: dict[str, Any] = {META_KEY: None}
    dcp.load(items, storage_reader=S3StorageReader(uri, **run.s3), no_dist=True)
    return unpack_metadata(items[META_KEY], weights_only=True)["global_step"]


def killed(run: Run) -> None:
    """An async run whose third save (epoch 1's) stalls after its uploads, before its
    commit (in the rank's checkpoint process); the test kills both ranks once rank 0
    says so."""
    from _process_writers import StallOnThirdSave

    from s3ckpt.integrations.lightning import sharded

    os.environ[StallOnThirdSave.MARKERS] = str(run.out)  # the checkpoint process inherits it
    sharded.S3StorageWriter = StallOnThirdSave  # type: ignore[misc]
    run.fit(f"{run.prefix}/killed", 3, seed=1, async_save=True)


def after_kill(run: Run) -> None:
    """Resume from what the killed run left, and run the same epochs uninterrupted."""
    prefix = f"{run.prefix}/killed"
    resume_from = last_checkpoint(prefix, **run.s3)
    committed = run.committed(prefix)
    resumed = run.fit(prefix, 3, seed=2, ckpt_path=resume_from, async_save=True)
    uninterrupted = run.fit(f"{run.prefix}/uninterrupted", 3, seed=1)
    run.report(
        "after_kill", resume_from=resume_from, committed=committed,
        resumed_start=resumed.start, resumed_end=resumed.end, uninterrupted=uninterrupted.end,
    )  # fmt: skip


def fabric_sharded(run: Run) -> None:
    """Fabric's ModelParallelStrategy: fabric.save to s3://, fabric.load into new objects."""
    s3 = dict(run.s3)
    strategy = S3FabricModelParallelStrategy(
        endpoint_url=s3.pop("endpoint_url"), s3_options=s3, parallelize_fn=shard,
        data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo",
    )  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, optimizer = train_with_fabric(fabric, seed=1)
    uri = f"{run.prefix}/fabric-sharded/step-2"
    fabric.save(uri, {"model": model, "optimizer": optimizer, "step": 2, "note": "two steps"})
    saved = sharded_state(model, optimizer)
    model2 = fabric.setup(make_net(seed=5))
    optimizer2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-2))
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    remainder = fabric.load(uri, state)
    run.report(
        "fabric_sharded", saved=saved, loaded=sharded_state(model2, optimizer2),
        step=state["step"], remainder=remainder,
    )  # fmt: skip


def fabric_ddp(run: Run) -> None:
    """Fabric's DDP with S3CheckpointIO: rank 0 saves, both ranks load."""
    io = S3CheckpointIO(configure_fsspec=False, **run.s3)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
    fabric.launch()
    model, optimizer = train_with_fabric(fabric, seed=1)
    uri = f"{run.prefix}/fabric-ddp/step-2"
    fabric.save(uri, {"model": model, "optimizer": optimizer, "step": 2})
    saved = {"model": local(model.state_dict()), "optimizer": local(optimizer.state_dict())}
    model2 = fabric.setup(make_net(seed=5))
    optimizer2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-2))
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric.load(uri, state)
    loaded = {"model": local(model2.state_dict()), "optimizer": local(optimizer2.state_dict())}
    run.report("fabric_ddp", saved=saved, loaded=loaded, step=state["step"])


def train_with_fabric(fabric: Fabric, seed: int) -> tuple[Any, Any]:
    model = fabric.setup(make_net(seed))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(2):
        x = torch.randn(4, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


SCENARIOS = {
    "sync": lambda run: resume(run, async_save=False),
    "async": lambda run: resume(run, async_save=True),
    "killed": killed,
    "after_kill": after_kill,
    "fabric_sharded": fabric_sharded,
    "fabric_ddp": fabric_ddp,
}


def main() -> None:
    run = Run(json.loads(Path(sys.argv[1]).read_text()))
    for name in run.spec["scenarios"]:
        SCENARIOS[name](run)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
