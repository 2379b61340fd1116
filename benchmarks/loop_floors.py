"""Floors for thread-mode saves in the ``loop`` benchmark: what a thread-mode save costs the
loop with less of the upload in Python than any real store client has.

Both are ``dcp.async_save`` in thread mode with s3ckpt's ``HostStager`` and
``ReusingSavePlanner`` (the staging and planning of ``dcp_thread`` and the manager's
thread mode), each item's bytes viewed and CRC32C'd as ``S3StorageWriter`` does; only
what happens to the bytes differs:

* ``floor_no_network``: nothing is sent. The storage waits ``FLOOR_WAIT_S`` (0.8 s, about
  a real upload's time here) in one call that lets the GIL go, so that the slowdown is
  measured over a window as long as a real upload's. What it costs the loop is DCP's own
  thread-mode machinery, the staging, the plan and the checksums.
* ``floor_raw_sockets``: the leanest uploader Python can have. Items are cut or packed into
  16 MiB parts (small ones joined without the GIL, as ``S3StorageWriter`` does), and four
  threads send each part as one unsigned ``PUT`` on a kept-alive blocking socket (one
  ``sendall`` for the head, one for the body, the GIL released over each) and read the
  answer's head: about four GIL hand-overs and a few microseconds of Python per part, no
  event loop, no signing, no retries, no multipart upload, no manifest. Not a checkpoint:
  the objects are only bytes, under the case's prefix.

* ``floor_native_batch``: the raw floor's unsigned PUTs, every part of the save handed
  to s3ckpt's native sender (:mod:`s3ckpt.s3.wire.batch`) in one call: the GIL taken back
  once for the whole upload. What sending costs the loop when no request of it runs
  Python.

One floor is for the checkpoint process instead (the manager's default):

* ``floor_process``: what any uploader in its own process costs the loop on this host.
  The save copies the state into shared memory kept from save to save (the default's
  blocking), and a child process started once (:mod:`benchmarks.floor_sender`) sends those
  bytes as the native floor's unsigned PUTs: no checksums, signing, multipart upload or
  manifest, no Python per part. The loop shares no interpreter with it, so what is left
  of its slowdown is the host's: the memory traffic of the bytes crossing loopback (the
  kernel's copies on both sides) and of the server storing them, beside the loop's core.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future as SaveFuture
from typing import Any
from urllib.parse import urlsplit

import torch
from s3ckpt.transfer._gather import join
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from benchmarks.floor_sender import SENDERS, put_head, send_parts
from s3ckpt.dcp.rank_save import _item_bytes, planned_size
from s3ckpt.format.compression import RawRuns
from s3ckpt.transfer.parts import DEFAULT_PART_SIZE as PART

FLOOR_WAIT_S = float(os.environ.get("FLOOR_WAIT_S", "0.8"))


class ViewingWriter(StorageWriter):
    """A storage that sees every item's bytes as ``S3StorageWriter`` does and stores nothing."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def write_data(self, plan: Any, planner: Any) -> Future:
        views, results = [], []
        runs: RawRuns[Any] = RawRuns()  # the block CRC32Cs of the writer's index
        done = []
        for item in plan.items:
            if runs.add(item, _item_bytes(item, planned_size(item), planner)):
                done.extend(runs.take())
        for item, encoded in [*done, *runs.take()]:
            views.append(encoded.payload)
            results.append(
                WriteResult(index=item.index, size_in_bytes=encoded.raw_length, storage_data=None)
            )
        self.store(views)
        future: Future = Future()
        future.set_result(results)
        return future

    def store(self, views: list[memoryview]) -> None:
        time.sleep(FLOOR_WAIT_S)

    def finish(self, metadata: Any, results: Any) -> None:
        pass

    def storage_meta(self) -> StorageMeta:
        return StorageMeta()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class _Senders:
    """Four threads, each with one kept-alive connection, sending parts as plain PUTs."""

    def __init__(self) -> None:
        url = urlsplit(os.environ["AWS_ENDPOINT_URL"])
        self.address = (url.hostname, url.port)
        self.prefix = f"/{os.environ['BENCH_BUCKET']}/{os.environ['BENCH_PREFIX']}/raw"
        self.parts: queue.Queue[tuple[int, Any, queue.Queue[Exception | None]]] = queue.Queue()
        for _ in range(SENDERS):
            threading.Thread(target=self._send_parts, daemon=True).start()

    def _send_parts(self) -> None:
        sock = socket.create_connection(self.address)
        scratch = memoryview(bytearray(65536))
        while True:
            number, body, sent = self.parts.get()
            try:
                self._put(sock, scratch, number, body)
            except Exception as exc:  # the save fails with it instead of waiting forever
                sent.put(exc)
                sock.close()
                sock = socket.create_connection(self.address)
            else:
                sent.put(None)

    def _put(self, sock: socket.socket, scratch: memoryview, number: int, body: Any) -> None:
        sock.sendall(put_head(f"{self.prefix}/{number}", len(body)))
        sock.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            count = sock.recv_into(scratch)
            if not count:
                raise ConnectionError("the server closed the connection")
            answer += bytes(scratch[:count])
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"PUT failed: {answer[:200]!r}")


