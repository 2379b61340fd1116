"""Rank entry points of the Megatron-core tests (``test_megatron.py``), run on gloo ranks.

Megatron's ``dist_checkpointing`` calls a few CUDA functions even when every tensor is on
the CPU (``torch.cuda.current_device()`` as the device of its gloo collectives'
tensors, ``torch.cuda.synchronize()`` after staging); :func:`cpu_only_cuda` stands them
in, in the test processes only, with the quickstart's own block for it, so that the
block a CPU-only reader copies is the one every Megatron test runs on. Each rank leaves a
report (``torch.save``) for the parent test; states are deterministic, so the parent
computes its expectations too.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report

ROWS, COLS = 6, 40  # each rank's shard of "layer.weight"; kept small: these tests check logic


QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"


def quickstart_blocks() -> list[str]:
    """The ``py`` blocks of the quickstart's Megatron section: the save and load, then the
    stand-ins for a CPU-only machine."""
    section = QUICKSTART.read_text().split("## 12. Megatron-core", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```py\n(.*?)^```", section, re.S | re.M)


def cpu_only_cuda() -> None:
    """The CUDA calls Megatron makes on a CPU machine, stood in for by the quickstart's
    block (tests only)."""
    _, stand_ins = quickstart_blocks()
    exec(compile(stand_ins, "docs/quickstart.md", "exec"), {})
    assert torch.cuda.current_device() == "cpu"


def full_weight(world_size: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * world_size, COLS, generator=g)


def bias(step: int) -> torch.Tensor:
    return torch.arange(COLS, dtype=torch.float64) * (step + 0.5)


def state_values(rank: int, world_size: int, step: int) -> dict[str, Any]:
    """What rank ``rank`` holds at ``step``: its rows of the weight, the replicated bias, a
    per-rank object, and the common (non-sharded) state."""
    return {
        "weight": full_weight(world_size, step)[rank * ROWS : (rank + 1) * ROWS].clone(),
        "bias": bias(step),
        "rng": torch.tensor([step, rank], dtype=torch.int64),
        "common": {"iteration": step, "args": {"lr": 0.1 * step, "name": "gpt"}},
    }


def sharded_state_dict(values: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """``values`` as Megatron's sharded state dict: a TP-sharded weight, a replicated bias
    (main replica on rank 0), a ShardedObject per rank and plain common entries."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return {
        "model": {
            "weight": ShardedTensor.from_rank_offsets(
                "layer.weight", values["weight"], (0, rank, world_size)
            ),
            "bias": ShardedTensor.from_rank_offsets("layer.bias", values["bias"], replica_id=rank),
        },
        "rng_state": ShardedObject("rng_state", values["rng"], (world_size,), (rank,), 0),
        **values["common"],
    }


def empty_target(rank: int, world_size: int) -> dict[str, Any]:
    garbage = {
        "weight": torch.full((ROWS, COLS), 7.0),
        "bias": torch.full((COLS,), 7.0, dtype=torch.float64),
        "rng": None,
        "common": {},
    }
    return sharded_state_dict(garbage, rank, world_size)


def flat(loaded: dict[str, Any]) -> dict[str, Any]:
    """A loaded state dict as comparable values."""
    return {
        "weight": loaded["model"]["weight"].clone(),
        "bias": loaded["model"]["bias"].clone(),
        "rng": loaded["rng_state"],
        "common": {k: loaded[k] for k in ("iteration", "args") if k in loaded},
    }


def tracker(run: str) -> str:
    return os.path.join(run, "latest_checkpointed_iteration.txt")


def step_dir(run: str, step: int) -> str:
    return os.path.join(run, f"iter_{step:07d}")


def write_tracker(run: str, step: int) -> None:
    """What Megatron-LM's training loop does after a save (``iter_finalize_fn``)."""
    from megatron.core.msc_utils import open_file

    if dist.get_rank() == 0:
        with open_file(tracker(run), "w") as f:
            f.write(str(step))


def read_tracker(run: str) -> int:
    from megatron.core.msc_utils import open_file

    with open_file(tracker(run), "r") as f:
        return int(f.read().strip())


def load_step(run: str, step: int, rank: int, world_size: int, s3: dict[str, Any]) -> Any:
    from megatron.core import dist_checkpointing

    from s3ckpt.integrations.megatron import S3LoadShardedStrategy

    loaded = dist_checkpointing.load(
        empty_target(rank, world_size), step_dir(run, step), S3LoadShardedStrategy(**s3)
    )
    return flat(loaded)


