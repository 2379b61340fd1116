"""torchtitan's checkpoint manager on S3 through S3CheckpointManager, against the embedded
server, on CPU with a one-rank gloo group: saves at an interval, keep_latest_k through the
catalog, discovery of the latest committed step-N, and a bit-exact load into a fresh model,
optimizer and schedule; synchronous and in torchtitan's "async" mode. The last step saved
model-only, and in Hugging Face safetensors (``last_save_in_hf``), checked bit for bit
against the adapter's names and values, and skipped by discovery. A trainer SIGKILLed
during an async save resumes from the step before.

The Hugging Face tests use a state-dict adapter of their own (``_torchtitan_worker``,
which says why), also on two FSDP ranks.

torchtitan pulls pandas, pyarrow, datasets, wandb and tensorboard and pins older fsspec,
aiobotocore and lightning releases than the main test environment runs on, so ``make
test`` runs this module in an environment of its own (``.venv-torchtitan``, with
``s3ckpt[test,torchtitan]``) after the rest of the suite.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec.config
import pytest
import torch
import torch.distributed as dist
from s3_servers import held_port

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed here: make test runs this module in .venv-torchtitan",
)

import safetensors.torch
from _torchtitan_worker import (
    HF_CONFIG,
    HF_SHARDS,
    TinyAdapter,
    adamw,
    fsdp_hf_main,
    hf_assets,
    one_rank_parts,
    run_ranks,
)
from same_state import assert_same
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from s3ckpt import CheckpointError, ConfigError, catalog
from s3ckpt.config import S3URI
from s3ckpt.integrations.torchtitan import S3CheckpointManager
from s3ckpt.interop import formats

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

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
    with held_port() as port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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


def build(
    folder: str,
    connection: dict[str, Any],
    seed: int,
    async_mode: str,
    sd_adapter: StateDictAdapter | None = None,
    **checkpoint: Any,
) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizers = adamw(model)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    train_state = TrainState()
    manager = S3CheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=2,
        keep_latest_k=2,
        async_mode=async_mode,
        **{"last_save_model_only": False, **checkpoint, **connection},
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=sd_adapter,
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


def train(parts: Any, steps: int, snapshot_at: int = 0, last: bool = True) -> Any:
    """Train and save every step as torchtitan's trainer does (``last``: the last step as
    the last; else the job stops there, as when killed); the state after ``snapshot_at``
    (None if 0)."""
    model, optimizers, schedulers, train_state, manager = parts
    generator = torch.Generator().manual_seed(0)
    kept = None
    for step in range(1, steps + 1):
        x = torch.randn(4, 8, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        train_state.step = step
        manager.save(step, last_step=last and step == steps)  # the last one synchronously
        if step == snapshot_at:
            manager.maybe_wait_for_saving()
            kept = snapshot(model, optimizers, schedulers, train_state)
    return kept


PINNED = "async_with_pinned_mem"  # s3ckpt's checkpoint process: no accelerator needed


@pytest.mark.parametrize("async_mode", ["disabled", "async", PINNED])
def test_save_retain_discover_and_load_bit_exact(
    s3_prefix: str, aws_environment: dict[str, Any], s3_options: dict[str, Any], async_mode: str
) -> None:
    model, optimizers, schedulers, train_state, manager = build(
        s3_prefix, aws_environment, seed=1, async_mode=async_mode
    )
    assert manager.load() is False  # nothing there yet: a fresh start
    train((model, optimizers, schedulers, train_state, manager), STEPS)
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


@pytest.mark.parametrize("async_mode", ["async", PINNED])
def test_a_memory_tier_holds_every_save_and_a_restart_restores_from_it(
    s3_prefix: str,
    aws_environment: dict[str, Any],
    s3_options: dict[str, Any],
    shm_root: Path,
    async_mode: str,
) -> None:
    tier = {"keep": 2, "s3_every": 4, "root": str(shm_root)}
    parts = build(s3_prefix, aws_environment, 1, async_mode, memory_tier=tier)
    assert parts[4].load() is False  # nothing in memory or on S3: a fresh start
    # saves at 2, 4, 6 (interval 2); the job stops after step 7
    expected = train(parts, 7, snapshot_at=6, last=False)
    parts[4].close()
    committed = [c.name for c in catalog.list_checkpoints(s3_prefix, **s3_options) if c.committed]
    assert committed == ["step-4"]  # S3 every 4th step; memory holds 4 and 6

    fresh = build(s3_prefix, aws_environment, 2, async_mode, memory_tier=tier)
    assert fresh[4].load() is True
    restored = fresh[4].last_restore
    assert (restored.step, restored.tier) == (6, "memory")
    fresh[4].close()
    assert_same(snapshot(*fresh[:4]), expected)

    # the node's memory lost: the restart loads S3's step 4
    shutil.rmtree(shm_root)
    again = build(s3_prefix, aws_environment, 3, async_mode, memory_tier=tier)
    assert again[4].load() is True
    assert again[4].last_restore is None  # loaded from S3 by torchtitan's own path
    assert again[3].step == 4
    again[4].close()


def test_a_memory_tier_is_checked_with_the_configuration() -> None:
    config = {"enable": True, "folder": "s3://b/run"}
    with pytest.raises(ConfigError, match="async"):
        S3CheckpointManager.Config(**config, memory_tier={"keep": 2})
    with pytest.raises(ConfigError, match="memory_tier"):
        S3CheckpointManager.Config(**config, async_mode="async", memory_tier={"kept": 2})
    with pytest.raises(ConfigError, match="keep"):
        S3CheckpointManager.Config(**config, async_mode="async", memory_tier={"keep": 0})


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
    # torchtitan refuses last_save_in_hf for any remote folder; this manager takes it, with
    # torchtitan's other rules: model-only, and (at build) an adapter.
    S3CheckpointManager.Config(enable=True, folder="s3://b/run", last_save_in_hf=True)
    with pytest.raises(ConfigError, match="last_save_model_only"):
        S3CheckpointManager.Config(
            enable=True, folder="s3://b/run", last_save_in_hf=True, last_save_model_only=False
        )


def objects_under(local_s3: Any, uri: str) -> dict[str, bytes]:
    """Every object under ``uri``/, by name relative to it, with its bytes."""
    location = S3URI.parse(uri)
    client = local_s3.client()
    listed = client.list_objects_v2(Bucket=location.bucket, Prefix=location.prefix + "/")
    return {
        item["Key"][len(location.prefix) + 1 :]: client.get_object(
            Bucket=location.bucket, Key=item["Key"]
        )["Body"].read()
        for item in listed.get("Contents", [])
    }


@pytest.mark.parametrize("in_hf", [False, True], ids=["model-only", "hf-safetensors"])
def test_the_last_step_model_only_or_in_hf_is_no_resume_point(
    s3_prefix: str,
    aws_environment: dict[str, Any],
    s3_options: dict[str, Any],
    local_s3: Any,
    tmp_path: Path,
    in_hf: bool,
) -> None:
    adapter = TinyAdapter(None, hf_assets(tmp_path / "hf-assets"))
    last = dict(last_save_model_only=True, last_save_in_hf=in_hf, export_dtype="bfloat16")
    parts = build(s3_prefix, aws_environment, 1, "async", adapter, **last)
    resumable = train(parts, STEPS, snapshot_at=STEPS - 2)
    model, *_, manager = parts
    final = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    manager.close()

    committed = [c.name for c in catalog.list_checkpoints(s3_prefix, **s3_options) if c.committed]
    last_step = f"{s3_prefix}/step-{STEPS}"
    if in_hf:
        # step-8 holds safetensors, no s3ckpt checkpoint; the export's source is gone.
        assert committed == ["step-4", "step-6"]
        assert objects_under(local_s3, last_step + ".hf-source") == {}
        files = objects_under(local_s3, last_step)
        assert sorted(files) == sorted(
            {"config.json", "model.safetensors.index.json", *HF_SHARDS.values()}
        )
        assert files["config.json"] == HF_CONFIG
        index = json.loads(files["model.safetensors.index.json"])
        assert index["weight_map"] == HF_SHARDS
        exported: dict[str, torch.Tensor] = {}
        for shard in sorted(set(HF_SHARDS.values())):
            tensors = safetensors.torch.load(files[shard])
            assert all(HF_SHARDS[name] == shard for name in tensors)
            exported.update(tensors)
        # Bit for bit the model in export_dtype, named and permuted by the adapter.
        assert_same(exported, adapter.to_hf(final))
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in exported.values())
    else:
        assert committed == ["step-4", "step-6", "step-8"]
        assert not manager.holds_training_state(last_step)  # the model alone, in bf16
        assert manager.holds_training_state(f"{s3_prefix}/step-6")

    fresh = build(s3_prefix, aws_environment, 2, "async", adapter, **last)
    assert fresh[4]._find_load_step() == STEPS - 2  # the last full checkpoint
    assert fresh[4].load() is True
    fresh[4].close()
    assert_same(snapshot(*fresh[:4]), resumable)


def test_a_failed_hf_export_leaves_no_files_and_keeps_the_model(
    s3_prefix: str,
    aws_environment: dict[str, Any],
    s3_options: dict[str, Any],
    local_s3: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adapter = TinyAdapter(None, hf_assets(tmp_path / "hf-assets"))
    last = dict(last_save_model_only=True, last_save_in_hf=True)
    parts = build(s3_prefix, aws_environment, 1, "disabled", adapter, **last)
    written = formats.SafetensorsWriter.write
    stored: list[str] = []

    def failing(self: Any, name: str, tensor: torch.Tensor) -> None:
        written(self, name, tensor)
        if self._shard == 1:  # in the second shard: config.json and the first are stored
            stored.extend(self.output.written)
            raise OSError("disk on fire")

    monkeypatch.setattr(formats.SafetensorsWriter, "write", failing)
    with pytest.raises(CheckpointError, match="disk on fire") as failure:
        parts[4].save(1, last_step=True)
    parts[4].close()
    assert stored == ["config.json", *sorted(set(HF_SHARDS.values()))]
    source = f"{s3_prefix}/step-1.hf-source"
    assert source in str(failure.value)
    assert objects_under(local_s3, f"{s3_prefix}/step-1") == {}  # no partial export
    assert [c.name for c in catalog.list_checkpoints(s3_prefix, **s3_options)] == [
        "step-1.hf-source"  # kept, committed, for s3ckpt export to retry
    ]
    assert parts[4]._find_load_step() == -1


@pytest.mark.distributed
def test_two_fsdp_ranks_export_the_whole_model_in_hf(
    s3_prefix: str,
    aws_environment: dict[str, Any],
    local_s3: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every rank saves its FSDP shards; rank 0 exports whole tensors; both resume from
    step 1, the last full checkpoint."""
    env = {"AWS_ACCESS_KEY_ID": local_s3.access_key, "AWS_SECRET_ACCESS_KEY": local_s3.secret_key}
    assets = hf_assets(tmp_path / "hf-assets")
    args = (env, aws_environment, s3_prefix, assets, str(tmp_path))
    run_ranks(fsdp_hf_main, 2, *args, timeout=240)
    reports = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    files = objects_under(local_s3, f"{s3_prefix}/step-2")
    assert sorted(files) == sorted(
        {"config.json", "model.safetensors.index.json", *HF_SHARDS.values()}
    )
    exported = {}
    for shard in sorted(set(HF_SHARDS.values())):
        exported.update(safetensors.torch.load(files[shard]))
    adapter = TinyAdapter(None, assets)
    for report in reports:
        assert_same(exported, adapter.to_hf(report["final"]))
        assert report["found"] == 1 and report["loaded"] is True
        assert_same(report["restored"], report["step1"])


