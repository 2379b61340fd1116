"""A restore is whole, or it says what it left.

With the state written as the docs and DCP's tutorials write it,
``{"model": model, "optim": optimizer, "sched": scheduler}``, a fresh process with a fresh
optimizer gets every saved moment back: its next training steps match an uninterrupted
run exactly (CheckpointManager in process and thread mode, TieredCheckpointProcess from
memory, plain dcp.load with S3StorageReader, FSDP2 on one and two gloo ranks; two param
groups and an LR scheduler throughout). What a load leaves out or converts is one warning
naming it, or with ``strict=True`` an error before anything is loaded.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks.zygote import Zygote
from s3ckpt import (
    CheckpointManager,
    MemoryTier,
    S3StorageReader,
    S3StorageWriter,
    StateMismatchError,
    export_checkpoint,
)

HERE = Path(__file__).parent
WORKER = "_whole_restore_worker"
# What the worker imports when it runs, imported once where its processes are forked.
PRELOAD = ("s3ckpt.CheckpointManager", "s3ckpt.S3StorageWriter", "s3ckpt.S3StorageReader",
           "s3ckpt.MemoryTier", "s3ckpt.TieredCheckpointProcess", "torch.distributed.fsdp",
           "torch.distributed.device_mesh")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env() -> dict[str, str]:
    paths = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class Workers:
    """The worker script's processes, each a process of its own running the script as
    ``__main__``, forked from an interpreter that imported it and :data:`PRELOAD` once
    (:class:`benchmarks.zygote.Zygote`): one such interpreter per rank, since ranks run
    side by side. A context manager."""

    def __init__(self) -> None:
        self._zygotes: list[Zygote] = []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        for zygote in self._zygotes:
            zygote.close()

    def run_phase(self, how: str, phase: str, config: Path, out: Path, ranks: int = 1) -> None:
        """Run the worker's ``phase`` in new processes (one per rank), as a user runs a
        script."""
        while len(self._zygotes) < ranks:
            self._zygotes.append(Zygote(WORKER, _worker_env(), PRELOAD))
        env = _worker_env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks))
        args = [how, phase, str(config), str(out)]

        def rank_run(rank: int) -> Any:
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            return self._zygotes[rank].run(args, rank_env, timeout=300)

        with ThreadPoolExecutor(ranks) as pool:
            for done in pool.map(rank_run, range(ranks)):
                assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    with Workers() as running:
        yield running


def save_and_resume(
    workers: Workers,
    how: str,
    s3_options: dict[str, Any],
    uri: str,
    tmp_path: Path,
    ranks: int = 1,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The uninterrupted run's record and the resumed run's, per rank."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"uri": uri, "s3": s3_options, "root": str(tmp_path / "memory")}))
    workers.run_phase(how, "save", config, tmp_path / "straight.pt", ranks)
    workers.run_phase(how, "resume", config, tmp_path / "resumed.pt", ranks)
    return [
        (
            torch.load(
                tmp_path / f"straight-{r}.pt"
                if how.startswith("fsdp")
                else tmp_path / "straight.pt"
            ),
            torch.load(
                tmp_path / f"resumed-{r}.pt" if how.startswith("fsdp") else tmp_path / "resumed.pt"
            ),
        )
        for r in range(ranks)
    ]


def assert_same_run(straight: dict[str, Any], resumed: dict[str, Any]) -> None:
    """Every step after the checkpoint, the weights, the optimizer state and the learning
    rates match the uninterrupted run exactly."""
    assert resumed["losses"], "the resumed run trained no step"
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], (
            f"step {step}: {loss} != {straight['losses'][step]}"
        )
    assert resumed["weights"].keys() == straight["weights"].keys()
    for name, value in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    assert resumed["optim"].keys() == straight["optim"].keys()
    for pid, entry in straight["optim"].items():
        assert resumed["optim"][pid].keys() == entry.keys(), pid
        for key, value in entry.items():
            assert torch.equal(resumed["optim"][pid][key], value), (pid, key)
    assert resumed["lrs"] == straight["lrs"]
    assert resumed["reports"] == [], "a whole restore reports nothing left out"


@pytest.mark.parametrize("how", ["process", "thread", "tiered", "dcp"])
def test_resumed_run_matches_the_uninterrupted_one(
    how: str, workers: Workers, s3_options: dict[str, Any], s3_prefix: str, tmp_path: Path
) -> None:
    ((straight, resumed),) = save_and_resume(workers, how, s3_options, s3_prefix, tmp_path)
    assert resumed["loaded"] == 3
    # the fresh optimizer got Adam's moments for every parameter, at the saved step
    assert len(resumed["after_load"]) == 6
    assert all(entry["step"].item() == 3 for entry in resumed["after_load"].values())
    assert all(entry["exp_avg"].abs().sum() > 0 for entry in resumed["after_load"].values())
    assert_same_run(straight, resumed)


@pytest.mark.parametrize("ranks", [1, 2])
def test_fsdp2_resumed_run_matches(
    ranks: int, workers: Workers, s3_options: dict[str, Any], s3_prefix: str, tmp_path: Path
) -> None:
    runs = save_and_resume(
        workers, "fsdp" if ranks == 1 else "fsdp2", s3_options, s3_prefix, tmp_path, ranks
    )
    for straight, resumed in runs:
        assert resumed["loaded"] == 3
        assert len(resumed["after_load"]) == 6
        assert_same_run(straight, resumed)


def test_optimizer_saved_before_its_first_step_loads_fresh(
    workers: Workers, s3_options: dict[str, Any], s3_prefix: str, tmp_path: Path
) -> None:
    ((straight, resumed),) = save_and_resume(workers, "fresh", s3_options, s3_prefix, tmp_path)
    assert resumed["loaded"] == 0
    assert resumed["after_load"] == {}
    assert_same_run(straight, resumed)


# -- what a load leaves out or converts --------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _saved(uri: str, s3_options: dict[str, Any]) -> torch.nn.Module:
    """A checkpoint at ``uri`` of an fp32 model and an ``extra`` tensor."""
    model = _model()
    state = {"model": model, "extra": torch.arange(64, dtype=torch.float32)}
    dcp.save(state, storage_writer=S3StorageWriter(uri, **s3_options), no_dist=True)
    return model


def _report_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name.startswith("s3ckpt") and r.levelno == logging.WARNING
        and "did not restore" in r.getMessage()
    ]  # fmt: skip


def test_dropped_entry_and_fp16_conversion_are_one_warning(
    s3_options: dict[str, Any], s3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"{s3_prefix}/ckpt"
    saved = _saved(uri, s3_options)
    half = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).half()
    with caplog.at_level(logging.WARNING, logger="s3ckpt"):
        dcp.load({"model": half}, storage_reader=S3StorageReader(uri, **s3_options), no_dist=True)
    (line,) = _report_lines(caplog)
    assert "'extra' (256 B)" in line
    assert "'model.0.weight' float32 -> float16 (128 B)" in line
    assert "4 entries loaded with a conversion" in line
    assert torch.equal(half[0].weight, saved[0].weight.half())  # loaded, converted


def test_complete_load_says_nothing(
    s3_options: dict[str, Any], s3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"{s3_prefix}/ckpt"
    saved = _saved(uri, s3_options)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    state = {"model": model, "extra": torch.zeros(64)}
    with caplog.at_level(logging.WARNING, logger="s3ckpt"):
        dcp.load(state, storage_reader=S3StorageReader(uri, **s3_options), no_dist=True)
    assert _report_lines(caplog) == []
    assert torch.equal(model[1].bias, saved[1].bias)


def test_long_list_is_summarised(
    s3_options: dict[str, Any], s3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"{s3_prefix}/ckpt"
    state = {f"t{i:02d}": torch.full((4,), float(i)) for i in range(20)}
    dcp.save(state, storage_writer=S3StorageWriter(uri, **s3_options), no_dist=True)
    with caplog.at_level(logging.WARNING, logger="s3ckpt"):
        dcp.load(
            {"t00": torch.zeros(4)}, storage_reader=S3StorageReader(uri, **s3_options), no_dist=True
        )
    (line,) = _report_lines(caplog)
    assert "19 entries saved, no target took" in line
    assert "and 11 more (176 B)" in line and "[304 B in all]" in line


def test_strict_reader_raises_before_loading(s3_options: dict[str, Any], s3_prefix: str) -> None:
    uri = f"{s3_prefix}/ckpt"
    _saved(uri, s3_options)
    # a dtype conversion, every saved entry taken
    half = _model().half()
    torch.nn.init.zeros_(half[0].weight)
    state = {"model": half, "extra": torch.zeros(64)}
    reader = S3StorageReader(uri, strict=True, **s3_options)
    with pytest.raises(StateMismatchError) as raised:
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException
            from s3ckpt import unwrap

            raise unwrap(exc) from exc
    assert "'model.0.weight' float32 -> float16" in str(raised.value)
    assert "model.0.weight" in raised.value.converted
    assert torch.count_nonzero(half[0].weight) == 0  # nothing loaded
    assert torch.count_nonzero(state["extra"]) == 0


def test_strict_manager_raises_and_loads_nothing(
    s3_options: dict[str, Any], s3_prefix: str
) -> None:
    with CheckpointManager(s3_prefix, async_mode="thread", **s3_options) as manager:
        model = _model()
        manager.save(5, {"model": model, "extra": torch.ones(3)})
        manager.wait()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with (
        CheckpointManager(s3_prefix, strict=True, **s3_options) as manager,
        pytest.raises(StateMismatchError) as raised,
    ):
        manager.load_latest({"model": fresh})
    assert raised.value.dropped == {"extra": 12}
    assert "'extra' (12 B)" in str(raised.value)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def test_strict_manager_with_memory_tier_loads_nothing_from_memory(
    s3_options: dict[str, Any], s3_prefix: str, shm_root: Path
) -> None:
    tier = MemoryTier(keep=2, s3_every=1, root=shm_root)
    with CheckpointManager(s3_prefix, memory_tier=tier, **s3_options) as manager:
        manager.save(1, {"model": _model(), "extra": torch.ones(3)})
        manager.wait()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with (
        CheckpointManager(s3_prefix, memory_tier=tier, strict=True, **s3_options) as manager,
        pytest.raises(StateMismatchError) as raised,
    ):
        manager.load_latest({"model": fresh})
    assert raised.value.dropped == {"extra": 12}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def test_export_windows_report_nothing(
    s3_options: dict[str, Any], s3_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An export loads a window of tensors at a time: the rest is left out on purpose."""
    uri = f"{s3_prefix}/ckpt"
    _saved(uri, s3_options)
    with caplog.at_level(logging.WARNING, logger="s3ckpt"):
        export_checkpoint(uri, tmp_path / "out", window=64, **s3_options)
    assert sorted(p.name for p in (tmp_path / "out").iterdir())
    assert _report_lines(caplog) == []


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        optimizer.zero_grad()
        model(torch.full((3, 4), float(step))).square().sum().backward()
        optimizer.step()
    return model, optimizer