def _start(rank: int, world_size: int, port: int, workdir: str) -> None:
    cpu_only_cuda()
    os.chdir(workdir)  # where a mangled s3:// path would appear as a folder
    _init(rank, world_size, port)


# -- the scenarios ------------------------------------------------------------------------------


def sync_scenario(rank: int, world_size: int, s3: dict[str, Any], run: str, mode: str) -> Any:
    """Save step 1 (``dist_checkpointing.save``), write the tracker, load it back.

    ``mode``: ``plain``, or ``fully_parallel`` (the strategy in Megatron's
    ``FullyParallelSaveStrategyWrapper``), or ``context`` (the strategy taken from a
    ``checkpointing_context`` as Megatron-LM's loop does, two saves)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    from s3ckpt.integrations.megatron import S3SaveShardedStrategy

    context: dict[str, Any] = {"save_strategy": S3SaveShardedStrategy(**s3)}
    if mode == "fully_parallel":
        context["save_strategy"] = FullyParallelSaveStrategyWrapper(
            context["save_strategy"], dist.group.WORLD
        )
    steps = (1, 2) if mode == "context" else (1,)
    for step in steps:
        values = state_values(rank, world_size, step)
        dist_checkpointing.save(
            sharded_state_dict(values, rank, world_size),
            step_dir(run, step),
            context["save_strategy"],
        )
        dist.barrier()
        write_tracker(run, step)
    dist.barrier()
    report = {"tracker": read_tracker(run)}
    report["loaded"] = {step: load_step(run, step, rank, world_size, s3) for step in steps}
    return report


def async_scenario(rank: int, world_size: int, s3: dict[str, Any], run: str) -> Any:
    """Step 1 saved asynchronously through Megatron's AsyncCallsQueue while training
    changes the tensors; the tracker written in the request's finalization."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from s3ckpt.integrations.megatron import S3SaveShardedStrategy

    calls = AsyncCallsQueue()
    values = state_values(rank, world_size, 1)
    request = dist_checkpointing.save(
        sharded_state_dict(values, rank, world_size),
        step_dir(run, 1),
        S3SaveShardedStrategy(**s3),
        async_sharded_save=True,
    )
    committed_when_finalized: list[int] = []
    request.add_finalize_fn(lambda: write_tracker(run, 1))
    if rank == 0:  # the rank that wrote the tracker, right after it
        request.add_finalize_fn(lambda: committed_when_finalized.append(read_tracker(run)))
    calls.schedule_async_request(request)
    values["weight"].add_(1000.0)  # training goes on: the save holds the state of step 1
    values["bias"].mul_(-1)
    calls.maybe_finalize_async_calls(blocking=True)
    calls.close()
    return {
        "tracker": read_tracker(run),
        "finalized": committed_when_finalized,
        "loaded": {1: load_step(run, 1, rank, world_size, s3)},
    }


