"""Rank entry points for the multi-rank torchtitan test, and the test model's Hugging Face
adapter that both the test and its ranks use.

The adapter is a torchtitan ``StateDictAdapter`` written the way torchtitan's llama3 one
is (Hugging Face names, the q/k row permutation, shards from ``model.safetensors.index.json``
in ``hf_assets_path``): the llama3 adapter itself cannot be imported on a CPU-only install,
since ``torchtitan.models`` imports triton. Same launch pattern as :mod:`_dist_worker`:
each rank leaves a ``torch.save`` report in ``out_dir``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report, run_ranks
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from s3ckpt.dcp.writer import S3StorageWriter

__all__ = [
    "HF_CONFIG",
    "HF_NAMES",
    "HF_SHARDS",
    "TinyAdapter",
    "adamw",
    "fsdp_hf_main",
    "hf_assets",
    "killed_async_save_main",
    "one_rank_parts",
    "run_ranks",
]

HF_NAMES = {
    "0.weight": "model.up_proj.weight",
    "0.bias": "model.up_proj.bias",
    "2.weight": "lm_head.weight",
    "2.bias": "lm_head.bias",
}
HF_SHARDS = {
    "model.up_proj.weight": "model-00001-of-00002.safetensors",
    "model.up_proj.bias": "model-00001-of-00002.safetensors",
    "lm_head.weight": "model-00002-of-00002.safetensors",
    "lm_head.bias": "model-00002-of-00002.safetensors",
}
HF_CONFIG = b'{"architectures": ["TinyForCausalLM"], "hidden_size": 16}\n'


def permuted(weight: torch.Tensor, heads: int = 2) -> torch.Tensor:
    """llama3's q/k permutation for Hugging Face's rotary layout (rows interleaved)."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class TinyAdapter(StateDictAdapter):
    """The test model's Hugging Face names and values, as llama3's adapter converts them."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {
            HF_NAMES[k]: permuted(v).clone() if k == "0.weight" else v
            for k, v in state_dict.items()
        }

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        native = {v: k for k, v in HF_NAMES.items()}
        return {native[k]: v for k, v in hf_state_dict.items()}


def hf_assets(folder: Path) -> str:
    """A Hugging Face assets folder: the model's shard index and configuration."""
    folder.mkdir(exist_ok=True)
    index = {"metadata": {}, "weight_map": HF_SHARDS}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_bytes(HF_CONFIG)
    return str(folder)


def adamw(model: torch.nn.Module) -> Any:
    """torchtitan's optimizers container over ``model``: AdamW, lr 1e-2, every parameter."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
        ],
        implementation="for-loop",
    ).build(model_parts=[model])


def _fsdp_parts(rank: int, world_size: int, folder: str, s3: dict[str, Any], assets: str) -> Any:
    """The test model sharded by FSDP2 over the CPU ranks, its optimizer and a manager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from s3ckpt.integrations.torchtitan import S3CheckpointManager

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizers = adamw(model)
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=optimizers, training_steps=2
    )
    manager = S3CheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=1,
        keep_latest_k=0,
        last_save_model_only=True,
        last_save_in_hf=True,
        export_dtype="bfloat16",
        **s3,
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=TinyAdapter(None, assets),
    )
    return model, optimizers, schedulers, manager


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def fsdp_hf_main(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    s3: dict[str, Any],
    folder: str,
    assets: str,
    out_dir: str,
) -> None:
    """Two FSDP steps, step 1 saved whole and step 2 (the last) in Hugging Face
    safetensors; then a fresh model resumed from what discovery picks."""
    os.environ.update(env)
    _init(rank, world_size, port)
    model, optimizers, schedulers, manager = _fsdp_parts(rank, world_size, folder, s3, assets)
    report: dict[str, Any] = {}
    for step in (1, 2):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
        loss.square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        manager.save(step, last_step=step == 2)
        if step == 1:
            report["step1"] = _full(model)
    report["final"] = {k: v.to(torch.bfloat16) for k, v in _full(model).items()}
    manager.close()
    dist.barrier()

    model, optimizers, schedulers, manager = _fsdp_parts(rank, world_size, folder, s3, assets)
    report["found"] = manager._find_load_step()
    report["loaded"] = manager.load()
    report["restored"] = _full(model)
    manager.close()
    _report(out_dir, rank, report)
    dist.destroy_process_group()


def one_rank_parts(folder: str, endpoint: str, region: str, async_mode: str) -> Any:
    """The test model, its optimizer and a manager saving every second step, on one rank."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from s3ckpt.integrations.torchtitan import S3CheckpointManager

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizers = adamw(model)
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=8)
    manager = S3CheckpointManager.Config(
        enable=True, folder=folder, interval=2, keep_latest_k=0, async_mode=async_mode,
        last_save_model_only=False, endpoint_url=endpoint, s3_options={"region": region},
    ).build(dataloader=None, model_parts=[model], optimizers=optimizers,
            lr_schedulers=schedulers, states={}, sd_adapter=None,
            base_folder="/unused")  # fmt: skip
    return model, optimizers, manager


class StalledAtStep4(S3StorageWriter):
    """Step 4's writer (in the checkpoint process, which imports this module by name):
    every data object written, it announces it and stalls before the manifest."""

    def finish(self, metadata: Any, results: Any) -> None:
        if self.location is not None and "step-4" in str(self.location):
            Path(os.environ["STALL_MARKER"]).touch()
            time.sleep(600)
        super().finish(metadata, results)


def killed_async_save_main(folder: str, out_dir: str) -> None:
    """A one-rank trainer in torchtitan's ``async`` mode (run as its own process, which the
    test SIGKILLs): step 2 saved and committed, its state left in ``out_dir``; step 4's
    save uploads everything, announces it, and is killed before its manifest is written."""
    from s3ckpt.integrations.torchtitan import manager as integration

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}",
                            rank=0, world_size=1)  # fmt: skip
    model, optimizers, manager = one_rank_parts(
        folder, os.environ["ENDPOINT"], os.environ["REGION"], "async"
    )
    os.environ["STALL_MARKER"] = str(Path(out_dir) / "uploaded")
    integration.S3StorageWriter = StalledAtStep4  # type: ignore[misc]
    for step in range(1, 5):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
        loss.square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        manager.save(step)
        if step == 2:
            manager.maybe_wait_for_saving()
            state = {"model": model.state_dict(), "optimizer": optimizers.state_dict()}
            torch.save(state, Path(out_dir) / "step2.pt")
    time.sleep(600)  # training goes on while step 4 uploads, until the kill