def _same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    mine, theirs = a.state_dict()["state"], b.state_dict()["state"]
    return mine.keys() == theirs.keys() and all(
        torch.equal(mine[pid][k], theirs[pid][k]) for pid in mine for k in mine[pid]
    )


def test_checkpoints_of_state_dicts_load_into_objects_and_back(
    s3_options: dict[str, Any], s3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint saved from ``optimizer.state_dict()`` loads into a fresh optimizer
    placed in the state; one saved from the optimizer loads into a fresh optimizer's
    ``state_dict()``, which the script then hands to ``load_state_dict``."""
    model, optimizer = _trained()
    old_form = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(old_form, storage_writer=S3StorageWriter(f"{s3_prefix}/old", **s3_options))
    dcp.save(
        {"model": model, "optim": optimizer},
        storage_writer=S3StorageWriter(f"{s3_prefix}/new", **s3_options),
    )
    with caplog.at_level(logging.WARNING, logger="s3ckpt"):
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
        reader = S3StorageReader(f"{s3_prefix}/old", **s3_options)
        dcp.load({"model": fresh, "optim": fresh_optimizer}, storage_reader=reader)
        assert _same_optimizer_state(fresh_optimizer, optimizer)

        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
        state = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
        dcp.load(state, storage_reader=S3StorageReader(f"{s3_prefix}/new", **s3_options))
        fresh_optimizer.load_state_dict(state["optim"])
        assert _same_optimizer_state(fresh_optimizer, optimizer)
    assert _report_lines(caplog) == []