def constant_structure_scenario(rank: int, world_size: int, s3: dict[str, Any], run: str) -> Any:
    """``--ckpt-assume-constant-structure``: one strategy with cached plans saves steps 1,
    2, 3 and step 3 again (over the committed one), asynchronously. Reports whether
    Megatron reused its plans, the objects committed step 3 held before it was saved
    again (with their ETags), and the loads: step 3 after the first replayed save, every
    step at the end."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from s3ckpt import catalog
    from s3ckpt.integrations.megatron import S3SaveShardedStrategy

    strategy = S3SaveShardedStrategy(**s3)
    strategy.use_cached_ckpt_structure = True  # what Megatron-LM sets for the flag
    calls = AsyncCallsQueue()
    reuse: list[bool] = []
    report: dict[str, Any] = {}
    for step, version in ((1, 1), (2, 2), (3, 3), (3, 4)):
        if (step, version) == (3, 4):
            manifest = catalog.show_checkpoint(step_dir(run, 3), **s3)
            report["replaced"] = {o.key: o.etag for o in manifest.objects}
            report["loaded_3_before"] = load_step(run, 3, rank, world_size, s3)
        values = state_values(rank, world_size, version)
        request = dist_checkpointing.save(
            sharded_state_dict(values, rank, world_size),
            step_dir(run, step),
            strategy,
            async_sharded_save=True,
            validate_access_integrity=step == 1,  # as Megatron-LM after the first save
        )
        request.add_finalize_fn(lambda step=step: write_tracker(run, step))
        calls.schedule_async_request(request)
        calls.maybe_finalize_async_calls(blocking=True)
        reuse.append(bool(strategy.validated_cache_reuse))
    calls.close()
    report["reuse"] = reuse
    report["loaded"] = {s: load_step(run, s, rank, world_size, s3) for s in (1, 2, 3)}
    report["tracker"] = read_tracker(run)
    return report


def crash_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], run: str, out_dir: str
) -> None:
    """Step 1 saved and tracked; step 2 saved asynchronously, its background writers held
    mid-upload (a multipart upload open) until the test SIGKILLs everything."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import s3ckpt.integrations.megatron.strategies as integration
    from s3ckpt.integrations.megatron import S3SaveShardedStrategy

    _start(rank, world_size, port, out_dir)
    strategy = S3SaveShardedStrategy(**s3, part_size=5 * 1024 * 1024)
    values = state_values(rank, world_size, 1)
    dist_checkpointing.save(
        sharded_state_dict(values, rank, world_size), step_dir(run, 1), strategy
    )
    dist.barrier()
    write_tracker(run, 1)
    dist.barrier()

    resolve = integration._StagedPlanner.resolve_data
    seen: list[str] = []

    def resolve_then_hold(self: Any, item: Any) -> Any:
        # In the forked writer: hand over the big tensor, then hold the next item back
        # while the big one's parts upload.
        if seen:
            Path(out_dir, f"uploading-{rank}").write_text(str(os.getpid()))
            time.sleep(600)
        seen.append(item.index.fqn)
        return resolve(self, item)

    integration._StagedPlanner.resolve_data = resolve_then_hold
    big = torch.randn(3 * 1024 * 1024, generator=torch.Generator().manual_seed(rank))  # 12 MiB
    state = sharded_state_dict(state_values(rank, world_size, 2), rank, world_size)
    state["model"]["big"] = dist_checkpointing.ShardedTensor.from_rank_offsets(
        "layer.big", big, (0, rank, world_size), prepend_axis_num=1
    )
    request = dist_checkpointing.save(state, step_dir(run, 2), strategy, async_sharded_save=True)
    request.add_finalize_fn(lambda: write_tracker(run, 2))
    calls = AsyncCallsQueue()
    calls.schedule_async_request(request)
    Path(out_dir, f"scheduled-{rank}").write_text(str(os.getpid()))
    time.sleep(600)  # the test kills this process, its writer and the whole group


def bad_input_scenario(
    rank: int, world_size: int, s3: dict[str, Any], run: str, workdir: str
) -> Any:
    """Each wrong use gets one clear error and leaves no local folder."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.msc_utils import open_file

    from s3ckpt.integrations.megatron import S3SaveShardedStrategy

    errors: dict[str, str] = {}

    def attempt(name: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        else:
            errors[name] = "no error"

    strategy = S3SaveShardedStrategy(**s3)
    values = state_values(rank, world_size, 1)
    attempt(
        "plain_strategy",
        lambda: dist_checkpointing.save(
            sharded_state_dict(values, rank, world_size),
            step_dir(run, 1),
            TorchDistSaveShardedStrategy("torch_dist", 1),
        ),
    )
    local = str(Path(workdir, f"local-ckpt-{rank}"))
    os.makedirs(local)
    attempt(
        "local_path",
        lambda: dist_checkpointing.save(
            sharded_state_dict(values, rank, world_size), local, strategy
        ),
    )
    attempt("tracker_uncommitted", lambda: write_tracker(run, 7))
    attempt("other_file", lambda: open_file(os.path.join(run, "notes.txt"), "w").close())
    attempt(
        "load_uncommitted",
        lambda: load_step(run, 1, rank, world_size, s3),
    )
    return {"errors": errors}


def failing_write_scenario(rank: int, world_size: int, s3: dict[str, Any], run: str) -> Any:
    """Step 1 committed; step 2's background write fails on rank 1: Megatron's
    finalization raises on every rank, nothing commits, the tracker keeps naming step 1."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from s3ckpt.integrations.megatron import MegatronS3Writer, S3SaveShardedStrategy

    strategy = S3SaveShardedStrategy(**s3)
    values = state_values(rank, world_size, 1)
    dist_checkpointing.save(
        sharded_state_dict(values, rank, world_size), step_dir(run, 1), strategy
    )
    dist.barrier()
    write_tracker(run, 1)
    write = MegatronS3Writer.write_assigned

    def fail_on_rank_1(self: Any, *args: Any) -> Any:
        if rank == 1:
            raise RuntimeError("the disk under rank 1 is on fire")
        return write(self, *args)

    MegatronS3Writer.write_assigned = fail_on_rank_1  # type: ignore[method-assign]
    calls = AsyncCallsQueue()
    try:
        request = dist_checkpointing.save(
            sharded_state_dict(state_values(rank, world_size, 2), rank, world_size),
            step_dir(run, 2),
            strategy,
            async_sharded_save=True,
        )
        request.add_finalize_fn(lambda: write_tracker(run, 2))
        calls.schedule_async_request(request)
        try:
            calls.maybe_finalize_async_calls(blocking=True)
            raised = "no error"
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raised = f"{type(exc).__name__}: {exc}"
    finally:
        MegatronS3Writer.write_assigned = write  # type: ignore[method-assign]
        calls.close()
    dist.barrier()
    return {"raised": raised, "tracker": read_tracker(run)}


