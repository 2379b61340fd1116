"""DLIO's checkpoint workload through s3ckpt's checkpointing mechanism, against the
embedded server: ``dlio_benchmark`` itself (its CLI, its configuration, its training loop
and timers), with docs/quickstart.md's workload and command as written, generates a small
dataset, trains and checkpoints through ``S3ckptCheckpointing``; every state is a committed s3ckpt checkpoint that the catalog
lists and verifies and that reads back bit-exact; a second run replaces them; bad
configuration gets one clear error.

dlio-benchmark 2.0.0 needs TensorFlow, MPI and its tracer beside the pinned CPU torch, so
``make test`` runs this module in an environment of its own (``.venv-dlio``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "dlio_benchmark", reason="DLIO is not installed here: make test runs this module in .venv-dlio"
)

import torch
import torch.distributed.checkpoint as dcp
import yaml

from s3ckpt import S3StorageReader, catalog
from s3ckpt.errors import ConfigError
from s3ckpt.testing.local_s3 import LocalS3Server

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"


def _quickstart() -> tuple[str, str, list[str]]:
    """docs/quickstart.md's DLIO workload: its file name, its YAML as written and its
    ``dlio_benchmark`` command line."""
    text = QUICKSTART.read_text()
    (workload,) = re.findall(r"^```yaml\n(# conf/workload/.*?)^```", text, re.S | re.M)
    (command,) = re.findall(r"^```bash\n(.*?dlio_benchmark.*?)^```", text, re.S | re.M)
    name = re.match(r"# (conf/workload/\S+\.yaml)", workload)
    assert name is not None
    return name.group(1), workload, shlex.split(command)


def _run_dlio(tmp_path: Path, local_s3: Any, run: str, ranks: int = 1) -> dict[str, Any]:
    """The quickstart's workload and command, as written, in ``tmp_path/run``; DLIO's
    per-epoch stats. The endpoint the command names is the server's. With several
    ``ranks`` it runs under MPI's ``mpiexec`` and every rank checkpoints."""
    name, workload, command = _quickstart()
    work = tmp_path / run
    (work / name).parent.mkdir(parents=True)
    (work / name).write_text(workload)
    settings = [word for word in command if "=" in word and word.startswith("AWS_")]
    arguments = command[len(settings) :]
    assert arguments[0] == "dlio_benchmark"
    arguments[0] = str(Path(sys.executable).parent / "dlio_benchmark")
    arguments += [f"++hydra.run.dir={work / 'hydra'}", f"++workload.output.folder={work / 'out'}"]
    if ranks > 1:
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        arguments = [mpiexec, "-n", str(ranks), *arguments, "++workload.checkpoint.type=all_ranks"]
    env = {**os.environ, **local_s3.env(), "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        arguments, cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert not (work / "s3:").exists()  # no local directory named after the S3 folder
    stats: dict[str, Any] = json.loads((work / "out" / "per_epoch_stats.json").read_text())
    return stats


def _states(checkpoint: dict[str, Any], step: int, rank: int = 0) -> dict[str, dict[str, Any]]:
    """The states DLIO 2.0.0 saves at ``step`` of epoch 1 on ``rank`` for the workload's
    ``checkpoint`` section, as it builds them (its tensors are zeros)."""
    zeros = lambda n: torch.zeros(n, dtype=torch.int8)  # noqa: E731
    groups, parameters = checkpoint["optimization_groups"], checkpoint["layer_parameters"]
    optimizer: dict[str, Any] = {
        str(i): {"a": zeros(n), "b": zeros(n)} for i, n in enumerate(groups)
    }
    optimizer["combined"] = zeros(sum(groups))
    layers = {str(i): zeros(n) for i, n in enumerate(parameters)}
    states = {
        f"model-1-{step}-{rank}": {"a": zeros(checkpoint["model_size"])},
        f"optimizer-1-{step}-{rank}": optimizer,
    }
    layer_names = (f"layer-{layer}-1-{step}-{rank}" for layer in range(checkpoint["num_layers"]))
    states |= {name: layers for name in layer_names}
    return states


def _assert_committed_and_exact(folder: str, expected: dict[str, Any], options: Any) -> list:
    """Every expected state is a committed checkpoint (and nothing else is there) that
    reads back bit-exact; the catalog's listing."""
    listed = catalog.list_checkpoints(folder, **options)
    assert sorted((i.name, i.committed) for i in listed) == sorted(
        (name, True) for name in expected
    )
    for name, state in expected.items():
        template = _filled(state)
        reader = S3StorageReader(f"{folder}/{name}", **options)
        dcp.load(template, storage_reader=reader, no_dist=True)
        _assert_equal(template, state)
    return listed


def _filled(state: Any) -> Any:
    """A template of ``state``'s shape whose tensors hold ones (so a load must change them)."""
    if isinstance(state, dict):
        return {key: _filled(value) for key, value in state.items()}
    return torch.ones_like(state)


def _assert_equal(loaded: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert loaded.keys() == expected.keys()
        for key in expected:
            _assert_equal(loaded[key], expected[key])
    else:
        assert torch.equal(loaded, expected)


def test_the_quickstart_workload_runs_in_dlio_and_every_state_reads_back(tmp_path):
    """DLIO itself, with docs/quickstart.md's workload and command as written."""
    workload = yaml.safe_load(_quickstart()[1])
    checkpoint = workload["checkpoint"]
    folder = checkpoint["checkpoint_folder"]
    bucket = folder.removeprefix("s3://").split("/")[0]
    with LocalS3Server([bucket]) as local_s3:
        options = {"endpoint_url": local_s3.endpoint_url, **_credentials(local_s3)}
        stats = _run_dlio(tmp_path, local_s3, "first")
        epoch = stats["1"]
        every = checkpoint["steps_between_checkpoints"]
        steps = workload["dataset"]["num_files_train"]
        taken = [f"ckpt{n}" for n in range(1, steps // every + 1)]
        assert set(taken) <= epoch.keys()  # DLIO timed each checkpoint
        assert all(float(epoch[k]["duration"]) > 0 for k in taken)
        expected: dict[str, Any] = {}
        for step in range(every, steps + 1, every):
            expected |= _states(checkpoint, step)
        listed = _assert_committed_and_exact(folder, expected, options)
        report = catalog.verify_checkpoint(f"{folder}/model-1-{every}-0", **options)
        assert report.ok, report

        # A second run into the same folder replaces each state, committed again.
        _run_dlio(tmp_path, local_s3, "second")
        again = catalog.list_checkpoints(folder, **options)
        assert sorted(i.name for i in again) == sorted(expected)
        assert all(i.committed for i in again)
        assert min(i.time for i in again) > max(i.time for i in listed)


def test_two_mpi_ranks_each_save_their_own_states_with_no_collective(tmp_path):
    """The same workload under ``mpiexec -n 2`` with every rank checkpointing: each rank
    commits its own states (its rank in their names), none waits for the other."""
    workload = yaml.safe_load(_quickstart()[1])
    checkpoint = workload["checkpoint"]
    folder = checkpoint["checkpoint_folder"]
    with LocalS3Server([folder.removeprefix("s3://").split("/")[0]]) as local_s3:
        options = {"endpoint_url": local_s3.endpoint_url, **_credentials(local_s3)}
        epoch = _run_dlio(tmp_path, local_s3, "two-ranks", ranks=2)["1"]
        every = checkpoint["steps_between_checkpoints"]
        steps = workload["dataset"]["num_files_train"] // 2  # the files split over the ranks
        assert {f"ckpt{n}" for n in range(1, steps // every + 1)} <= epoch.keys()
        expected: dict[str, Any] = {}
        for rank in (0, 1):
            for step in range(every, steps + 1, every):
                expected |= _states(checkpoint, step, rank)
        _assert_committed_and_exact(folder, expected, options)


def _credentials(server: LocalS3Server) -> dict[str, str]:
    return {"access_key_id": server.access_key, "secret_access_key": server.secret_key,
            "region": server.region}  # fmt: skip


def test_states_save_and_load_in_place_through_the_mechanism(local_s3, s3_prefix, monkeypatch):
    """What the newest DLIO calls besides ``checkpoint``: ``save_state`` of a nested state
    under a step's folder, then ``load_state`` into the same structure."""
    from dlio_benchmark.utils.config import ConfigArguments
    from dlio_benchmark.utils.utility import DLIOMPI

    from s3ckpt.integrations.dlio import S3ckptCheckpointing

    DLIOMPI.get_instance().initialize()  # one MPI process, as DLIO's main starts it
    for name, value in local_s3.env().items():
        monkeypatch.setenv(name, value)
    args = ConfigArguments.get_instance()
    monkeypatch.setattr(args, "checkpoint_folder", s3_prefix)
    monkeypatch.setattr(args, "model_size", 1024)
    mechanism = S3ckptCheckpointing()
    state = {"0": torch.arange(-128, 128, dtype=torch.int8), "1": {"b": torch.randn(64, 3)}}
    suffix = "global_epoch1_step2/zero_pp_rank_0_mp_rank_0_optim_states"
    mechanism.save_state(suffix, state)
    template = _filled(state)
    assert mechanism.load_state(suffix, template) is template
    _assert_equal(template, state)
    assert mechanism.saved == [f"{s3_prefix}/{suffix}"]


def test_dlio_s3_storage_convention_names_the_folder_bucket_slash_prefix(tmp_path):
    from dlio_benchmark.common.enumerations import StorageType

    from s3ckpt.integrations.dlio import checkpoint_uri

    assert checkpoint_uri("bucket/run/", StorageType.S3) == "s3://bucket/run"
    assert checkpoint_uri("s3://bucket/run", StorageType.LOCAL_FS) == "s3://bucket/run"
    with pytest.raises(ConfigError, match="s3://bucket/prefix"):
        checkpoint_uri("checkpoints/run", StorageType.LOCAL_FS)


def test_the_local_directory_dlio_makes_for_the_folder_is_removed(tmp_path, monkeypatch):
    from dlio_benchmark.common.enumerations import StorageType

    from s3ckpt.integrations.dlio import LocalShadow

    monkeypatch.chdir(tmp_path)
    shadow = LocalShadow("s3://bucket/run", StorageType.LOCAL_FS)
    os.makedirs("s3://bucket/run")  # what DLIO's base class does on local storage
    shadow.remove()
    assert list(tmp_path.iterdir()) == []
    # one that was there before is not the mechanism's to remove
    os.makedirs("s3://bucket/run")
    LocalShadow("s3://bucket/run", StorageType.LOCAL_FS).remove()
    assert (tmp_path / "s3:" / "bucket" / "run").is_dir()
    shutil.rmtree(tmp_path / "s3:")


def test_writer_options_come_from_the_environment_as_json():
    from s3ckpt.integrations.dlio import writer_options

    assert writer_options(None) == {"overwrite": True}
    assert writer_options('{"compression": "zstd", "overwrite": false}') == {
        "compression": "zstd",
        "overwrite": False,
    }
    with pytest.raises(ConfigError, match="not JSON"):
        writer_options("{compression")
    with pytest.raises(ConfigError, match="JSON object"):
        writer_options('["zstd"]')
