"""``s3ckpt export``: a checkpoint of any world size to files inference stacks load.

Reads go through DCP's public path, :class:`~s3ckpt.dcp.reader.S3StorageReader` and
``dcp.load``, so every check a load makes (commit, sizes, CRC32Cs) holds here too, and
DCP reshards the chunks of however many ranks into whole tensors
(:mod:`s3ckpt.dcp.consolidate`). Tensors are loaded a window at a time (at least the
largest tensor, :data:`DEFAULT_WINDOW` by default), converted if asked (``dtype``), and
written straight into the output files (:mod:`s3ckpt.interop.formats`), which are laid out
from the metadata before the first byte arrives: peak memory is one window plus one
upload part, not the model.

Only tensors are exported: safetensors holds nothing else, and the rest of a training
state (step counters, optimizer settings) is no use to inference; the report names what
was left out.

What commits an export is its last file: the safetensors index (or the one torch file).
Small files given along (``files``: a model's ``config.json``) are written first, then the
tensors; an export that fails removes everything it wrote. One killed outright leaves its
files so far without the index: shards a loader does not take as a model (each object
is whole or absent, so a lone ``model.safetensors`` is the complete model); the next
export with ``overwrite`` replaces them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from s3ckpt.catalog.reporting import SILENT, Reporter
from s3ckpt.config import S3URI, S3Config, make_config
from s3ckpt.dcp.compat import CheckpointException, StorageReader, unwrap
from s3ckpt.dcp.consolidate import StoredTensor, batches, load_full, read_contents
from s3ckpt.dcp.reader import S3StorageReader
from s3ckpt.errors import CheckpointError, ConfigError
from s3ckpt.interop.formats import (
    DEFAULT_MAX_SHARD_SIZE,
    SafetensorsWriter,
    Spec,
    TorchWriter,
    assigned,
    check_safetensors_dtypes,
)
from s3ckpt.interop.output import EXPORT_NAMES, open_output
from s3ckpt.transfer.parts import MiB

FORMATS = ("safetensors", "torch")
DEFAULT_WINDOW = 256 * MiB
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float32": torch.float32,
}
log = logging.getLogger(__name__)


@dataclass
class ExportReport:
    """What an export wrote; ``overflowed``: tensors ``dtype`` could not hold (now ``inf``)."""

    source: str
    output: str
    format: str
    files: list[str]
    tensors: int
    bytes: int
    left_out: list[str] = field(default_factory=list)
    overflowed: list[str] = field(default_factory=list)


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``bf16``, ``fp16``, ``fp32`` (or a torch dtype): the floating dtype to export in."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name.lower() not in DTYPES:
        raise ConfigError(f"unknown --dtype {name!r} (one of bf16, fp16, fp32)")
    return DTYPES[name.lower()]


def export_checkpoint(
    source: str | S3URI,
    out: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    only: str | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    shard_of: Mapping[str, int] | None = None,
    files: Mapping[str, bytes] | None = None,
    window: int = DEFAULT_WINDOW,
    config: S3Config | None = None,
    output_config: S3Config | None = None,
    progress: Reporter = SILENT,
    **options: Any,
) -> ExportReport:
    """Export the committed checkpoint at ``source`` into ``out`` (a folder or ``s3://`` prefix).

    ``only``: export the tensors under this FQN prefix (``model`` takes ``model.*``), named
    without it, as inference loaders expect. ``dtype``: convert floating-point tensors
    (``bf16``, ``fp16``, ``fp32``); values the dtype cannot hold overflow to ``inf`` and
    are reported in :attr:`ExportReport.overflowed`. ``shard_of`` (safetensors): the shard
    of each exported name, numbered from 1 as a Hugging Face index names them, instead of
    shards cut at ``max_shard_size``. ``files``: further small files (name -> bytes)
    written into ``out`` before the tensors. ``output_config``: the endpoint of an
    ``s3://`` output when it is not the source's. Raises
    :class:`~s3ckpt.errors.CheckpointNotFoundError` (nothing committed at ``source``),
    :class:`~s3ckpt.errors.CorruptCheckpointError` (damaged),
    :class:`~s3ckpt.errors.OutputExistsError` (``out`` holds files, no ``overwrite``),
    :class:`~s3ckpt.errors.ConfigError` (unknown format or dtype, a tensor ``shard_of``
    does not place, a file name that is a path or one the export writes itself).
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown format {format!r} (one of {', '.join(FORMATS)})")
    extra = dict(files or {})
    _check_file_names(extra)
    target = parse_dtype(dtype)
    if max_shard_size < 1 or window < 1:
        raise ConfigError("max_shard_size and window must be positive")
    s3 = make_config(config, **options)
    location = source if isinstance(source, S3URI) else S3URI.parse(source, require_prefix=True)

    reader = _OneSaveReaders(location, s3)
    contents = _unwrapped(lambda: read_contents(reader()))
    chosen = _select(contents.tensors, only)
    specs = [Spec(name, _converted_dtype(t.dtype, target), t.shape) for name, t in chosen]
    if format == "safetensors":
        check_safetensors_dtypes(specs)
        if shard_of is not None:
            assigned(specs, shard_of)  # a tensor it does not place: refused before any write
    elif shard_of is not None:
        raise ConfigError("shard_of applies to the safetensors format only")
    output = open_output(out, output_config or s3)
    output.check(overwrite)
    report = ExportReport(str(location), str(output), format, [], len(specs), 0)
    report.left_out = [fqn for fqn in contents.others if _under(fqn, only)]
    writer: SafetensorsWriter | TorchWriter | None = None
    try:
        for name, data in extra.items():
            stream = output.open(name)
            stream.write(data)
            stream.close()
        writer = (
            SafetensorsWriter(output, specs, max_shard_size, shard_of)
            if format == "safetensors"
            else TorchWriter(output, specs)
        )
        _stream(reader, writer, dict(zip(specs, chosen, strict=True)), window, report, progress)
        reader.check()
        output.finish()
    except BaseException:
        if writer is not None:
            writer.discard()
        output.discard()
        raise
    report.files = list(output.written)
    return report


def _stream(
    reader: Callable[[], StorageReader],
    writer: SafetensorsWriter | TorchWriter,
    sources: dict[Spec, tuple[str, StoredTensor]],
    window: int,
    report: ExportReport,
    progress: Reporter,
) -> None:
    """Load window by window in the writer's order, write tensor by tensor."""
    stored = [sources[spec][1] for spec in writer.order]
    specs = {sources[spec][1].fqn: spec for spec in writer.order}
    progress.start("exporting", sum(s.nbytes for s in writer.order), "bytes")
    for batch in batches(stored, window):
        state = _unwrapped(lambda batch=batch: load_full(reader, batch))
        for tensor in batch:
            spec = specs[tensor.fqn]
            # No name keeps the tensor alive into the next window's allocation.
            writer.write(spec.name, _convert(state.pop(tensor.fqn), spec, report))
            report.bytes += spec.nbytes
            progress.advance(spec.nbytes)
    writer.close()
    progress.finish()


class _OneSaveReaders:
    """A reader per window, each checked to have read the save the first one read: an
    overwrite during the export would otherwise mix two checkpoints' tensors in one
    output. Only the last reader is kept (each holds DCP's whole metadata)."""

    def __init__(self, location: S3URI, config: S3Config) -> None:
        self.location, self.config = location, config
        self._last: S3StorageReader | None = None
        self._save: str | None = None

    def __call__(self) -> StorageReader:
        self.check()
        self._last = S3StorageReader(str(self.location), config=self.config)
        return self._last

    def check(self) -> None:
        """Raise if the last reader read another save than the first."""
        manifest = self._last.manifest if self._last is not None else None
        if manifest is None:
            return
        if self._save is None:
            self._save = manifest.save_id
        elif manifest.save_id != self._save:
            raise CheckpointError(
                f"{self.location} was overwritten during the export; export it again"
            )


def _check_file_names(files: Mapping[str, bytes]) -> None:
    """:class:`ConfigError` for a name that is not a plain file name, or one of the export's own."""
    for name in files:
        if (
            not name
            or "/" in name
            or "\\" in name
            or name in (".", "..")
            or EXPORT_NAMES.match(name)
        ):
            raise ConfigError(
                f"cannot write {name!r} along with an export: not a plain file name of its own"
            )


def _unwrapped(call: Callable[[], Any]) -> Any:
    """``call()``, with the s3ckpt error inside a DCP ``CheckpointException`` raised as is."""
    try:
        return call()
    except CheckpointException as exc:
        inner = unwrap(exc)
        if inner is exc:
            raise
        raise inner from exc


def _under(fqn: str, only: str | None) -> bool:
    if only is None:
        return True
    prefix = only.rstrip(".")
    return fqn == prefix or fqn.startswith(prefix + ".")


def _select(tensors: Sequence[StoredTensor], only: str | None) -> list[tuple[str, StoredTensor]]:
    """The tensors to export with their exported names (``only`` and its dot removed)."""
    if only is None:
        return [(t.fqn, t) for t in tensors]
    prefix = only.rstrip(".")
    chosen = [
        (t.fqn[len(prefix) + 1 :] if t.fqn != prefix else t.fqn, t)
        for t in tensors
        if _under(t.fqn, only)
    ]
    if not chosen:
        roots = sorted({t.fqn.split(".")[0] for t in tensors})
        raise ConfigError(
            f"no tensor under --only {only!r} (top-level names: {', '.join(roots[:10])})"
        )
    return chosen


def _converted_dtype(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and dtype.is_floating_point else dtype


def _convert(tensor: torch.Tensor, spec: Spec, report: ExportReport) -> torch.Tensor:
    """``tensor`` in the spec's dtype; a finite value that became infinite is reported."""
    dtype, name = spec.dtype, spec.name
    if tensor.dtype == dtype:
        return tensor
    converted = tensor.to(dtype)
    if bool((torch.isinf(converted) & torch.isfinite(tensor)).any()):
        report.overflowed.append(name)
        log.warning(
            "%s: %s cannot hold some values of %s; they became inf", report.source, dtype, name
        )
    return converted