class QuickstartModel:
    """What the quickstart's Megatron block leaves to the reader: a model with Megatron's
    ``sharded_state_dict()`` and ``load_state_dict``; it keeps a copy of its values at
    every ``sharded_state_dict()`` call (each save's, then the load's target)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.values = state_values(rank, world_size, 1)
        self.snapshots: list[dict[str, Any]] = []
        self.loaded: dict[str, Any] | None = None

    def sharded_state_dict(self) -> dict[str, Any]:
        self.snapshots.append(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.values.items()}
        )
        return sharded_state_dict(self.values, self.rank, self.world_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = flat(state)


def quickstart_scenario(rank: int, world_size: int, s3: dict[str, Any], code: str) -> Any:
    """docs/quickstart.md's Megatron block, as written (its store through ``AWS_*``)."""
    os.environ.update(
        AWS_ENDPOINT_URL=s3["endpoint_url"],
        AWS_ACCESS_KEY_ID=s3["access_key_id"],
        AWS_SECRET_ACCESS_KEY=s3["secret_access_key"],
        AWS_REGION=s3["region"],
    )
    model = QuickstartModel(rank, world_size)

    def train_step(iteration: int) -> None:
        model.values["weight"].add_(1.0)
        model.values["bias"].mul_(0.5)

    reuse: list[bool] = []  # Megatron's plan-cache state after each save, as train_step sees it
    namespace: dict[str, Any] = {"model": model}

    def train_step_after_save(iteration: int) -> None:
        reuse.append(bool(namespace["strategy"].validated_cache_reuse))
        train_step(iteration)

    namespace["train_step"] = train_step_after_save
    exec(compile(code, "docs/quickstart.md", "exec"), namespace)
    return {"saved": model.snapshots[2], "loaded": model.loaded, "reuse": reuse}


def all_main(
    rank: int,
    world_size: int,
    port: int,
    s3: dict[str, Any],
    runs: dict[str, str],
    out_dir: str,
    quickstart: str,
) -> None:
    """Every scenario but the crash, one after the other in one job (each rank imports
    Megatron once): a report per scenario and rank under ``out_dir/<scenario>/``."""
    _start(rank, world_size, port, out_dir)
    scenarios = {
        "sync": lambda run: sync_scenario(rank, world_size, s3, run, "plain"),
        "fully_parallel": lambda run: sync_scenario(rank, world_size, s3, run, "fully_parallel"),
        "context": lambda run: sync_scenario(rank, world_size, s3, run, "context"),
        "async": lambda run: async_scenario(rank, world_size, s3, run),
        "constant": lambda run: constant_structure_scenario(rank, world_size, s3, run),
        "bad_input": lambda run: bad_input_scenario(rank, world_size, s3, run, out_dir),
        "failing_write": lambda run: failing_write_scenario(rank, world_size, s3, run),
        "quickstart": lambda run: quickstart_scenario(rank, world_size, s3, quickstart),
    }
    try:
        for name, scenario in scenarios.items():
            report = scenario(runs[name])
            Path(out_dir, name).mkdir(exist_ok=True)
            _report(str(Path(out_dir, name)), rank, report)
            dist.barrier()
    finally:
        dist.destroy_process_group()
