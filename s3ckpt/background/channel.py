"""The trainer's line to its checkpoint process: messages, descriptors and staged state.

One Unix stream socket per pair. A message is a pickle behind a 12-byte header (its
length and how many descriptors ride with the header, by ``SCM_RIGHTS``): segments of the
staging arena travel as descriptors, once each. Staged state is pickled with the arena's
tensors by reference (segment, offset, length, dtype), so a save sends a description of
its tensors, never their bytes; any other tensor in the state (inside an object the stage
does not walk) is pickled whole, as torch pickles it.

Both sides are trusted: the socket joins a process and the child it started.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import pickle
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

from s3ckpt.background.arena import StagingArena

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


def dumps_staged(state: Any, arena: StagingArena) -> bytes:
    """``state`` pickled with its arena tensors by reference."""
    buffer = io.BytesIO()
    _ArenaPickler(buffer, arena).dump(state)
    return buffer.getvalue()


def loads_staged(data: bytes, segments: Sequence[mmap.mmap]) -> Any:
    """The state :func:`dumps_staged` pickled, its tensors over ``segments`` (this
    process's mappings of the arena's segments, in order)."""
    return _ArenaUnpickler(io.BytesIO(data), segments).load()


class _ArenaPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, arena: StagingArena) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.storage.TypedStorage):
            return None
        storage = obj._untyped_storage
        if storage.device.type != "cpu" or storage.nbytes() == 0:
            return None
        region = self._arena.locate(storage.data_ptr(), storage.nbytes())
        if region is None:
            return None
        return ("arena", region.segment, region.offset, region.nbytes, obj.dtype)


class _ArenaUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, segments: Sequence[mmap.mmap]) -> None:
        super().__init__(file)
        self._segments = segments

    def persistent_load(self, pid: Any) -> Any:
        kind, segment, offset, nbytes, dtype = pid
        if kind != "arena":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        if nbytes == 0:
            storage = torch.UntypedStorage(0)
        else:
            view = torch.frombuffer(
                self._segments[segment], dtype=torch.uint8, count=nbytes, offset=offset
            )
            storage = view.untyped_storage()
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
