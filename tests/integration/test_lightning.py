"""PyTorch Lightning through S3CheckpointIO against the embedded S3 server: a Trainer with
``ModelCheckpoint(dirpath="s3://...")`` saves, a new Trainer resumes, and both the restored
state and the continued training match an uninterrupted run bit for bit; in the loop and
wrapped in Lightning's AsyncCheckpointIO."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import fsspec
import fsspec.config
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning_regression import Regression
from rank_exit import leave
from same_state import assert_same

from s3ckpt import CheckpointNotFoundError, S3StorageReader, catalog
from s3ckpt.integrations.lightning import S3CheckpointIO, last_checkpoint, lightning_uri

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's CPU/num_workers advice
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.usefixtures("fsspec_defaults"),
]

BATCHES_PER_EPOCH = 2


class TinyModule(Regression):
    """A two-layer regression model with AdamW and a step schedule: state of every kind."""

    samples = 4 * BATCHES_PER_EPOCH

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )


class Snapshot(Callback):
    """What the trainer holds at the start of training (after a restore) and at its end."""

    def __init__(self) -> None:
        self.start: dict[str, Any] = {}
        self.end: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = _state(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.end = _state(trainer, pl_module)


def _state(trainer: Trainer, module: LightningModule) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }
    )


def make_trainer(tmp_path, plugin: Any, dirpath: str, epochs: int, snapshot: Snapshot) -> Trainer:
    checkpoints = ModelCheckpoint(
        dirpath=dirpath, every_n_epochs=1, save_top_k=1, save_last=True, enable_version_counter=True
    )
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        plugins=[plugin],
        callbacks=[checkpoints, snapshot],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def committed_names(uri: str, options: dict[str, Any]) -> list[str]:
    return sorted(c.name for c in catalog.list_checkpoints(uri, **options) if c.committed)


@pytest.mark.parametrize("wrapped", [False, True], ids=["in-the-loop", "async"])
def test_trainer_saves_to_s3_and_a_new_trainer_resumes_bit_exact(
    tmp_path, s3_prefix: str, s3_options: dict[str, Any], wrapped: bool
) -> None:
    def plugin() -> Any:
        io = S3CheckpointIO(**s3_options)
        return AsyncCheckpointIO(io) if wrapped else io

    uninterrupted = Snapshot()
    make_trainer(tmp_path / "a", plugin(), f"{s3_prefix}-uninterrupted", 3, uninterrupted).fit(
        TinyModule(seed=1)
    )

    first = Snapshot()
    make_trainer(tmp_path / "b", plugin(), s3_prefix, 2, first).fit(TinyModule(seed=1))
    # save_top_k=1 removed epoch 0's checkpoint once epoch 1's was written; last.ckpt stays.
    assert committed_names(s3_prefix, s3_options) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    assert fsspec.filesystem("s3").exists(f"{s3_prefix}/last.ckpt")  # s3fs reaches the server

    resume_from = last_checkpoint(s3_prefix, **s3_options)
    assert resume_from is not None and resume_from.endswith(".ckpt")
    resumed = Snapshot()
    make_trainer(tmp_path / "c", plugin(), s3_prefix, 3, resumed).fit(
        TinyModule(seed=2), ckpt_path=resume_from
    )

    assert resumed.start["global_step"] == first.end["global_step"] == 2 * BATCHES_PER_EPOCH
    assert_same(resumed.start["model"], first.end["model"], "model", key_order=True)
    assert_same(resumed.start["optimizer"], first.end["optimizer"], "optimizer", key_order=True)
    assert_same(resumed.start["scheduler"], first.end["scheduler"], "scheduler", key_order=True)
    assert_same(resumed.end, uninterrupted.end, "after resuming", key_order=True)
    assert committed_names(s3_prefix, s3_options) == ["epoch=2-step=6.ckpt", "last.ckpt"]


class LeavingSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's ``ddp_spawn`` launcher whose ranks, once Lightning's work in them is
    done (rank 0's results queued), leave the gloo group and end (:func:`rank_exit.leave`)
    instead of tearing the interpreter down with the group alive."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        leave()


class LeavingDDPSpawn(DDPStrategy):
    """``strategy="ddp_spawn"`` with :class:`LeavingSpawnLauncher`."""

    def __init__(self) -> None:
        super().__init__(start_method="spawn")

    def _configure_launcher(self) -> None:
        self._launcher = LeavingSpawnLauncher(self, start_method=self._start_method)


@pytest.mark.distributed
def test_ddp_spawn_saves_from_rank_zero_and_every_rank_resumes(
    tmp_path, s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    """Two CPU ranks (gloo): rank 0 saves alone, both ranks load; the spawned processes
    get the plugin pickled and configure their own fsspec (``ddp_spawn`` whose ranks end
    as :class:`LeavingDDPSpawn` says)."""

    def fit(dirpath: str, epochs: int, seed: int, ckpt_path: str | None = None) -> dict:
        module = TinyModule(seed=seed)
        Trainer(
            accelerator="cpu",
            devices=2,
            strategy=LeavingDDPSpawn(),
            max_epochs=epochs,
            plugins=[S3CheckpointIO(**s3_options)],
            callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)],
            default_root_dir=tmp_path,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module, ckpt_path=ckpt_path)
        return copy.deepcopy(module.state_dict())  # rank 0's weights, handed back

    uninterrupted = fit(f"{s3_prefix}-uninterrupted", 3, seed=1)
    first = fit(s3_prefix, 2, seed=1)
    saved = S3CheckpointIO(configure_fsspec=False, **s3_options).load_checkpoint(
        f"{s3_prefix}/last.ckpt"
    )
    assert_same(saved["state_dict"], first, key_order=True)
    resumed = fit(s3_prefix, 3, seed=2, ckpt_path=f"{s3_prefix}/last.ckpt")
    assert_same(resumed, uninterrupted, key_order=True)


def test_a_checkpoint_dict_comes_back_with_its_types(
    s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    io = S3CheckpointIO(configure_fsspec=False, **s3_options)
    module = TinyModule(seed=3)
    optimizer = torch.optim.AdamW(module.parameters())
    module.net(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    checkpoint = {
        "epoch": 3,
        "global_step": 12,
        "pytorch-lightning_version": "2.6",
        "state_dict": module.state_dict(),
        "optimizer_states": [optimizer.state_dict()],  # per-parameter state keyed by int
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5)}},
        "scaler": (torch.ones(2, dtype=torch.bfloat16), 7),
        "empty": torch.empty(0, 4),
    }
    uri = f"{s3_prefix}/epoch=3-step=12.ckpt"
    io.save_checkpoint(checkpoint, uri)
    assert_same(io.load_checkpoint(uri), checkpoint, key_order=True)

    io.save_checkpoint({**checkpoint, "epoch": 4}, uri)  # saving again replaces it
    assert io.load_checkpoint(uri)["epoch"] == 4
    stored = S3StorageReader(uri, **s3_options).read_metadata().state_dict_metadata
    assert "state_dict.net.0.weight" in stored  # one DCP item per tensor, named by its path

    io.remove_checkpoint(uri)
    assert committed_names(s3_prefix, s3_options) == []
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(uri)


def test_a_removal_asked_for_before_the_save_commits_happens_when_it_commits(
    s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    """AsyncCheckpointIO's order: save(B) queued, remove(A) while A's save is still queued."""
    io = S3CheckpointIO(configure_fsspec=False, **s3_options)
    state = {"state_dict": {"w": torch.ones(8)}}
    io.remove_checkpoint(f"{s3_prefix}/a.ckpt")  # not saved yet: remembered
    io.save_checkpoint(state, f"{s3_prefix}/b.ckpt")
    assert committed_names(s3_prefix, s3_options) == ["b.ckpt"]
    io.save_checkpoint(state, f"{s3_prefix}/a.ckpt")  # committed, then removed
    assert committed_names(s3_prefix, s3_options) == ["b.ckpt"]
    io.save_checkpoint(state, f"{s3_prefix}/a.ckpt")  # the removal was carried out once
    assert committed_names(s3_prefix, s3_options) == ["a.ckpt", "b.ckpt"]


def test_storage_options_apply_to_one_save(s3_prefix: str, s3_options: dict[str, Any]) -> None:
    io = S3CheckpointIO(configure_fsspec=False, **s3_options)
    state = {"state_dict": {"w": torch.arange(4096, dtype=torch.float32)}}
    io.save_checkpoint(state, f"{s3_prefix}/z.ckpt", storage_options={"compression": "zstd"})
    io.save_checkpoint(state, f"{s3_prefix}/plain.ckpt")
    sizes = {c.name: c.bytes for c in catalog.list_checkpoints(s3_prefix, **s3_options)}
    assert sizes["z.ckpt"] < sizes["plain.ckpt"] - 8192  # 16 KiB of a ramp, compressed


def test_pickled_objects_need_weights_only_false(
    s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    io = S3CheckpointIO(configure_fsspec=False, **s3_options)
    uri = f"{s3_prefix}/hparams.ckpt"
    io.save_checkpoint({"hyper_parameters": {"optimizer": torch.optim.AdamW}}, uri)
    with pytest.raises(Exception, match="weights_only"):
        io.load_checkpoint(uri)
    assert io.load_checkpoint(uri, weights_only=False)["hyper_parameters"] == {
        "optimizer": torch.optim.AdamW
    }


def test_the_plugin_pickles_for_spawned_processes(
    s3_prefix: str, s3_options: dict[str, Any]
) -> None:
    io = S3CheckpointIO(
        configure_fsspec=False, writer_options={"compression": "zstd"}, **s3_options
    )
    copied = pickle.loads(pickle.dumps(io))
    assert copied.config == io.config and copied.writer_options == {"compression": "zstd"}
    copied.remove_checkpoint(f"{s3_prefix}/never-saved.ckpt")  # its lock works


def test_local_paths_are_lightnings_own_files(tmp_path, s3_options: dict[str, Any]) -> None:
    io = S3CheckpointIO(configure_fsspec=False, **s3_options)
    path = tmp_path / "weights" / "model.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(3)}, "epoch": 1}, path)
    assert path.is_file()  # a torch.save file, as TorchCheckpointIO writes it
    assert_same(
        io.load_checkpoint(path), {"state_dict": {"w": torch.arange(3)}, "epoch": 1}, key_order=True
    )
    io.remove_checkpoint(path)
    assert not path.exists()


def test_paths_lightning_mangled_are_repaired_and_others_refused() -> None:
    assert lightning_uri("s3:/bucket/run/last.ckpt") == "s3://bucket/run/last.ckpt"
    assert lightning_uri("s3://bucket/run/last.ckpt") == "s3://bucket/run/last.ckpt"
    with pytest.raises(ValueError, match="s3://"):
        lightning_uri("/local/run/last.ckpt")
