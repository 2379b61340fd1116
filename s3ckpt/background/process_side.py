"""The checkpoint process's side of the protocol (runs in that process, never in the
trainer): ``python -m s3ckpt.background.process_side FD``.

Started by :class:`~s3ckpt.background.process.CheckpointProcess` as a fresh interpreter
running this module, never the training script: nothing of ``__main__`` runs again here,
so a script needs no ``if __name__ == "__main__":`` guard. It speaks the protocol of
:mod:`s3ckpt.background.protocol` over the socket ``FD``: a :class:`Hello` (the trainer's
``sys.path``, the log level, with several ranks where the checkpoint processes meet, the
S3 configuration its saves will use, and the niceness to save at), answered
:class:`Ready` once the process has imported what a save runs, made that configuration's
S3 client, met its peers and lowered its priority (the start-up runs at the trainer's
priority: it is the first save's wait); then any number of :class:`Segments` (staging
memory of one arena to map, as descriptors) and :class:`SaveRequest` messages (an arena,
a staged state by reference, a writer or None, a planner, and a :class:`HoldRequest` or None),
each answered with :class:`Saved` (the DCP metadata, None without a writer) or
:class:`Failed` (the error); and :class:`Stop`, or the end of the socket, to exit. A save
with a :class:`HoldRequest` first records its copy as a memory-tier checkpoint (its CRC32Cs, then
its descriptor, :mod:`s3ckpt.background.held`) and answers :class:`CopyHeld`; then, with
several nodes, exchanges copies with its peers (:class:`Replicated`); then uploads it, if
it has a writer, from the same memory; after an upload's :class:`Saved`, the retention
the :class:`Hello` carried (rank 0's) deletes what the run's policy expires, on a thread
of its own beside the next save, then :class:`Retained` says so. Any other message ends the process with an error.

With several ranks the checkpoint processes form a gloo group of their own (the default
group of this process), met through the trainer rank 0's store, so a save's collectives
never touch the training loop's groups. A save that fails there leaves that group in an
unknown state (a peer may be gone mid-collective), so the process exits after reporting
the failure: its peers' collectives then fail at once rather than wait for a timeout, and
the trainers start fresh processes, together, at the next save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import signal
import socket
import sys
import threading
import warnings
from datetime import timedelta
from typing import Any

from s3ckpt.background.channel import Channel, ChannelClosed, loads_staged
from s3ckpt.background.priority import set_nice
from s3ckpt.background.protocol import (
    CopyHeld,
    Failed,
    Hello,
    HoldRequest,
    Meeting,
    Ready,
    Replicated,
    Retained,
    Saved,
    SaveRequest,
    Segments,
    Stop,
    ToTrainer,
    unknown,
)
from s3ckpt.transfer.thread_mode import tune_for_gil

log = logging.getLogger("s3ckpt.background")


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    tune_for_gil(False)  # no training loop shares this interpreter
    channel = Channel(socket.socket(fileno=fd))
    threading.Thread(target=_die_with_trainer, args=(fd,), daemon=True).start()
    try:
        hello, _ = channel.receive()
    except ChannelClosed:
        return 0
    if not isinstance(hello, Hello):
        raise unknown(hello, "the trainer before its Hello")
    sys.path[:] = [*hello.sys_path, *(p for p in sys.path if p not in hello.sys_path)]
    logging.basicConfig(level=hello.log_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("s3ckpt").setLevel(hello.log_level)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        _load(hello.config)
        _join(hello.meeting)
    except Exception as exc:
        _answer(channel, Failed(None, _portable(exc)))
        return 1
    if hello.nice is not None:
        set_nice(os.getpid(), hello.nice)
    _answer(channel, Ready(os.getpid()))
    return _serve(channel, distributed=hello.meeting is not None, retention=hello.retention)


def _load(config: Any) -> None:
    """Import what a save runs (DCP, the writer a save's message unpickles, the planner)
    and make ``config``'s S3 client (aiobotocore's service model is the first request's
    largest cost), so that the first save finds them done. A client that cannot be made
    is left for the first request to report."""
    import torch.distributed.checkpoint  # noqa: F401

    from s3ckpt.dcp import local_plan, writer  # noqa: F401

    if config is None:
        return
    from s3ckpt.s3.client import client_handle
    from s3ckpt.s3.loop import io_loop

    async def make() -> None:
        await client_handle(config).get()

    try:
        io_loop().run(make())
    except Exception:
        log.debug("the S3 client could not be made ahead of the first save", exc_info=True)


def _die_with_trainer(fd: int) -> None:
    """Exit at once when the trainer's end of the socket closes under a save: the trainer
    was killed (its interpreter's exit waits for the save in flight, then stops this
    process in order). The save is not committed, as when a thread-mode trainer is
    killed; ``s3ckpt gc`` removes its objects. Watches for the peer's hang-up alone
    (``POLLRDHUP``), never reading what the main thread is to read."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    while True:
        for _, events in poller.poll():
            if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                os._exit(1)


def _join(meeting: Meeting | None) -> None:
    if meeting is None:
        return
    import torch.distributed as dist

    timeout = timedelta(seconds=meeting.timeout_s)
    store = dist.TCPStore(meeting.host, meeting.port, is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(meeting.prefix, store),
        rank=meeting.rank,
        world_size=meeting.world,
        timeout=timeout,
    )


