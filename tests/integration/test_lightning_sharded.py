"""Lightning's sharded strategies and Fabric over s3ckpt, against the embedded S3 server.

Two CPU ranks (gloo), started here as torchrun would (``_lightning_worker.py``):
``S3ModelParallelStrategy`` with FSDP2 saves sharded checkpoints to ``s3://``, a new
Trainer resumes from the newest and ends bit-exact where an uninterrupted run ends, in
the loop and with ``async_save``; a run killed while an async save uploads leaves that
save invisible and the previous checkpoint loadable; Fabric saves and loads with
``S3FabricModelParallelStrategy`` and, on DDP, with ``S3CheckpointIO``.

``S3FSDPStrategy`` needs an accelerator (FSDP version 1 refuses a CPU-only machine), so
its save and load run here in one process against the strategy itself, with FSDP's own
functions (its sharded state-dict context and optimizer-state conversions) replaced;
the rest of its path is the same code as ``S3ModelParallelStrategy``'s.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import private_names
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from s3_servers import held_port
from same_state import assert_same
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from s3ckpt import (
    CheckpointNotFoundError,
    ConfigError,
    S3StorageReader,
    S3StorageWriter,
    catalog,
    unwrap,
)
from s3ckpt.config import make_config
from s3ckpt.integrations.lightning import (
    S3CheckpointIO,
    S3FabricModelParallelStrategy,
    S3FSDPStrategy,
    S3ModelParallelStrategy,
    strategies,
)
from s3ckpt.integrations.lightning import compat as lightning_compat
from s3ckpt.integrations.lightning.sharded import META_KEY, ShardedCheckpoints
from s3ckpt.testing.local_s3 import LocalS3Server

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "_lightning_worker.py"
QUICKSTART = ROOT / "docs" / "quickstart.md"
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.usefixtures("fsspec_defaults"),
]


class Ranks:
    """Two worker processes started with torchrun's environment."""

    def __init__(self, tmp_path: Path, spec: dict[str, Any], name: str) -> None:
        self.out = tmp_path / name
        self.out.mkdir()
        spec_file = self.out / "spec.json"
        spec_file.write_text(json.dumps({**spec, "out": str(self.out)}))
        self.rendezvous = contextlib.ExitStack()  # the port held until the ranks are done
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.rendezvous.enter_context(held_port())),
            "NODE_RANK": "0",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
        }
        env.pop("WORLD_SIZE", None)
        self.logs = [self.out / f"rank{rank}.log" for rank in range(2)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with log.open("wb") as output:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(spec_file)],
                        env={**env, "LOCAL_RANK": str(rank)},
                        cwd=ROOT,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the ranks did not finish in {timeout} s:\n{self.tail()}"
            ) from None
        finally:
            self.rendezvous.close()
        codes = [proc.returncode for proc in self.procs]
        assert codes == [0, 0], f"exit codes {codes}:\n{self.tail()}"

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        self.rendezvous.close()

    def tail(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-4000:] for log in self.logs)

    def report(self, name: str, rank: int) -> dict[str, Any]:
        return torch.load(self.out / f"{name}-rank{rank}.pt", weights_only=False)


@pytest.fixture
def spec(s3_prefix: str, s3_options: dict[str, Any]) -> dict[str, Any]:
    return {"s3": s3_options, "prefix": s3_prefix}


def committed_names(uri: str, options: dict[str, Any]) -> list[str]:
    return sorted(c.name for c in catalog.list_checkpoints(uri, **options) if c.committed)


