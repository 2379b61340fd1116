"""DeepSpeed's checkpoints on S3 through S3CheckpointEngine, against the embedded server.

DeepSpeed 0.19.8 on its CPU accelerator, gloo: two spawned ranks train a small model with
ZeRO stage 0, 2 or 3, save a tag, and a fresh engine with other weights resumes from
``latest`` bit-exact (weights, optimizer state with the ZeRO partitions, schedule,
counters) and trains on exactly as the original did; ``latest`` is written after the
manifest; a rank SIGKILLed as it commits leaves the previous tag loadable and ``latest``
on it; bad input gets one clear error; the quickstart's block runs as written.

DeepSpeed is an sdist built beside the pinned CPU torch, so ``make test`` runs this module
in an environment of its own (``.venv-deepspeed``) after the rest of the suite.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_servers import held_port

# The environment make test runs DeepSpeed in (inherited by the spawned ranks): its CPU
# accelerator, and the one op it builds with ninja on first use kept in the environment,
# where the Makefile's .venv-deepspeed target built it with this environment's ninja first
# on PATH. Another ninja would not recognise that build and compile the op again (~1 min).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
os.environ["PATH"] = os.pathsep.join(
    dict.fromkeys([str(Path(sys.executable).parent), *os.environ["PATH"].split(os.pathsep)])
)
pytest.importorskip(
    "deepspeed",
    reason="DeepSpeed is not installed here: make test runs this module in .venv-deepspeed",
)

import _deepspeed_worker as worker
import deepspeed
import torch
import torch.distributed as dist
from _dist_worker import run_ranks
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo
from torch.multiprocessing import ProcessExitedException

from s3ckpt import CheckpointNotFoundError, ConfigError, catalog
from s3ckpt.integrations import deepspeed as s3ds
from s3ckpt.integrations.deepspeed import S3CheckpointEngine, attach, latest_tag

pytestmark = [pytest.mark.distributed]


@pytest.fixture
def s3(s3_options: dict[str, Any]) -> dict[str, Any]:
    return dict(s3_options)


def reports(out: Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def no_local_s3_folder(where: Path) -> None:
    assert not any(p.name.startswith("s3:") for p in where.rglob("*")), sorted(where.rglob("*"))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_save_and_resume_bit_exact_on_two_ranks(
    stage: int,
    s3: dict[str, Any],
    s3_prefix: str,
    tmp_path: Path,
    list_keys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the ranks' working directory: no s3: folder may appear
    run_ranks(worker.save_and_resume, 2, s3, s3_prefix, stage, str(tmp_path), timeout=240)
    rank0, rank1 = reports(tmp_path)
    assert rank0["optimizer_tensors"] > 0 and rank0["tensors"] > rank0["optimizer_tensors"]
    # rank 0 commits: each tag's manifest, then latest, in that order
    order = [k for k in rank0["puts"] if k.endswith(("/manifest.json", "/latest"))]
    prefix = s3_prefix.split("/", 3)[3]
    latest = f"{prefix}/latest"
    assert order == [f"{prefix}/t1/manifest.json", latest, f"{prefix}/t2/manifest.json", latest]
    assert not [k for k in rank1["puts"] if k.endswith(("/manifest.json", "/latest"))]
    assert latest_tag(s3_prefix, **s3) == "t2"
    committed = {i.name for i in catalog.list_checkpoints(s3_prefix, **s3) if i.committed}
    assert committed == {"t1", "t2"}
    files = S3CheckpointEngine(group=None, **s3).files(f"{s3_prefix}/t1")
    if stage == 0:
        assert files == ["mp_rank_00_model_states.pt"]
    elif stage == 2:
        assert files == [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
    else:
        assert files == [
            f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
            for r in (0, 1)
            for kind in ("model", "optim")
        ]
    assert "latest" in list_keys(s3_prefix)
    no_local_s3_folder(tmp_path)


def test_async_saves_upload_from_the_checkpoint_process_and_resume_bit_exact(
    s3: dict[str, Any], s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run_ranks(worker.async_save_and_resume, 2, s3, s3_prefix, 2, str(tmp_path), timeout=300)
    for report in reports(tmp_path):
        assert report["pid"] != report["own_pid"]  # uploaded from the checkpoint process
        assert report["latest_after_wait"] == "t1"  # written once t1 committed
        assert report["latest"] == "t2"
    committed = {i.name for i in catalog.list_checkpoints(s3_prefix, **s3) if i.committed}
    assert committed == {"t1", "t2"}
    no_local_s3_folder(tmp_path)


def test_a_rank_killed_while_committing_leaves_the_previous_tag(
    s3: dict[str, Any], s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProcessExitedException):
        run_ranks(worker.killed_before_commit, 2, s3, s3_prefix, str(tmp_path), timeout=240)
    assert (tmp_path / "killed").read_text().endswith("/t2/manifest.json")
    assert not catalog.is_committed(f"{s3_prefix}/t2", **s3)
    assert latest_tag(s3_prefix, **s3) == "t1"
    committed = [i.name for i in catalog.list_checkpoints(s3_prefix, **s3) if i.committed]
    assert committed == ["t1"]
    loader = S3CheckpointEngine(group=None, **s3)
    with pytest.raises(CheckpointNotFoundError):
        loader.load(f"{s3_prefix}/t2/mp_rank_00_model_states.pt")
    saved = reports(tmp_path)
    assert [r["refused"] for r in saved] == [saved[0]["refused"]] * 2  # the same on both
    assert "rank 1: " in saved[0]["refused"] and "x.pt cannot be stored" in saved[0]["refused"]
    assert not catalog.is_committed(f"{s3_prefix}/bad", **s3)
    model = loader.load(f"{s3_prefix}/t1/mp_rank_00_model_states.pt", map_location="cpu")
    assert worker.tensors(model["module"]).keys() == saved[0]["module"].keys()
    for name, tensor in worker.tensors(model["module"]).items():
        assert torch.equal(tensor, saved[0]["module"][name]), name
    for rank in (0, 1):
        shard = loader.load(f"{s3_prefix}/t1/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        loaded = worker.tensors(shard["optimizer_state_dict"])
        assert loaded.keys() == saved[rank]["optimizer"].keys()
        assert all(torch.equal(loaded[n], t) for n, t in saved[rank]["optimizer"].items())
    no_local_s3_folder(tmp_path)


def test_the_quickstart_block_runs_and_resumes(
    s3: dict[str, Any], s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3["secret_access_key"])
    monkeypatch.setenv("AWS_REGION", s3["region"])
    run_ranks(worker.quickstart, 2, s3["endpoint_url"], s3_prefix, str(tmp_path), timeout=240)
    assert [r["starts"] for r in reports(tmp_path)] == [[0, 1], [0, 1]]
    assert latest_tag(s3_prefix, **s3) == "global_step1"


# -- one rank in this process: what is refused, and how ------------------------------------


@pytest.fixture(scope="module")
def one_rank_engine() -> Iterator[Any]:
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    with held_port() as port:
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = worker.new_model(0)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=worker.ds_config(2)
    )
    yield engine
    dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_bad_input_gets_one_clear_error(
    one_rank_engine: Any,
    s3: dict[str, Any],
    s3_prefix: str,
    tmp_path: Path,
    list_keys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = one_rank_engine
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"call s3ckpt\.integrations\.deepspeed\.attach"):
        s3ds.save_checkpoint(engine, s3_prefix)
    with pytest.raises(ConfigError, match=r"needs the engine deepspeed\.initialize returns"):
        attach(torch.nn.Linear(2, 2), **s3)
    attach(engine, **s3)
    # DeepSpeed's own save would write `latest` with open(): refused before any write
    with pytest.raises(ConfigError, match="save_latest=False"):
        engine.save_checkpoint(s3_prefix, tag="t0")
    assert list_keys(s3_prefix) == []
    with pytest.raises(ConfigError, match="s3:// folders"):
        s3ds.save_checkpoint(engine, str(tmp_path / "local"))
    with pytest.raises(ConfigError, match="s3:// folders"):
        s3ds.load_checkpoint(engine, str(tmp_path / "local"))
    assert s3ds.load_checkpoint(engine, s3_prefix) == (None, None)  # nothing saved yet
    with pytest.raises(CheckpointNotFoundError):
        s3ds.load_checkpoint(engine, s3_prefix, tag="never-saved")
    # engine.save_checkpoint with save_latest=False works, and writes no latest
    assert engine.save_checkpoint(s3_prefix, tag="t0", save_latest=False)
    assert latest_tag(s3_prefix, **s3) is None
    assert (
        s3ds.load_checkpoint(engine, s3_prefix, tag="t0")[0]
        == f"{s3_prefix}/t0/mp_rank_00_model_states.pt"
    )
    with pytest.raises(CheckpointNotFoundError, match=r"holds no file nothing\.pt"):
        engine.checkpoint_engine.load(f"{s3_prefix}/t0/nothing.pt")
    with pytest.raises(ConfigError, match="only loads"):
        S3CheckpointEngine(group=None, **s3).commit(None)
    # saves that cannot form one checkpoint fail at the commit, on every rank, unwritten
    checkpoints = engine.checkpoint_engine
    info = CheckpointCommitInfo(tag="t9", save_dir=s3_prefix, save_latest=False)
    checkpoints.create(info)
    checkpoints.save({"w": torch.ones(1)}, f"{s3_prefix}/t9/a.pt")
    checkpoints.save({"w": torch.ones(1)}, f"{s3_prefix}/elsewhere/b.pt")
    checkpoints.save({"f": lambda: 0}, f"{s3_prefix}/t9/c.pt")
    with pytest.raises(ConfigError, match="several folders") as failed:
        checkpoints.commit(info)
    assert "c.pt cannot be stored" in str(failed.value)
    assert not catalog.is_committed(f"{s3_prefix}/t9", **s3)
    no_local_s3_folder(tmp_path)
    assert not (tmp_path / "local").exists()


def test_local_paths_keep_deepspeeds_own_code(
    one_rank_engine: Any, s3: dict[str, Any], tmp_path: Path
) -> None:
    """What compat_deepspeed redirects for s3:// folders is DeepSpeed's own elsewhere."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.state_dict_factory import MegatronSDLoader, SDLoaderFactory

    engine = one_rank_engine
    attach(engine, **s3)
    assert engine._get_all_ckpt_names(str(tmp_path), "t") == []  # glob, nothing there
    engine._copy_recovery_script(str(tmp_path))
    assert (tmp_path / "zero_to_fp32.py").is_file()
    torch.save({"module": {"w": torch.ones(1)}}, tmp_path / "m.pt")
    loader = SDLoaderFactory.get_sd_loader([str(tmp_path / "m.pt")], TorchCheckpointEngine())
    assert type(loader) is MegatronSDLoader
    assert torch.equal(loader.load(1, 0)[1]["module"]["w"], torch.ones(1))