def _serve(channel: Channel, *, distributed: bool, retention: Any) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from s3ckpt.background.arena import StagingArena
    from s3ckpt.dcp.local_plan import ReusingSavePlanner

    # Retention lists and deletes beside the next save, never in its way.
    retaining = ThreadPoolExecutor(1, thread_name_prefix="s3ckpt-retention")
    arenas: dict[int, StagingArena] = {}
    # Per slot (its copies live at its own addresses), when the trainer gave no planner.
    planners: dict[int, ReusingSavePlanner] = {}
    try:
        while True:
            try:
                message, fds = channel.receive()
            except ChannelClosed:
                return 0
            match message:
                case Segments(slot, sizes):
                    arena = arenas.setdefault(slot, StagingArena())
                    for descriptor, size in zip(fds, sizes, strict=True):
                        arena.adopt(descriptor, size)
                case SaveRequest(slot=slot, planner=given):
                    planner = (
                        given
                        if given is not None
                        else planners.setdefault(slot, ReusingSavePlanner())
                    )
                    saved = _save(channel, arenas.get(slot), message, planner)
                    if given is None:
                        planner.let_go()  # its views of the segments, which may be replaced
                    if not saved and distributed:
                        return 1
                    if saved and retention is not None and message.writer is not None:
                        retaining.submit(_retain, channel, retention, message)
                case Stop():
                    return 0
                case _:
                    raise unknown(message, "the trainer")
    finally:
        retaining.shutdown(wait=True)
        for arena in arenas.values():
            arena.close()
        _leave(distributed)


def _retain(channel: Channel, retention: Any, request: SaveRequest) -> None:
    """The run's retention after the commit of ``request``, then :class:`Retained`."""
    try:
        retention.after_commit(request.writer.location)
    except Exception:  # it logs its own failures; never leave the trainer waiting
        log.exception("retention after save %d failed", request.save_id)
    _answer(channel, Retained(request.save_id))


def _save(channel: Channel, arena: Any, request: SaveRequest, planner: Any) -> bool:
    """Run one save (hold its copy, upload it); whether it completed. Its answer carries
    the request's ``reply`` of DCP's metadata, or the metadata itself."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    save_id, hold, writer, reply = request.save_id, request.hold, request.writer, request.reply
    segments = arena.mappings if arena is not None else []
    try:
        if hold is not None:
            if hold.folder:
                _hold(segments, request.data, hold)
                _answer(channel, CopyHeld(save_id))
            if hold.replicate is not None:
                from s3ckpt.background.replicate import exchange

                exchange(hold.replicate)
                _answer(channel, Replicated(save_id))
        distributed = dist.is_initialized()
        if writer is not None and distributed:
            from s3ckpt.background.ranks import raise_copy_failures

            raise_copy_failures(request.copy_failure)
        if request.copy_failure is not None:
            from s3ckpt.errors import CheckpointError

            raise CheckpointError(request.copy_failure.reason)
        if writer is None:
            _answer(channel, Saved(save_id, None))
            return True
        state = loads_staged(request.data, segments)
        metadata = dcp.save(state, storage_writer=writer, planner=planner, no_dist=not distributed)
        answer = metadata if reply is None else reply(metadata)
    except BaseException as exc:
        log.debug("save %d failed", save_id, exc_info=True)
        _answer(channel, Failed(save_id, _portable(exc)))
        return False
    _answer(channel, Saved(save_id, answer))
    return True


def _hold(segments: list[Any], data: bytes, hold: HoldRequest) -> None:
    """Checksum the copy's regions, then record it in its slot (descriptor last)."""
    import time
    from pathlib import Path

    from crc32c import crc32c

    from s3ckpt.background import held

    crcs = held.region_crcs(segments, hold.regions)
    regions = [
        held.HeldRegion(*region, crc) for region, crc in zip(hold.regions, crcs, strict=True)
    ]
    record = held.HeldRecord(
        step=hold.step,
        rank=hold.rank,
        world=hold.world,
        run=hold.run,
        segments=tuple(len(segment) for segment in segments),
        regions=tuple(regions),
        state_crc32c=crc32c(data),
        nbytes=sum(nbytes for _, _, nbytes in hold.regions),
        created=time.time(),
        lineage=hold.lineage,
    )
    held.write(Path(hold.folder), record, data)


def _portable(exc: BaseException) -> BaseException:
    """The s3ckpt error inside ``exc``, in a form that survives pickling."""
    from s3ckpt.dcp.compat import unwrap
    from s3ckpt.errors import CheckpointError

    error = unwrap(exc)
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return CheckpointError(f"{type(error).__name__}: {error}")


def _answer(channel: Channel, message: ToTrainer) -> None:
    with _sending, contextlib.suppress(ChannelClosed):  # the trainer is gone: nobody to tell
        channel.send(message)


_sending = threading.Lock()  # the save's answers and retention's, one message at a time


def _leave(distributed: bool) -> None:
    if not distributed:
        return
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception:
        log.debug("could not destroy the checkpoint processes' group", exc_info=True)


if __name__ == "__main__":
    code = main(int(sys.argv[1]))
    # Nothing is left to do once the trainer's socket is done with: the interpreter's
    # teardown (torch's, the I/O loop's) would only delay the trainer's close.
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
