"""The ranks of ``test_deepspeed.py``: DeepSpeed engines on the CPU accelerator over gloo.

Each entry point runs in a process started by ``_dist_worker.run_ranks`` (with the
environment ``test_deepspeed.py`` sets up: DeepSpeed's CPU accelerator, its built op) and
receives the S3 connection, the checkpoint folder and a report directory. A rank compares
what it can compare itself (bit-exact state after a load) and leaves a report
(``torch.save``) of what it saved and saw for the parent test.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo
from rank_exit import leave

from s3ckpt import ConfigError
from s3ckpt.integrations.deepspeed import attach, load_checkpoint, save_checkpoint
from s3ckpt.s3.store import ObjectStore

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
QUICKSTART_SECTION = "## 13. DeepSpeed"


def init(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    deepspeed.init_distributed(dist_backend="gloo")


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
    }


def new_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def build(stage: int, seed: int, s3: dict[str, Any], **options: Any) -> Any:
    model = new_model(seed)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(stage)
    )
    attach(engine, **s3, **options)
    return engine


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(2, 8, generator=g)


def train(engine: Any, steps: range) -> None:
    for step in steps:
        loss = engine(batch(step)).square().mean()
        engine.backward(loss)
        engine.step()


def tensors(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by path (cloned)."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        found[path] = tree.detach().clone()
    elif isinstance(tree, dict):
        for key, value in tree.items():
            found.update(tensors(value, f"{path}/{key}"))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            found.update(tensors(value, f"{path}/{index}"))
    return found


def snapshot(engine: Any) -> dict[str, Any]:
    """What a resume must restore exactly: weights, optimizer (ZeRO partitions included),
    schedule and counters."""
    return {
        "module": tensors(engine.module.state_dict()),
        "optimizer": tensors(engine.optimizer.state_dict()),
        "lr": engine.lr_scheduler.state_dict(),
        "global_steps": engine.global_steps,
    }


def assert_same(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    for part in ("module", "optimizer"):
        assert actual[part].keys() == expected[part].keys(), (what, part)
        for name, tensor in expected[part].items():
            assert torch.equal(actual[part][name], tensor), f"{what}: {part}{name} differs"
    assert actual["lr"] == expected["lr"], what
    assert actual["global_steps"] == expected["global_steps"], what


def record_puts(log: list[str]) -> None:
    """Append the key of every PutObject this process sends to ``log``."""
    put = ObjectStore.put

    async def recorded(self: ObjectStore, key: str, *args: Any, **kwargs: Any) -> str:
        result = await put(self, key, *args, **kwargs)
        log.append(key)
        return result

    ObjectStore.put = recorded  # type: ignore[method-assign]


# -- entry points ---------------------------------------------------------------------------


def save_and_resume(
    rank: int, world_size: int, port: int, s3: dict[str, Any], folder: str, stage: int, out: str
) -> None:
    """Train, save ``t1``, train on (the reference); then a fresh engine with other
    weights resumes from ``latest`` and must match ``t1`` and then the reference, bit for
    bit. ``t2`` is saved after that, and ``t1`` loaded again by its tag."""
    init(rank, world_size, port)
    puts: list[str] = []
    record_puts(puts)
    engine = build(stage, seed=0, s3=s3)
    train(engine, range(3))
    assert save_checkpoint(engine, folder, tag="t1", client_state={"epoch": 7})
    saved = snapshot(engine)
    train(engine, range(3, 5))
    reference = snapshot(engine)

    resumed = build(stage, seed=1, s3=s3)
    fresh = snapshot(resumed)
    assert any(
        not torch.equal(fresh[part].get(name, torch.empty(0)), tensor)
        for part in ("module", "optimizer")
        for name, tensor in saved[part].items()
    ), "the fresh engine starts from the saved state already: the load would prove nothing"
    load_path, client_state = load_checkpoint(resumed, folder)
    assert load_path is not None and load_path.startswith(f"{folder}/t1/"), load_path
    assert client_state is not None and client_state["epoch"] == 7
    assert_same(snapshot(resumed), saved, "after the load")
    train(resumed, range(3, 5))
    assert_same(snapshot(resumed), reference, "after resuming")
    assert save_checkpoint(resumed, folder, tag="t2")
    assert load_checkpoint(resumed, folder, tag="t1")[1] is not None
    assert_same(snapshot(resumed), saved, "t1 again by its tag")
    torch.save(
        {
            "puts": puts,
            "tensors": len(saved["module"]) + len(saved["optimizer"]),
            "optimizer_tensors": len(saved["optimizer"]),
        },
        Path(out) / f"rank{rank}.pt",
    )
    leave()


def async_save_and_resume(
    rank: int, world_size: int, port: int, s3: dict[str, Any], folder: str, stage: int, out: str
) -> None:
    """``async_save``: ``save_checkpoint`` returns once the files are copied; training
    goes on while the checkpoint process uploads; a fresh engine resumes from ``latest``
    and must match the state of the moment of the save, bit for bit."""
    from s3ckpt.integrations.deepspeed import s3_engine

    init(rank, world_size, port)
    engine = build(stage, seed=0, s3=s3, async_save=True)
    train(engine, range(3))
    assert save_checkpoint(engine, folder, tag="t1", client_state={"epoch": 7})
    saved = snapshot(engine)  # what the save copied; training goes on meanwhile
    checkpoints = s3_engine(engine)
    pid = checkpoints._process.pid
    train(engine, range(3, 5))
    checkpoints.wait()
    tag_after_wait = checkpoints.latest_tag(folder)
    assert save_checkpoint(engine, folder, tag="t2")  # waits for nothing: t1 is done
    checkpoints.close()
    resumed = build(stage, seed=1, s3=s3)
    load_path, client_state = load_checkpoint(resumed, folder, tag="t1")
    assert load_path is not None and client_state is not None and client_state["epoch"] == 7
    assert_same(snapshot(resumed), saved, "t1, saved in the background")
    torch.save(
        {"pid": pid, "own_pid": os.getpid(), "latest_after_wait": tag_after_wait,
         "latest": checkpoints.latest_tag(folder)},
        Path(out) / f"rank{rank}.pt",
    )  # fmt: skip
    leave()


def killed_before_commit(
    rank: int, world_size: int, port: int, s3: dict[str, Any], folder: str, out: str
) -> None:
    """Save ``t1``; then rank 0 is SIGKILLed during ``t2``'s commit, as it is about to
    write the manifest (every data object of ``t2`` is in)."""
    init(rank, world_size, port)
    engine = build(2, seed=0, s3=s3)
    train(engine, range(2))
    save_checkpoint(engine, folder, tag="t1")
    refused = bad_commit(engine, folder, rank)
    torch.save(
        {
            "module": tensors(engine.module.state_dict()),
            "optimizer": snapshot(engine)["optimizer"],
            "refused": refused,
        },
        Path(out) / f"rank{rank}.pt",
    )
    train(engine, range(2, 3))
    if rank == 0:
        put = ObjectStore.put

        async def dying(self: ObjectStore, key: str, *args: Any, **kwargs: Any) -> str:
            if key.endswith("/t2/manifest.json"):
                (Path(out) / "killed").write_text(key)
                os.kill(os.getpid(), signal.SIGKILL)
            return await put(self, key, *args, **kwargs)

        ObjectStore.put = dying  # type: ignore[method-assign]
    save_checkpoint(engine, folder, tag="t2")


def bad_commit(engine: Any, folder: str, rank: int) -> str:
    """A commit where rank 1 alone saved a file that cannot be stored: every rank must
    raise the same error (none may be left waiting in a collective)."""
    checkpoints = engine.checkpoint_engine
    info = CheckpointCommitInfo(tag="bad", save_dir=folder, save_latest=False)
    checkpoints.create(info)
    if rank == 1:
        checkpoints.save({"f": lambda: 0}, f"{folder}/bad/x.pt")
    try:
        checkpoints.commit(info)
    except ConfigError as exc:
        return str(exc)
    raise AssertionError("a commit with an unstorable file went through")


def quickstart(rank: int, world_size: int, port: int, endpoint: str, folder: str, out: str) -> None:
    """docs/quickstart.md's DeepSpeed block, as written (the store and folder swapped for
    the test's), run twice: from scratch, then resuming from what the first run saved."""
    init(rank, world_size, port)
    text = QUICKSTART.read_text().split(QUICKSTART_SECTION, 1)[1]
    code = text.split("```py\n", 1)[1].split("```", 1)[0]
    code = code.replace("https://flashblade.example.com", endpoint)
    code = code.replace("s3://ckpt/ds-run1", folder)
    starts = []
    for total_steps in (2, 4):
        scope: dict[str, Any] = {
            "model": new_model(0),
            "ds_config": ds_config(2),
            "total_steps": total_steps,
            "next_batch": batch,
        }
        exec(compile(code, str(QUICKSTART), "exec"), scope)
        starts.append(scope["start"])
    torch.save({"starts": starts}, Path(out) / f"rank{rank}.pt")
    leave()
