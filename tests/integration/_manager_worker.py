"""Rank entry points for the multi-rank CheckpointManager test (gloo ranks).

Same pattern as :mod:`_dist_worker` (whose launcher and process-group set-up are reused):
everything a rank needs comes in as arguments, and each rank leaves a ``torch.save``
report in ``out_dir`` for the parent test to check.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from _dist_worker import _init, _report, run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["manager_main", "run_ranks"]


class AppState(Stateful):
    """Model and optimizer through DCP's state_dict helpers, as in the DCP tutorial."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def make_state(rank: int, seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A replicated model + AdamW (same on every rank, as under DDP) and a per-rank tensor."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    own = torch.full((16 + rank,), float(seed), dtype=torch.float64)
    return model, {"app": AppState(model, optimizer), f"rank{rank}": own}


def train_step(model: torch.nn.Module, state: dict[str, Any], step: int) -> None:
    optimizer = state["app"].optimizer
    inputs = torch.Generator().manual_seed(step)
    loss = model(torch.randn(8, 32, generator=inputs)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def snapshot(model: torch.nn.Module, state: dict[str, Any], rank: int) -> dict[str, Any]:
    optim = state["app"].optimizer.state_dict()["state"]
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "exp_avg": [optim[i]["exp_avg"].clone() for i in sorted(optim)],
        "own": state[f"rank{rank}"].clone(),
    }


def manager_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str
) -> None:
    """Save steps 1-3 with retention, agree on skips, restart and resume; report everything."""
    from s3ckpt import CheckpointManager

    with reporting_rank(rank, world_size, port, out_dir) as report:
        model, state = make_state(rank, seed=1)
        manager = CheckpointManager(uri, keep_last=2, **s3)
        report["initial"] = manager.load_latest(state)
        for step in (1, 2, 3):
            train_step(model, state, step)
            state[f"rank{rank}"].add_(step)
            report[f"saved{step}"] = manager.save(step, state)
        report["last_metrics"] = manager.wait()
        report["expected"] = snapshot(model, state, rank)
        report["steps"] = manager.steps()
        report["latest"] = manager.latest_step()
        report["resave"] = manager.save(3, state)  # already committed: skipped on every rank
        manager.close()

        report["skips"] = skip_decisions(rank, f"{uri}-skip", s3)
        report["process_mode"] = process_mode(model, state, f"{uri}-process", s3)

        fresh_model, fresh = make_state(rank, seed=2)
        with CheckpointManager(uri, **s3) as restarted:
            report["restored"] = restarted.load_latest(fresh)
        report["loaded"] = snapshot(fresh_model, fresh, rank)
        dist.barrier()


@contextmanager
def reporting_rank(rank: int, world_size: int, port: int, out_dir: str) -> Iterator[dict]:
    """Join the gloo group; on the way out, leave the report (whatever it holds) for the
    parent test and leave the group."""
    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        yield report
    finally:
        _report(out_dir, rank, report)
        dist.destroy_process_group()


def skip_decisions(rank: int, uri: str, s3: dict[str, Any]) -> list[bool]:
    """Back-to-back saves under ``if_busy="skip"``: ranks must take the same decisions,
    or one would start a save (and its collectives) alone and hang."""
    from s3ckpt import CheckpointManager

    big = {f"big{rank}": torch.randn(4 * 1024 * 1024)}  # 16 MiB: uploads take a while
    with CheckpointManager(uri, if_busy="skip", **s3) as manager:
        return [manager.save(step, big) for step in range(1, 6)]


def process_mode(
    model: torch.nn.Module, state: dict[str, Any], uri: str, s3: dict[str, Any]
) -> Any:
    """``async_mode="process"``: the upload runs in the rank's checkpoint process, which
    closing the manager stops, so that nothing outlives the test."""
    from s3ckpt import CheckpointManager

    with CheckpointManager(uri, async_mode="process", **s3) as manager:
        pid = manager._saves.process.pid
        manager.save(7, state)
        metrics = manager.wait()
        result = {"steps": manager.steps(), "bytes": metrics.bytes if metrics else None}
    result["background_stopped"] = not os.path.exists(f"/proc/{pid}")  # close() stopped it
    return result


