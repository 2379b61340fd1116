"""Everything :mod:`s3ckpt.integrations.deepspeed` takes from DeepSpeed beyond its
``CheckpointEngine`` interface, in one place (``tests/private_names.py``).

DeepSpeed hands every checkpoint file to its ``checkpoint_engine`` but, around those
calls, treats the checkpoint folder as a local directory in three places that an
``s3://`` folder cannot satisfy. Each is redirected here, for ``s3://`` paths only (local
paths still take DeepSpeed's own code):

* ``DeepSpeedEngine._get_all_ckpt_names`` finds the model-state files of a tag with
  ``glob.glob``: replaced on the engine instance by the same pattern matched against the
  files of the committed tag (:meth:`S3CheckpointEngine.files`);
* ``DeepSpeedEngine._copy_recovery_script`` copies ``zero_to_fp32.py`` and
  ``zero_to_torch.py`` into the save folder with ``shutil.copyfile`` (ZeRO saves, rank
  0): replaced on the instance by a no-op for ``s3://`` folders (those scripts read local
  files; ``s3ckpt export`` turns a checkpoint into local files instead);
* ``SDLoaderBase.load`` (``deepspeed.runtime.state_dict_factory``) asserts
  ``os.path.exists`` on the model-state file before loading it through the engine:
  ``SDLoaderFactory.get_sd_loader`` is wrapped, once per process, to hand out a loader
  without that check when the checkpoint engine is an ``S3CheckpointEngine`` (any other
  engine gets DeepSpeed's loader unchanged).

Pinned by ``tests/integration/test_deepspeed.py`` against DeepSpeed 0.19.8.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Callable
from typing import Any

from deepspeed.runtime.state_dict_factory import (
    AUTO_MODULE_KEY,
    MegatronSDLoader,
    SDLoaderFactory,
)

from s3ckpt.errors import CheckpointNotFoundError

log = logging.getLogger(__name__)

_install_lock = threading.Lock()
_WRAPPED = "_s3ckpt_wrapped"


def route_s3_paths(
    engine: Any,
    files: Callable[[str], list[str]],
    is_ours: Callable[[Any], bool],
) -> None:
    """Make ``engine`` find, load and save ``s3://`` checkpoints through its checkpoint
    engine: ``files(folder)`` lists the files of a committed folder, ``is_ours(ce)``
    says whether a checkpoint engine is an ``S3CheckpointEngine``."""
    _route_model_state_names(engine, files)
    _skip_recovery_scripts(engine)
    _install_sd_loader(is_ours)


def _route_model_state_names(engine: Any, files: Callable[[str], list[str]]) -> None:
    original = engine._get_all_ckpt_names
    if getattr(original, _WRAPPED, False):
        return

    def names(checkpoints_path: str, tag: Any) -> list[str]:
        if not str(checkpoints_path).startswith("s3://"):
            return original(checkpoints_path, tag)
        pattern = engine._get_ckpt_name(
            checkpoints_path,
            tag,
            mp_placeholder="*",
            pp_placeholder="0" if engine.load_universal_checkpoint() else None,
        )
        folder, _, name_pattern = pattern.rpartition("/")
        found = sorted(fnmatch.filter(files(folder), name_pattern))
        if not found:
            raise CheckpointNotFoundError(f"{folder} holds no file named like {name_pattern}")
        return [f"{folder}/{name}" for name in found]

    setattr(names, _WRAPPED, True)
    engine._get_all_ckpt_names = names


def _skip_recovery_scripts(engine: Any) -> None:
    original = engine._copy_recovery_script
    if getattr(original, _WRAPPED, False):
        return

    def copy(save_path: str) -> None:
        if str(save_path).startswith("s3://"):
            log.debug("not copying zero_to_fp32.py into %s: it reads local files", save_path)
            return
        original(save_path)

    setattr(copy, _WRAPPED, True)
    engine._copy_recovery_script = copy


class _S3SDLoader(MegatronSDLoader):
    """DeepSpeed's model-state loader without its ``os.path.exists`` check, which an
    ``s3://`` path never passes; a missing file fails in the checkpoint engine's
    ``load`` instead. Merging and splitting (a different model-parallel size) are
    DeepSpeed's own code, which loads through the engine only."""

    def load(
        self,
        mp_world_size: int,
        mp_rank: int,
        module_key: Any = AUTO_MODULE_KEY,
        is_pipe_parallel: bool = False,
        quantize: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        count = len(self.ckpt_list)
        same_size = count == mp_world_size or (is_pipe_parallel and module_key is not None)
        if quantize or not same_size:
            return super().load(
                mp_world_size, mp_rank, module_key, is_pipe_parallel, quantize, *args, **kwargs
            )
        self.module_key = module_key
        index = mp_rank * count // mp_world_size if count == mp_world_size else 0
        path = self.ckpt_list[index]
        return path, self.checkpoint_engine.load(path, map_location="cpu"), (None, 1)


def _install_sd_loader(is_ours: Callable[[Any], bool]) -> None:
    with _install_lock:
        current = SDLoaderFactory.get_sd_loader
        if getattr(current, _WRAPPED, False):
            return

        def get_sd_loader(
            ckpt_list: list[str],
            checkpoint_engine: Any,
            sd_type: str = "Megatron",
            version: Any = None,
        ) -> Any:
            if sd_type == "Megatron" and is_ours(checkpoint_engine):
                return _S3SDLoader(ckpt_list, version, checkpoint_engine)
            return current(ckpt_list, checkpoint_engine, sd_type, version)

        setattr(get_sd_loader, _WRAPPED, True)
        SDLoaderFactory.get_sd_loader = staticmethod(get_sd_loader)
