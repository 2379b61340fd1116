"""DeepSpeed checkpoints on S3 through s3ckpt: ``S3CheckpointEngine``.

DeepSpeed's ``engine.save_checkpoint(save_dir, tag)`` writes each file of a checkpoint
(the model states on data-parallel rank 0, ``mp_rank_00_model_states.pt``; with ZeRO one
optimizer shard per data-parallel rank, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``)
through ``engine.checkpoint_engine``: ``create(info)``, ``save(state_dict, path)`` per
file, ``commit(info)``, and ``load(path)`` when loading. DeepSpeed has no registry for
engines; :func:`attach` puts an :class:`S3CheckpointEngine` on an engine after
``deepspeed.initialize``::

    import deepspeed
    from s3ckpt.integrations.deepspeed import attach, load_checkpoint, save_checkpoint

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    attach(engine, endpoint_url="https://flashblade.example.com")
    load_checkpoint(engine, "s3://ckpt/run1")                 # the tag `latest` names
    ...
    save_checkpoint(engine, "s3://ckpt/run1", client_state={"step": step})  # every rank

How a save becomes one s3ckpt checkpoint per tag, ``s3://ckpt/run1/<tag>``:

* ``save`` keeps the state dict it is given (references, no copy: DeepSpeed changes no
  state between its saves and the commit) under the file's name;
* ``commit``, on every rank: the ranks first agree (one ``all_gather_object`` of every
  rank's folder, files and errors: the barrier DeepSpeed has not before ``commit``, so no
  rank uploads before every rank's ``save`` calls are done, and a bad save fails every
  rank alike), then save all files of all ranks in one ``dcp.save`` over the group,
  each file's tensors as DCP items named ``<file>/<path>`` plus its pickled skeleton
  (:func:`~s3ckpt.integrations.nested.nested_items`). The manifest is
  written last, by the coordinator, once every rank's data is in: a crash before it
  leaves nothing visible, and the tag saved before stays whole. Saving a tag again
  replaces it atomically;
* DeepSpeed writes its ``latest`` file with ``open()`` after ``commit``, which an
  ``s3://`` folder cannot take: :func:`save_checkpoint` calls DeepSpeed with
  ``save_latest=False`` and the commit writes ``<save_dir>/latest`` (the tag, as
  DeepSpeed's file holds it) as an object, after the manifest, from rank 0; every rank
  learns whether that worked. A plain ``engine.save_checkpoint("s3://...")`` (whose
  ``save_latest`` is ``True``) is refused on every rank before anything is written;
* ``load`` reads one file back (its items only) from the committed tag;
  :func:`load_checkpoint` resolves ``latest`` from S3 (rank 0 reads it, the group shares
  it) before DeepSpeed's ``load_checkpoint``, which would look for a local file.

The group: the world group of ``deepspeed.comm`` (``get_world_group()``, torch's
``WORLD``), the group DeepSpeed's own barriers in ``save_checkpoint`` use and whose
every rank calls it. Every rank of it writes files of the tag (model states per
model-parallel rank, ZeRO shards per data-parallel rank), so the data-parallel group
alone would miss some. ``makedirs`` creates nothing (S3 has no folders; no local
``s3:`` folder appears), and DeepSpeed's three local-file calls on the folder are
redirected in :mod:`s3ckpt.integrations.deepspeed.compat`.

Not covered (refused by :func:`attach`): pipeline engines, MoE layers, NVMe optimizer
offload, node-local storage, universal checkpoints, and DeepSpeed's own writer engines
(``checkpoint.writer``, DataStates), which replace the default engine themselves.
"""

from __future__ import annotations

try:
    import deepspeed  # noqa: F401
except ImportError as exc:
    from s3ckpt._install import install_hint

    raise ImportError(
        f"s3ckpt.integrations.deepspeed needs DeepSpeed, in {install_hint('deepspeed')} "
        "(DeepSpeed 0.19 is an sdist; on a CPU-only host: DS_BUILD_OPS=0 pip install "
        "--no-build-isolation deepspeed)"
    ) from exc

from s3ckpt.integrations.deepspeed.engine import (
    DEEPSPEED_GLOBALS,
    LATEST,
    S3CheckpointEngine,
    file_uri,
    folder_uri,
)
from s3ckpt.integrations.deepspeed.training import (
    attach,
    latest_tag,
    load_checkpoint,
    s3_engine,
    save_checkpoint,
)

__all__ = [
    "DEEPSPEED_GLOBALS",
    "LATEST",
    "S3CheckpointEngine",
    "attach",
    "file_uri",
    "folder_uri",
    "latest_tag",
    "load_checkpoint",
    "s3_engine",
    "save_checkpoint",
]