def group_edges_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str
) -> None:
    """A manager on a one-rank group, and a copy to host memory failing on one rank."""
    with reporting_rank(rank, world_size, port, out_dir) as report:
        solo = dist.new_group([0])  # every rank takes part in creating it
        if rank == 0:
            report["solo"] = solo_saves(f"{uri}-solo", s3, solo)
        dist.barrier()
        for mode in ("thread", "process"):
            report[mode] = failed_staging(rank, f"{uri}-{mode}", s3, mode)
            dist.barrier()


def solo_saves(uri: str, s3: dict[str, Any], group: dist.ProcessGroup) -> list[int]:
    """Rank 0 alone saves (the "only rank 0 saves" pattern): nothing may wait for rank 1."""
    from s3ckpt import CheckpointManager

    with CheckpointManager(uri, process_group=group, **s3) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.full((1000,), float(step))})
        manager.wait()
        return manager.steps()


def failed_staging(rank: int, uri: str, s3: dict[str, Any], mode: str) -> dict[str, Any]:
    """Rank 1's copy to host memory fails at step 1 (pinned memory exhausted, say): every
    rank must learn it at its next call instead of waiting in the save's collectives, and
    the ranks' collectives must stay in step afterwards."""
    from s3ckpt import CheckpointError, CheckpointManager, catalog

    outcome: dict[str, Any] = {}
    state = {f"w{rank}": torch.full((1000,), float(rank))}
    with CheckpointManager(uri, async_mode=mode, **s3) as manager:
        stage = manager._saves._stage
        if rank == 1:

            def broken(state_dict: Any, slot: int) -> Any:
                raise RuntimeError("cannot pin memory")

            manager._saves._stage = broken  # type: ignore[method-assign]
        try:
            outcome["first"] = manager.save(1, state)
        except CheckpointError as exc:  # the manager raises s3ckpt errors only
            outcome["first"] = f"raised: {exc}"
        manager._saves._stage = stage  # type: ignore[method-assign]
        try:
            outcome["second"] = manager.save(2, state)
        except CheckpointError as exc:
            outcome["second"] = f"raised: {exc}"
        outcome["third"] = manager.save(3, state)
        manager.wait()
        outcome["steps"] = manager.steps()
    listed = catalog.list_checkpoints(uri, include_uncommitted=True, **s3)
    outcome["uncommitted"] = [i.name for i in listed if not i.committed]
    return outcome


class TierRank:
    """One rank training under a memory tier, for the fault scenarios: its saves (and the
    state each step had), its restores from a fresh state, and a save whose checkpoint
    process rank 1 kills."""

    def __init__(self, rank: int, uri: str, s3: dict[str, Any], tier: Any) -> None:
        self.rank, self.uri, self.s3, self.tier = rank, uri, s3, tier
        self.model, self.state = make_state(rank, seed=1)
        self.expected: dict[int, dict[str, Any]] = {}

    def manager(self) -> Any:
        from s3ckpt import CheckpointManager

        return CheckpointManager(self.uri, memory_tier=self.tier, **self.s3)

    def save(self, manager: Any, step: int) -> Any:
        """Train ``step``, save it, wait; its metrics."""
        train_step(self.model, self.state, step)
        self.state[f"rank{self.rank}"].add_(step)
        manager.save(step, self.state)
        metrics = manager.wait()
        self.expected[step] = snapshot(self.model, self.state, self.rank)
        return metrics

    def restored(self, held: list[Any] | None = None, running: Any = None) -> tuple[Any, bool]:
        """``load_latest`` into a fresh state (by a new manager, or the ``running`` one):
        (step, tier) and whether it is bit-exact; the held steps after it go in ``held``,
        if given."""
        fresh_model, fresh = make_state(self.rank, seed=2)
        with nullcontext(running) if running is not None else self.manager() as manager:
            step = manager.load_latest(fresh)
            where = (step, manager.last_restore.tier)
            if held is not None:
                held.append(manager.held_steps())
        return where, same_state(snapshot(fresh_model, fresh, self.rank), self.expected[step])

    def killed_save(self, manager: Any, step: int) -> str:
        """Save ``step`` while rank 1's checkpoint process is stopped, then kill it: what
        ``wait`` raised ("saved" if nothing)."""
        import signal

        train_step(self.model, self.state, step)
        process = manager._saves.process
        if self.rank == 1:
            os.kill(process.pid, signal.SIGSTOP)  # holds nothing, sends nothing
        manager.save(step, self.state)
        if self.rank == 1:
            os.kill(process.pid, signal.SIGKILL)
        try:
            manager.wait()
        except Exception as exc:
            return type(exc).__name__
        return "saved"


