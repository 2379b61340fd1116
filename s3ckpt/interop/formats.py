"""The files an export writes, laid out before the first tensor arrives.

Both formats are written front to back, tensor by tensor, because every name, dtype and
shape is known from DCP's metadata before any byte is read:

* safetensors (Hugging Face): shards of at most ``max_shard_size`` bytes, or the shards a
  model's own index assigns (``shard_of``: name -> 1-based shard number, as a Hugging Face
  ``model.safetensors.index.json`` names them), each an 8-byte header length, a JSON header
  (dtype, shape and byte range of every tensor, padded to 8 bytes) and the raw
  little-endian tensor bytes in header order; ``model.safetensors`` alone or
  ``model-0000i-of-0000n.safetensors``, and ``model.safetensors.index.json`` mapping
  every tensor to its shard, written last (``safetensors.torch.load_file`` reads each
  shard, ``transformers`` the set);
* torch: one ``pytorch_model.bin`` that ``torch.load`` reads as ``{name: tensor}``. Its
  skeleton, written by ``torch.save`` with no tensor bytes
  (:func:`s3ckpt.dcp.compat.save_skeleton`) into a temporary file (sparse: the tensor
  records are holes, so a 140 GB model's takes kilobytes of disk), is streamed out with
  each tensor's bytes spliced into its zip record as it arrives.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from s3ckpt.dcp.compat import save_skeleton
from s3ckpt.dcp.tensor_bytes import as_cpu_contiguous, tensor_view
from s3ckpt.errors import ConfigError
from s3ckpt.interop.output import Output, Stream

GB = 1000**3
DEFAULT_MAX_SHARD_SIZE = 5 * GB  # what Hugging Face uses
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
INDEX_NAME = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"
_COPY = 16 * 1024 * 1024  # skeleton bytes copied at a time


@dataclass(frozen=True)
class Spec:
    """A tensor as it will be written: its exported name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsWriter:
    """Writes safetensors shards (module docstring); tensors must come in ``specs`` order."""

    def __init__(
        self,
        output: Output,
        specs: Sequence[Spec],
        max_shard_size: int,
        shard_of: Mapping[str, int] | None = None,
    ) -> None:
        check_safetensors_dtypes(specs)
        self.output = output
        self.shards = (
            _shards(specs, max_shard_size) if shard_of is None else assigned(specs, shard_of)
        )
        count = len(self.shards)
        self.names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        )
        self.order = [spec for shard in self.shards for spec in shard]
        self._next = 0
        self._shard = -1
        self._stream: Stream | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.order[self._next]
        _check(spec, name, tensor)
        while self._shard < 0 or spec not in self.shards[self._shard]:
            self._open_next()
        assert self._stream is not None
        self._stream.write(tensor_view(as_cpu_contiguous(tensor)))
        self._next += 1

    def _open_next(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._shard += 1
        self._stream = self.output.open(self.names[self._shard])
        self._stream.write(_header(self.shards[self._shard]))

    def close(self) -> None:
        while self._shard < len(self.shards) - 1:  # shards of empty tensors only
            self._open_next()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        total = sum(spec.nbytes for spec in self.order)
        weight_map = {
            spec.name: self.names[n] for n, shard in enumerate(self.shards) for spec in shard
        }
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        stream = self.output.open(INDEX_NAME)
        stream.write(json.dumps(index, indent=2).encode() + b"\n")
        stream.close()

    def discard(self) -> None:
        """Give up after a failure (the output removes the files)."""
        if self._stream is not None:
            self._stream.abort()
            self._stream = None


def check_safetensors_dtypes(specs: Sequence[Spec]) -> None:
    """:class:`ConfigError` if safetensors has no name for a dtype among ``specs``."""
    unsupported = sorted({str(s.dtype) for s in specs if s.dtype not in SAFETENSORS_DTYPES})
    if unsupported:
        raise ConfigError(
            f"safetensors cannot hold {', '.join(unsupported)} tensors; "
            "use --format torch or --dtype"
        )


def _shards(specs: Sequence[Spec], limit: int) -> list[list[Spec]]:
    shards: list[list[Spec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


def assigned(specs: Sequence[Spec], shard_of: Mapping[str, int]) -> list[list[Spec]]:
    """``specs`` in the shards ``shard_of`` names (1 to its highest number, some maybe
    empty), each in ``specs`` order; :class:`ConfigError` for a tensor it does not place."""
    unplaced = [s.name for s in specs if shard_of.get(s.name, 0) < 1]
    if unplaced:
        raise ConfigError(
            f"the shard assignment places no shard for {len(unplaced)} tensor(s): "
            f"{', '.join(unplaced[:5])}"
        )
    count = max((shard_of[s.name] for s in specs), default=1)
    shards: list[list[Spec]] = [[] for _ in range(count)]
    for spec in specs:
        shards[shard_of[spec.name] - 1].append(spec)
    return shards


def _header(shard: Sequence[Spec]) -> bytes:
    """Header length and JSON header of one shard, padded with spaces to 8 bytes."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        end = offset + spec.nbytes
        entries[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _check(spec: Spec, name: str, tensor: torch.Tensor) -> None:
    if (spec.name, spec.dtype, spec.shape) != (name, tensor.dtype, tuple(tensor.shape)):
        raise RuntimeError(f"export wrote {name} out of order (expected {spec.name})")


class TorchWriter:
    """Writes one ``torch.save`` file (module docstring); tensors in ``specs`` order."""

    def __init__(self, output: Output, specs: Sequence[Spec]) -> None:
        self.order = list(specs)
        handle, self._skeleton_path = tempfile.mkstemp(suffix=".pt", prefix="s3ckpt-export-")
        os.close(handle)
        try:
            save_skeleton([(s.name, s.dtype, s.shape) for s in self.order], self._skeleton_path)
            self.records = _records(self._skeleton_path, self.order)
            self.skeleton = open(self._skeleton_path, "rb")  # noqa: SIM115 - closed in close()
        except BaseException:
            os.unlink(self._skeleton_path)
            raise
        try:
            self.stream = output.open(TORCH_NAME)
        except BaseException:
            self._remove_skeleton()
            raise
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.order[self._next]
        _check(spec, name, tensor)
        self._copy_to(self.records[self._next])
        self.stream.write(tensor_view(as_cpu_contiguous(tensor)))
        self.skeleton.seek(spec.nbytes, os.SEEK_CUR)
        self._next += 1

    def _copy_to(self, end: int | None) -> None:
        while end is None or self.skeleton.tell() < end:
            want = _COPY if end is None else min(_COPY, end - self.skeleton.tell())
            chunk = self.skeleton.read(want)
            if not chunk:
                return
            self.stream.write(chunk)

    def close(self) -> None:
        self._copy_to(None)
        self.stream.close()
        self._remove_skeleton()

    def discard(self) -> None:
        """Give up after a failure (the output removes the file); remove the skeleton."""
        self.stream.abort()
        self._remove_skeleton()

    def _remove_skeleton(self) -> None:
        self.skeleton.close()
        if os.path.exists(self._skeleton_path):
            os.unlink(self._skeleton_path)


def _records(path: str, specs: Sequence[Spec]) -> list[int]:
    """The file offset of each tensor's bytes in the skeleton, in ``specs`` order."""
    with open(path, "rb") as handle, zipfile.ZipFile(handle) as archive:
        data = [info for info in archive.infolist() if info.filename.split("/")[-2:-1] == ["data"]]
        data.sort(key=lambda info: int(info.filename.rsplit("/", 1)[1]))
        if [info.file_size for info in data] != [s.nbytes for s in specs]:
            raise RuntimeError("torch.save laid out the tensors in an unexpected order")
        offsets = []
        for info in data:
            handle.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", handle.read(4))
            offsets.append(info.header_offset + 30 + name_length + extra_length)
    if offsets != sorted(offsets):
        raise RuntimeError("torch.save laid out the tensors in an unexpected order")
    return offsets
