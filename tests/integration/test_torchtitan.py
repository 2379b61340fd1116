"""torchtitan's checkpoint manager on S3 through S3CheckpointManager, against the embedded
server, on CPU with a one-rank gloo group: saves at an interval, keep_latest_k through the
catalog, discovery of the latest committed step-N, and a bit-exact load into a fresh model,
optimizer and schedule; synchronous and in torchtitan's "async" mode.

torchtitan pulls pandas, pyarrow, datasets, wandb and tensorboard and pins older fsspec,
aiobotocore and lightning releases than the main test environment runs on, so ``make
test`` runs this module in an environment of its own (``.venv-torchtitan``, with
``s3ckpt[test,torchtitan]``) after the rest of the suite.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import fsspec.config
import pytest
import torch
import torch.distributed as dist
from s3_servers import free_port

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed here: make test runs this module in .venv-torchtitan",
)

from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from s3ckpt import ConfigError, catalog
from s3ckpt.integrations.torchtitan import S3CheckpointManager

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 8


class TrainState(Stateful):
    """The step counter torchtitan's trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


@pytest.fixture(autouse=True)
def one_rank_group() -> Iterator[None]:
    """torchtitan's manager asks for the rank; its async mode makes a gloo group."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    saved = copy.deepcopy(fsspec.config.conf.get("s3"))
    yield
    dist.destroy_process_group()
    if saved is None:
        fsspec.config.conf.pop("s3", None)
    else:
        fsspec.config.conf["s3"] = saved


@pytest.fixture
def aws_environment(monkeypatch: pytest.MonkeyPatch, local_s3: Any) -> dict[str, Any]:
    """Credentials from the environment (the manager's config refuses them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", local_s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", local_s3.secret_key)
    return {"endpoint_url": local_s3.endpoint_url, "s3_options": {"region": local_s3.region}}


def build(folder: str, connection: dict[str, Any], seed: int, async_mode: str) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    train_state = TrainState()
    manager = S3CheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=2,
        keep_latest_k=2,
        last_save_model_only=False,
        async_mode=async_mode,
        **connection,
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder="/unused/dump/folder",
    )
    return model, optimizers, schedulers, train_state, manager


def snapshot(model: Any, optimizers: Any, schedulers: Any, train_state: TrainState) -> Any:
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizers.optimizers[0].state_dict(),
            "scheduler": schedulers.state_dict(),
            "step": train_state.step,
        }
    )


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{index}]")
    else:
        assert got == want, where


PINNED = pytest.param(
    "async_with_pinned_mem",
    marks=pytest.mark.skipif(
        not torch.accelerator.is_available(),
        reason="async_with_pinned_mem stages with non-blocking copies: needs an accelerator",
    ),
)


@pytest.mark.parametrize("async_mode", ["disabled", "async", PINNED])
def test_save_retain_discover_and_load_bit_exact(
    s3_prefix: str, aws_environment: dict[str, Any], s3_options: dict[str, Any], async_mode: str
) -> None:
    model, optimizers, schedulers, train_state, manager = build(
        s3_prefix, aws_environment, seed=1, async_mode=async_mode
    )
    assert manager.load() is False  # nothing there yet: a fresh start
    generator = torch.Generator().manual_seed(0)
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 8, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        train_state.step = step
        manager.save(step, last_step=step == STEPS)  # the last step is saved synchronously
    expected = snapshot(model, optimizers, schedulers, train_state)
    manager.close()  # finishes the queued deletions

    committed = [c.name for c in catalog.list_checkpoints(s3_prefix, **s3_options) if c.committed]
    # keep_latest_k=2 after each interval save (step 6's purge removed step 2); torchtitan
    # does not purge after the last step's save.
    assert committed == ["step-4", "step-6", "step-8"]

    fresh = build(s3_prefix, aws_environment, seed=2, async_mode=async_mode)
    assert fresh[4]._find_load_step() == STEPS
    assert fresh[4].load() is True
    fresh[4].close()
    assert_same(snapshot(*fresh[:4]), expected)


def test_a_half_written_step_is_not_discovered(
    s3_prefix: str, aws_environment: dict[str, Any], local_s3: Any
) -> None:
    *_, manager = build(s3_prefix, aws_environment, seed=1, async_mode="disabled")
    manager.save(2)
    bucket, prefix = s3_prefix[len("s3://") :].split("/", 1)
    # What a save killed before its commit leaves: objects, no manifest.
    local_s3.client().put_object(Bucket=bucket, Key=f"{prefix}/step-9/data/0-leftover", Body=b"x")
    assert manager._find_load_step() == 2
    manager.close()


def test_credentials_in_the_config_and_local_folders_are_refused() -> None:
    with pytest.raises(ConfigError, match="credentials"):
        S3CheckpointManager.Config(
            enable=True, folder="s3://b/run", s3_options={"secret_access_key": "x"}
        )
    with pytest.raises(ConfigError, match="s3://"):
        S3CheckpointManager.Config(enable=True, folder="checkpoint")