def memory_tier_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str,
    roots: list[str],
) -> None:  # fmt: skip
    """The memory tier's faults on two gloo ranks, each rank's root a simulated node's
    shared memory: every rank restarted, one rank's copy deleted, a whole node lost, a
    rank's checkpoint process killed between its copy and the step's commit. Each
    restore's step and source, and whether it is bit-exact, go in the report."""
    import shutil
    from pathlib import Path

    from s3ckpt import MemoryTier
    from s3ckpt.background import held
    from s3ckpt.tier.copies import node_copies

    tier = MemoryTier(keep=2, s3_every=2, root=Path(roots[rank]))
    run = TierRank(rank, uri, s3, tier)

    with reporting_rank(rank, world_size, port, out_dir) as report:
        with run.manager() as manager:
            for step in (1, 2, 3, 4):
                run.save(manager, step)
            report["held"] = manager.held_steps()
            report["s3"] = manager.steps()
        report["restarted"] = run.restored()  # every rank restarted: 4, from memory

        with run.manager() as manager:
            try:  # the ranks disagree on whether step 5 goes to S3: refused on both
                manager.save(5, run.state, s3=rank == 0)
                report["disagreement"] = "saved"
            except Exception as exc:
                report["disagreement"] = f"{type(exc).__name__}: {exc}"
            run.save(manager, 5)  # memory only
        if rank == 1:  # one rank's copy of the newest step is gone
            for copy in node_copies(tier.root):
                if copy.held.step == 5:
                    (copy.folder / held.DESCRIPTOR).unlink()
        report["one_copy_deleted"] = run.restored()  # 5 is not whole: 4, from memory

        if rank == 1:
            shutil.rmtree(tier.root)  # a whole node lost: its processes and its memory
        report["node_lost"] = run.restored()  # rank 1 holds nothing: 4, from S3

        with run.manager() as manager:
            run.save(manager, 5)
            report["killed_save"] = run.killed_save(manager, 6)  # stopped before its record
            report["held_after_kill"] = sorted(c.held.step for c in node_copies(tier.root))
        report["killed_before_commit"] = run.restored()  # rank 1 never held 6: 5, from memory
        dist.barrier()


def lineage_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str,
    roots: list[str],
) -> None:  # fmt: skip
    """Two timelines that save the same step numbers, their copies left on two simulated
    nodes: (1) each rank on its own node saves steps 1 (to S3), 2 and 3; (2) restarted
    with the ranks swapped between the nodes, the job holds nothing of its own, loads
    S3's step 1 and trains on differently, saving 2 and 3 (3 to S3); (3) restarted with
    both ranks on node 0, rank 0 finds the first timeline's step 3 there and rank 1 the
    second's. Each restore's step and source, and whether it is bit-exact, go in the
    report."""
    from pathlib import Path

    from s3ckpt import MemoryTier

    def placed(node: int) -> MemoryTier:
        return MemoryTier(keep=3, replicas=0, s3_every=1000, root=Path(roots[node]))

    run = TierRank(rank, uri, s3, placed(rank))
    with reporting_rank(rank, world_size, port, out_dir) as report:
        with run.manager() as manager:
            for step in (1, 2, 3):
                train_step(run.model, run.state, step)
                manager.save(step, run.state, s3=step == 1)
                manager.wait()
        run.tier = placed(1 - rank)
        with run.manager() as manager:
            report["swapped"] = (manager.load_latest(run.state), manager.last_restore.tier)
            for step in (2, 3):
                train_step(run.model, run.state, 100 + step)  # another timeline
                manager.save(step, run.state, s3=step == 3)
                manager.wait()
                run.expected[step] = snapshot(run.model, run.state, rank)
        run.tier = placed(0)
        report["together"] = run.restored()
        dist.barrier()


