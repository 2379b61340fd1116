"""The trainer's line to its checkpoint process: messages, descriptors and staged state.

One Unix stream socket per pair. A message is a pickle behind a 12-byte header (its
length and how many descriptors ride with the header, by ``SCM_RIGHTS``): segments of the
staging arena travel as descriptors, once each. Staged state is pickled with the arena's
tensors by reference (segment, offset, length, dtype), so a save sends a description of
its tensors, never their bytes; any other tensor in the state (inside an object the stage
does not walk) is pickled whole, as torch pickles it.

A plain tensor over the arena is described in one persistent id (its storage's region,
offset, shape, strides), not through torch's ``__reduce_ex__``, which builds a typed
storage, hooks and metadata per tensor in Python, while the training loop waits for this
pickle (docs/decisions/0007-staging-arena.md). Tensors that shared a storage still share
one when loaded.

Both sides are trusted: the socket joins a process and the child it started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import mmap
import pickle
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from s3ckpt.background.arena import Region, StagingArena
from s3ckpt.dcp.compat import has_lazy_bits

_HEADER = struct.Struct("!QI")
_MAX_FDS = 64


class ChannelClosed(EOFError):
    """The other end of the channel is gone."""


class Channel:
    """Framed pickles (and descriptors) over one connected ``AF_UNIX`` stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any, fds: list[int] | None = None) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        header = _HEADER.pack(len(payload), len(fds or ()))
        try:
            with self._send_lock:
                if fds:
                    sent = socket.send_fds(self.sock, [header], fds)
                    self.sock.sendall(header[sent:])
                else:
                    self.sock.sendall(header)
                self.sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChannelClosed(str(exc)) from exc

    def receive(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors that came with it; ChannelClosed at EOF."""
        header, fds = bytearray(), []
        while len(header) < _HEADER.size:
            data, got, _, _ = socket.recv_fds(self.sock, _HEADER.size - len(header), _MAX_FDS)
            if not data:
                raise ChannelClosed("the other end closed the channel")
            header += data
            fds += got
        size, count = _HEADER.unpack(header)
        if count != len(fds):
            raise ChannelClosed(f"expected {count} descriptors with a message, got {len(fds)}")
        payload = bytearray(size)
        view, at = memoryview(payload), 0
        while at < size:
            got_bytes = self.sock.recv_into(view[at:])
            if not got_bytes:
                raise ChannelClosed("the other end closed the channel mid-message")
            at += got_bytes
        return pickle.loads(payload), fds

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def dumps_staged(
    state: Any, arena: StagingArena, placed: Mapping[int, Region] | None = None
) -> bytes:
    """``state`` pickled with its arena tensors by reference. ``placed``: the region of
    tensors known to be plain arena tensors (by ``id``; a stage's own): taken as they are,
    without the checks and the look-up any other tensor gets, which the training loop
    would wait for (docs/decisions/0007-staging-arena.md)."""
    buffer = io.BytesIO()
    _ArenaPickler(buffer, arena, placed or {}).dump(state)
    return buffer.getvalue()


def loads_staged(data: bytes, segments: Sequence[mmap.mmap]) -> Any:
    """The state :func:`dumps_staged` pickled, its tensors over ``segments`` (this
    process's mappings of the arena's segments, in order)."""
    return _ArenaUnpickler(io.BytesIO(data), segments).load()


class _ArenaPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, arena: StagingArena, placed: Mapping[int, Region]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena
        self._placed = placed

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor:
            region = self._placed.get(id(obj))
            if region is not None:
                return _TensorId.pack(region, obj)
            return self._tensor_id(obj)
        if not isinstance(obj, torch.storage.TypedStorage):
            return None
        storage = obj._untyped_storage
        if storage.device.type != "cpu" or storage.nbytes() == 0:
            return None
        region = self._arena.locate(storage.data_ptr(), storage.nbytes())
        if region is None:
            return None
        return ("arena", region.segment, region.offset, region.nbytes, obj.dtype)

    def _tensor_id(self, tensor: torch.Tensor) -> Any:
        """A plain CPU tensor over the arena, whole in one id; None (pickled by torch)
        for anything its bytes, shape and strides would not describe."""
        if (
            tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or has_lazy_bits(tensor)  # its bytes are not its values
            or tensor.is_quantized
            or tensor.__dict__
        ):
            return None
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        region = self._arena.locate(storage.data_ptr(), storage.nbytes())
        if region is None:
            return None
        return _TensorId.pack(region, tensor)


class _ArenaUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, segments: Sequence[mmap.mmap]) -> None:
        super().__init__(file)
        self._segments = segments
        self._storages: dict[tuple[int, int, int], torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, bytes):
            found = _TensorId.unpack(pid)
            storage = self._storage(found.segment, found.offset, found.nbytes)
            loaded = torch.empty(0, dtype=found.dtype).set_(
                storage, found.storage_offset, found.shape, found.stride
            )
            return loaded.requires_grad_() if found.requires_grad else loaded
        kind, segment, offset, nbytes, dtype = pid
        if kind != "arena":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        storage = self._storage(segment, offset, nbytes)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    def _storage(self, segment: int, offset: int, nbytes: int) -> torch.UntypedStorage:
        """The storage over a region: one per region, so tensors that shared a storage
        when pickled share it again."""
        key = (segment, offset, nbytes)
        if key not in self._storages:
            if nbytes == 0:
                self._storages[key] = torch.UntypedStorage(0)
            else:
                view = torch.frombuffer(
                    self._segments[segment], dtype=torch.uint8, count=nbytes, offset=offset
                )
                self._storages[key] = view.untyped_storage()
        return self._storages[key]


@dataclasses.dataclass(frozen=True)
class _TensorId:
    """A plain tensor over the arena, as one ``bytes`` persistent id: the pickler calls
    ``persistent_id`` again for every element of an id that is a tuple (nine a tensor),
    once for bytes."""

    segment: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool

    _HEAD = struct.Struct("<QQQQ?BB")  # segment, offset, nbytes, storage offset, grad, dims, name

    @classmethod
    def pack(cls, region: Any, tensor: torch.Tensor) -> bytes:
        name = _dtype_name(tensor.dtype)
        dims = tensor.dim()
        head = cls._HEAD.pack(
            region.segment, region.offset, region.nbytes, tensor.storage_offset(),
            tensor.requires_grad, dims, len(name),
        )  # fmt: skip
        return head + name + struct.pack(f"<{2 * dims}q", *tensor.shape, *tensor.stride())

    @classmethod
    def unpack(cls, data: bytes) -> _TensorId:
        segment, offset, nbytes, storage_offset, grad, dims, length = cls._HEAD.unpack_from(data)
        at = cls._HEAD.size
        dtype = getattr(torch, data[at : at + length].decode())
        sizes = struct.unpack_from(f"<{2 * dims}q", data, at + length)
        return cls(segment, offset, nbytes, dtype, storage_offset, sizes[:dims], sizes[dims:], grad)


@functools.cache
def _dtype_name(dtype: torch.dtype) -> bytes:
    return str(dtype).removeprefix("torch.").encode()