class RawSocketWriter(ViewingWriter):
    senders: _Senders | None = None

    def store(self, views: list[memoryview]) -> None:
        if RawSocketWriter.senders is None:
            RawSocketWriter.senders = _Senders()
        parts = _parts(views)
        sent: queue.Queue[Exception | None] = queue.Queue()
        for number, part in enumerate(parts):
            RawSocketWriter.senders.parts.put((number, part, sent))
        errors = [error for error in (sent.get() for _ in parts) if error is not None]
        if errors:
            raise errors[0]


def _parts(views: list[memoryview]) -> list[memoryview | bytes]:
    """Large items cut into parts, small ones packed together, in item order."""
    parts: list[memoryview | bytes] = []
    small: list[memoryview] = []
    packed = 0
    for view in views:
        if len(view) >= PART // 2:
            parts.extend(view[start : start + PART] for start in range(0, len(view), PART))
            continue
        small.append(view)
        packed += len(view)
        if packed >= PART:
            parts.append(join(small))
            small, packed = [], 0
    if small:
        parts.append(join(small))
    return parts


class NativeBatchWriter(ViewingWriter):
    """The raw floor's PUTs, all of a save's parts handed to the native sender at once
    (four connections, the raw floor's four threads)."""

    def store(self, views: list[memoryview]) -> None:
        send_parts(
            _parts(views), f"/{os.environ['BENCH_BUCKET']}/{os.environ['BENCH_PREFIX']}/native"
        )


class ProcessFloor:
    """``floor_process`` (the module's docstring): ``save(state, number)`` copies ``state``'s
    tensors into the shared mapping and has the child send it; the first save starts the
    child, which inherits the caller's CPUs."""

    def __init__(self) -> None:
        self.fd, self.path = tempfile.mkstemp(prefix="s3ckpt-floor-", dir="/dev/shm")
        self.targets: list[torch.Tensor] = []
        self.child: subprocess.Popen[str] | None = None
        atexit.register(self.close)

    def save(self, state: dict[str, Any], number: int) -> SaveFuture[int]:
        tensors = list(_tensors(state))
        if self.child is None:
            self._start(tensors)
        for target, tensor in zip(self.targets, tensors, strict=True):
            target.copy_(tensor)
        assert self.child is not None and self.child.stdin is not None
        self.child.stdin.write(f"{number}\n")
        self.child.stdin.flush()
        sent: SaveFuture[int] = SaveFuture()
        threading.Thread(target=self._answer, args=(sent,), daemon=True).start()
        return sent

    def _start(self, tensors: list[torch.Tensor]) -> None:
        sizes = [-(-t.nbytes // 64) * 64 for t in tensors]  # each tensor 64-byte aligned
        total = sum(sizes)
        os.ftruncate(self.fd, total)
        flat = torch.frombuffer(mmap.mmap(self.fd, total), dtype=torch.uint8)
        self.targets = [
            flat[start : start + t.nbytes].view(t.dtype).view(t.shape)
            for start, t in zip(itertools.accumulate(sizes[:-1], initial=0), tensors, strict=True)
        ]
        self.child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.floor_sender", self.path, str(total)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def _answer(self, sent: SaveFuture[int]) -> None:
        assert self.child is not None and self.child.stdout is not None
        line = self.child.stdout.readline().strip()
        if line.isdigit():
            sent.set_result(int(line))
        else:
            sent.set_exception(RuntimeError(f"the floor's sender: {line or 'exited'}"))

    def close(self) -> None:
        """Stop the child (its stdin closed) and remove the shared file."""
        if self.child is not None and self.child.stdin is not None:
            self.child.stdin.close()
            self.child.wait(timeout=30)
        os.close(self.fd)
        os.unlink(self.path)


def _tensors(state: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The state's tensors, in order, nested dicts walked."""
    for value in state.values():
        if isinstance(value, dict):
            yield from _tensors(value)
        else:
            yield value