def same_state(loaded: dict[str, Any], expected: dict[str, Any]) -> bool:
    return (
        all(torch.equal(loaded["params"][k], v) for k, v in expected["params"].items())
        and len(loaded["exp_avg"]) == len(expected["exp_avg"])
        and all(map(torch.equal, loaded["exp_avg"], expected["exp_avg"]))
        and torch.equal(loaded["own"], expected["own"])
    )


def replicated_tier_main(
    rank: int, world_size: int, port: int, s3: dict[str, Any], uri: str, out_dir: str,
    roots: list[str],
) -> None:  # fmt: skip
    """Replicas on two simulated nodes (one rank each): held and replicated steps; a node
    lost and its rank's state rebuilt from its peer's replica; a save whose peer's
    checkpoint process is killed before its copy is sent."""
    import shutil
    from pathlib import Path

    from s3ckpt import MemoryTier
    from s3ckpt.background import held, replicate
    from s3ckpt.tier.copies import node_copies

    # this small model's weights count as large regions: a restore receives them from a
    # peer straight into the model (the rest into memory it copies from)
    replicate._LARGE = 1024
    tier = MemoryTier(keep=2, s3_every=2, root=Path(roots[rank]), node=f"node{rank}")
    run = TierRank(rank, uri, s3, tier)

    with reporting_rank(rank, world_size, port, out_dir) as report:
        with run.manager() as manager:
            for step in (1, 2, 3, 4):
                metrics = run.save(manager, step)
            report["metrics"] = metrics
            report["held"] = manager.held_steps()
            report["replicated"] = manager.replicated_steps()
            run.save(manager, 5)  # memory only: newer than S3's 4
        if rank == 1:
            shutil.rmtree(tier.root)  # node 1 lost: its processes and its memory
        held_after_restore: list[Any] = []
        # rank 1's copy of 5 comes back from node 0
        report["node_lost"] = run.restored(held_after_restore)

        with run.manager() as manager:
            run.save(manager, 6)  # the processes have met: a kill now is one mid-save
            report["killed_save"] = run.killed_save(manager, 7)
            report["held_after_kill"] = manager.held_steps()
        # 7 is not whole anywhere: 6
        report["killed_during_replication"] = run.restored(held_after_restore)
        report["held_after_restore"] = held_after_restore

        with run.manager() as manager:
            run.save(manager, 8)
            run.save(manager, 9)  # both slots now have the manager's staging memory
            if rank == 1:  # its copy of 9 lost while the manager runs
                held.invalidate(
                    next(h.folder for h in manager._tier.copies.held() if h.held.step == 9)
                )
            dist.barrier()
            # rank 1 receives 9 into the slot it staged 9 in
            report["fetched_in_place"] = run.restored(running=manager) == ((9, "memory"), True)
            run.save(manager, 10)
            run.save(manager, 11)  # staged into that slot again, through the same memory
        report["after_fetch_in_place"] = run.restored()
        dist.barrier()

        # node 1 lost again, and node 0's replica of rank 1's 11 damaged in a region that
        # lands straight in the model: found as it lands, 10 loaded over it from memory
        if rank == 0:
            (replica,) = [
                c for c in node_copies(tier.root)
                if c.replica and c.held.rank == 1 and c.held.step == 11
            ]  # fmt: skip
            large = next(r for r in replica.held.regions if r.nbytes >= replicate._LARGE)
            with open(replica.folder / f"segment-{large.segment}", "r+b") as f:
                f.seek(large.offset + large.nbytes // 2)
                byte = f.read(1)[0]
                f.seek(large.offset + large.nbytes // 2)
                f.write(bytes([byte ^ 0x10]))
        if rank == 1:
            shutil.rmtree(tier.root)
        dist.barrier()
        report["damaged_replica"] = run.restored()
        dist.barrier()