def test_the_quickstart_configurations_are_accepted() -> None:
    """The ``py`` blocks of the quickstart's torchtitan section, run in order: each gives
    a configuration this manager takes (the Hugging Face one, which torchtitan's own
    manager refuses for an s3:// folder, as the HF test above runs it)."""
    text = (Path(__file__).parents[2] / "docs" / "quickstart.md").read_text()
    section = text.split("## 11. torchtitan", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```py\n(.*?)```", section, flags=re.DOTALL)
    namespace: dict[str, Any] = {"config": types.SimpleNamespace()}
    seen = []
    for block in blocks:
        exec(compile(block, "docs/quickstart.md", "exec"), namespace)
        checkpoint = namespace["config"].checkpoint
        assert isinstance(checkpoint, S3CheckpointManager.Config)
        seen.append((checkpoint.last_save_model_only, checkpoint.last_save_in_hf))
    assert seen == [(True, False), (True, True)]


def test_a_trainer_killed_during_an_async_save_resumes_from_the_step_before(
    s3_prefix: str, aws_environment: dict[str, Any], local_s3: Any, tmp_path: Path
) -> None:
    """SIGKILL while torchtitan's ``async`` save of step 4 has uploaded its objects but not
    committed: step 4 is not discovered, step 2 loads bit-exact, and ``gc`` removes every
    object and upload the killed save left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _torchtitan_worker as w; "
        "w.killed_async_save_main(sys.argv[2], sys.argv[3])"
    )
    here = str(Path(__file__).parent)
    with held_port() as port:  # the child's rendezvous
        env = {**os.environ, "PORT": str(port), "ENDPOINT": local_s3.endpoint_url,
               "REGION": local_s3.region}  # fmt: skip
        child = subprocess.Popen(
            [sys.executable, "-c", code, here, s3_prefix, str(tmp_path)], env=env
        )
        try:
            deadline = time.monotonic() + 180
            while not (tmp_path / "uploaded").exists():
                assert child.poll() is None, f"the trainer exited ({child.returncode}) early"
                assert time.monotonic() < deadline, "step 4's save never finished uploading"
                time.sleep(0.1)
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
    bucket, prefix = s3_prefix[len("s3://") :].split("/", 1)
    client = local_s3.client()
    left = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-4/").get("Contents", [])
    assert left, "the kill came before step 4 uploaded anything"
    assert not catalog.is_committed(f"{s3_prefix}/step-4", **aws_environment["s3_options"],
                                    endpoint_url=local_s3.endpoint_url)  # fmt: skip

    model, optimizers, manager = one_rank_parts(
        s3_prefix, local_s3.endpoint_url, local_s3.region, "disabled"
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    assert manager._find_load_step() == 2
    assert manager.load() is True
    manager.close()
    saved = torch.load(tmp_path / "step2.pt", weights_only=True)
    assert_same(model.state_dict(), saved["model"])
    assert_same(optimizers.state_dict(), saved["optimizer"])
    time.sleep(1)  # the killed save's in-flight record was refreshed up to the kill
    catalog.collect_garbage(s3_prefix, grace=0, lease=0, endpoint_url=local_s3.endpoint_url,
                            **aws_environment["s3_options"])  # fmt: skip
    assert not client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-4/").get("Contents")
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/step-4/")
    assert not uploads.get("Uploads")
    assert catalog.is_committed(f"{s3_prefix}/step-2", endpoint_url=local_s3.endpoint_url,
                                **aws_environment["s3_options"])  # fmt: skip