@pytest.mark.distributed
@pytest.mark.subprocess
def test_model_parallel_saves_resumes_bit_exact_and_fabric_round_trips(
    tmp_path: Path, spec: dict[str, Any], s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    """Both ranks run: the Trainer in the loop, the Trainer with async saves, Fabric's
    ModelParallelStrategy and Fabric's DDP with S3CheckpointIO."""
    scenarios = ["sync", "async", "fabric_sharded", "fabric_ddp"]
    ranks = Ranks(tmp_path, {**spec, "scenarios": scenarios}, "run")
    ranks.wait()
    for mode in ("sync", "async"):
        for rank in range(2):
            got = ranks.report(mode, rank)
            where = f"{mode}, rank {rank}"
            # save_top_k=1 removed epoch 0's checkpoint once epoch 1's committed.
            assert got["after_first"] == ["epoch=1-step=4.ckpt", "last.ckpt"], where
            assert got["last_step"] == 4, where  # the end of fit waited for the last save
            assert got["resume_from"].startswith(f"{s3_prefix}/{mode}/")
            assert got["resumed_start"]["global_step"] == 2 * 2
            for part in ("model", "optimizer", "scheduler"):
                assert_same(got["resumed_start"][part], got["first"][part], f"{where}: {part}")
            assert_same(got["resumed_end"], got["uninterrupted"], f"{where}: after resuming")
            assert got["after_resume"] == ["epoch=2-step=6.ckpt", "last.ckpt"], where
        # one checkpoint, one manifest: the shards of both ranks and Lightning's metadata
        uri = f"{s3_prefix}/{mode}/last.ckpt"
        items = S3StorageReader(uri, **s3_options).read_metadata().state_dict_metadata
        assert META_KEY in items and "state_dict.net.0.weight" in items
        assert "optimizer_0.state.net.0.weight.exp_avg" in items
        assert [c.name for c in catalog.list_checkpoints(f"{s3_prefix}/{mode}", **s3_options)]
    for rank in range(2):
        fabric = ranks.report("fabric_sharded", rank)
        assert_same(fabric["loaded"], fabric["saved"], f"fabric sharded, rank {rank}")
        assert fabric["step"] == 2 and fabric["remainder"] == {"note": "two steps"}
        ddp = ranks.report("fabric_ddp", rank)
        assert_same(ddp["loaded"], ddp["saved"], f"fabric ddp, rank {rank}")
        assert ddp["step"] == 2


@pytest.mark.distributed
@pytest.mark.subprocess
def test_a_kill_during_an_async_save_leaves_it_invisible_and_the_previous_one_loadable(
    tmp_path: Path, spec: dict[str, Any], s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    ranks = Ranks(tmp_path, {**spec, "scenarios": ["killed"]}, "killed")
    stalled = ranks.out / "stalled-rank0"
    deadline = time.monotonic() + 90
    while not stalled.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in ranks.procs):
            ranks.kill()
            raise AssertionError(f"the third save never stalled:\n{ranks.tail()}")
        time.sleep(0.2)
    ranks.kill()  # SIGKILL both ranks: epoch 1's objects are written, its manifest is not

    prefix = f"{s3_prefix}/killed"
    interrupted = stalled.read_text()
    assert interrupted == f"{prefix}/epoch=1-step=4.ckpt"
    listed = {c.name: c.committed for c in catalog.list_checkpoints(prefix, **s3_options)}
    # Epoch 0's checkpoint stays: its removal waited for a commit that never came.
    assert committed_names(prefix, s3_options) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert listed.get("epoch=1-step=4.ckpt") in (None, False)
    with pytest.raises(CheckpointNotFoundError):
        S3StorageReader(interrupted, **s3_options).read_metadata()

    after = Ranks(tmp_path, {**spec, "scenarios": ["after_kill"]}, "after")
    after.wait()
    for rank in range(2):
        got = after.report("after_kill", rank)
        assert got["resume_from"] in (f"{prefix}/last.ckpt", f"{prefix}/epoch=0-step=2.ckpt")
        assert got["resumed_start"]["global_step"] == 2
        assert_same(got["resumed_end"], got["uninterrupted"], f"rank {rank}: after the kill")


# -- in this process --------------------------------------------------------------------


def test_async_saves_keep_the_previous_checkpoint_until_the_next_one_commits(
    s3_prefix: str,
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Top-k rotation asks to remove A while B uploads: A goes once B commits, and stays
    when B fails. The upload works from the host copy made when the save started. (Thread
    mode: the uploads run in this process, where the test holds them back.)"""
    store = ShardedCheckpoints(
        make_config(None, **s3_options), async_save=True, async_mode="thread"
    )
    state = {"w": torch.arange(8.0)}
    store.save(state, {"epoch": 0}, f"{s3_prefix}/a")
    store.wait()
    gate = threading.Event()
    original = S3StorageWriter.write_data

    def gated(self: S3StorageWriter, plan: Any, planner: Any) -> Any:
        assert gate.wait(30)
        return original(self, plan, planner)

    monkeypatch.setattr(S3StorageWriter, "write_data", gated)
    store.save(state, {"epoch": 1}, f"{s3_prefix}/b")
    state["w"].add_(100)  # training goes on while b uploads
    store.remove(f"{s3_prefix}/a")
    assert committed_names(s3_prefix, s3_options) == ["a"]  # b is not committed yet
    with caplog.at_level(logging.DEBUG, logger="s3ckpt.integrations.lightning.background"):
        gate.set()
        store.wait()
    assert committed_names(s3_prefix, s3_options) == ["b"]
    # the save brought back the state's tensor bytes (8 float32), not DCP's metadata
    assert f"{s3_prefix}/b saved: 32 bytes of tensors" in caplog.text
    loaded = {"w": torch.zeros(8)}
    assert store.load(loaded, f"{s3_prefix}/b", weights_only=True) == {"epoch": 1}
    assert torch.equal(loaded["w"], torch.arange(8.0))  # the copy staged at save time

    gate.clear()

    def failing(self: S3StorageWriter, plan: Any, planner: Any) -> Any:
        assert gate.wait(30)
        raise OSError("the upload failed")

    monkeypatch.setattr(S3StorageWriter, "write_data", failing)
    store.save(state, {"epoch": 2}, f"{s3_prefix}/c")
    store.remove(f"{s3_prefix}/b")
    gate.set()
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException
        store.close()
    assert isinstance(unwrap(failed.value), OSError)
    assert committed_names(s3_prefix, s3_options) == ["b"]  # kept: c never committed


class FSDPModule(LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))


def trained(seed: int) -> tuple[FSDPModule, torch.optim.Optimizer]:
    module = FSDPModule(seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module.net(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return module, optimizer


def fsdp_strategy(
    s3_options: dict[str, Any], module: LightningModule, optimizer: Any, async_save: bool = False
) -> Any:
    options = dict(s3_options)
    strategy = S3FSDPStrategy(
        endpoint_url=options.pop("endpoint_url"), s3_options=options, configure_fsspec=False,
        async_save=async_save,
    )  # fmt: skip
    strategy.connect(module)
    strategy.optimizers = [optimizer]
    module.trainer = mock.Mock(state=mock.Mock(fn=TrainerFn.FITTING))
    return strategy


@pytest.mark.parametrize("async_save", [False, True], ids=["in-the-loop", "async"])
def test_fsdp_strategy_saves_and_loads_one_sharded_checkpoint_without_an_accelerator(
    s3_prefix: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """S3FSDPStrategy's own save_checkpoint and load_checkpoint on one process. Not run
    here: FSDP (version 1) itself, which needs an accelerator; its sharded state-dict
    context and its optimizer-state conversion are replaced by what they reduce to on one
    unsharded rank, and the optimizer state is read through the reader the strategy hands
    to load_sharded_optimizer_state_dict."""
    module, optimizer = trained(seed=1)
    saved = {
        "model": copy.deepcopy(module.state_dict()),
        "optim": copy.deepcopy(optimizer.state_dict()),
    }
    metadata = {
        "epoch": 1,
        "global_step": 4,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.25)}},
    }
    checkpoint = {
        "state_dict": module.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        **copy.deepcopy(metadata),
    }
    uri = f"{s3_prefix}/epoch=1-step=4.ckpt"
    saver = fsdp_strategy(s3_options, module, optimizer, async_save)
    saver.save_checkpoint(checkpoint, uri)
    saver.checkpoints.close()  # what teardown does first: wait for an async save
    items = S3StorageReader(uri, **s3_options).read_metadata().state_dict_metadata
    assert {"model.net.0.weight", "optimizer_0.state.0.exp_avg", META_KEY} <= set(items)

    readers: list[Any] = []

    def load_sharded_optimizer_state_dict(
        model_state_dict: Any, optimizer_key: str, storage_reader: Any
    ) -> dict[str, Any]:
        readers.append(storage_reader)
        template = {optimizer_key: copy.deepcopy(saved["optim"])}
        dcp.load(template, storage_reader=storage_reader)
        return template

    monkeypatch.setattr(
        strategies, "sharded_state_dict_context", lambda m: contextlib.nullcontext()
    )
    monkeypatch.setattr(
        "torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict",
        load_sharded_optimizer_state_dict,
    )
    monkeypatch.setattr(
        FSDP,
        "optim_state_dict_to_load",
        staticmethod(lambda optim_state_dict, model, optim: optim_state_dict),
    )
    target, target_optimizer = trained(seed=2)
    returned = fsdp_strategy(s3_options, target, target_optimizer).load_checkpoint(uri)
    assert_same(returned, metadata)
    assert_same(target.state_dict(), saved["model"], "model")
    assert_same(target_optimizer.state_dict(), saved["optim"], "optimizer")
    assert [str(reader.location) for reader in readers] == [uri]


def test_fabric_saves_and_loads_s3_paths_through_s3_checkpoint_io(
    s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    fabric = Fabric(
        accelerator="cpu", devices=1, plugins=[S3CheckpointIO(configure_fsspec=False, **s3_options)]
    )
    module, optimizer = trained(seed=1)
    model, optimizer = fabric.setup(module.net, optimizer)
    uri = f"{s3_prefix}/fabric/step-3"
    fabric.save(uri, {"model": model, "optimizer": optimizer, "step": 3})
    target, target_optimizer = trained(seed=2)
    model2, optimizer2 = fabric.setup(target.net, target_optimizer)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    assert fabric.load(uri, state) == {}
    assert state["step"] == 3
    assert_same(model2.state_dict(), model.state_dict(), "model")
    assert_same(optimizer2.state_dict(), optimizer.state_dict(), "optimizer")


# -- bad input ---------------------------------------------------------------------------


def test_options_that_cannot_work_are_refused(s3_options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="save_distributed_checkpoint=False"):
        S3ModelParallelStrategy(save_distributed_checkpoint=False, configure_fsspec=False)
    with pytest.raises(ConfigError, match="state_dict_type='full'"):
        S3FSDPStrategy(state_dict_type="full", configure_fsspec=False)
    with pytest.raises(ConfigError, match="save_distributed_checkpoint=False"):
        S3FabricModelParallelStrategy(
            parallelize_fn=lambda m, mesh: m, save_distributed_checkpoint=False
        )


def test_a_local_path_is_refused_with_one_clear_error(tmp_path: Path) -> None:
    strategy = S3ModelParallelStrategy(endpoint_url="http://127.0.0.1:1", configure_fsspec=False)
    with pytest.raises(ConfigError, match=r"s3:// paths, got .*local.ckpt"):
        strategy.save_checkpoint({"state_dict": {}}, tmp_path / "local.ckpt")
    assert not (tmp_path / "local.ckpt").exists()
    fabric_strategy = S3FabricModelParallelStrategy(parallelize_fn=lambda m, mesh: m)
    with pytest.raises(ConfigError, match="dict holding the model"):
        fabric_strategy.load_checkpoint("s3://bucket/run/step-1", torch.nn.Linear(2, 2))


def test_without_lightning_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n.startswith("s3ckpt.integrations.lightning")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)  # import lightning fails
    with pytest.raises(ImportError, match=r"pip install './s3ckpt\[lightning\]'"):
        importlib.import_module("s3ckpt.integrations.lightning")


def test_the_compat_names_exist_in_the_installed_lightning() -> None:
    _, optimizer = trained(seed=1)
    assert lightning_compat.inner_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert lightning_compat.inner_optimizer(optimizer) is optimizer
    lightning_compat.check_requested_keys(["a"], ["a", "b"], strict=True)
    with pytest.raises(KeyError, match="'c'"):
        lightning_compat.check_requested_keys(["c"], ["a"], strict=True)
    assert callable(lightning_compat.sharded_state_dict_context)


@pytest.mark.distributed
@pytest.mark.subprocess
def test_the_quickstart_script_runs_as_written_on_two_ranks(tmp_path: Path) -> None:
    """docs/quickstart.md's sharded-strategy script (a ``py`` block, which
    test_quickstart.py does not run: it needs two processes), under torchrun."""
    blocks = re.findall(r"^```py\n(.*?)^```", QUICKSTART.read_text(), re.S | re.M)
    [script] = [block for block in blocks if "S3ModelParallelStrategy(" in block]
    (tmp_path / "train.py").write_text(script)
    with LocalS3Server(["ckpt"]) as server:
        env = {
            **os.environ,
            **server.env(),
            "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "PYTHONPATH": str(ROOT),
        }
        command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        done = subprocess.run(
            [sys.executable, *command, "train.py"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        options = {
            "endpoint_url": server.endpoint_url,
            "access_key_id": server.access_key,
            "secret_access_key": server.secret_key,
            "region": server.region,
        }
        # 64 samples, 8 a batch, 2 ranks: 4 steps an epoch; save_top_k=1 kept the newest.
        assert committed_names("s3://ckpt/sharded", options) == ["epoch=1-step=8.ckpt", "last.ckpt"]
        stored = S3StorageReader("s3://ckpt/sharded/last.ckpt", **options).read_metadata()
        assert META_KEY in stored.state_dict_metadata


def test_lightning_internals_are_allowed_in_its_compat_module_only() -> None:
    source = (
        "from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context\n"
        "from lightning.pytorch.core.optimizer import LightningOptimizer\n"
        "def inner(o: LightningOptimizer):\n    return o._optimizer\n"
    )
    outside = private_names.module_violations(source, "s3ckpt/integrations/lightning/sharded.py")
    assert [v.name for v in outside] == [
        "lightning.fabric.strategies.fsdp._get_sharded_state_dict_context"
    ]
    inside = private_names.module_violations(source, "s3ckpt/integrations/lightning/compat.py")
    assert list(inside) == []
