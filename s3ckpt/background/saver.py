"""``BackgroundSaver``: the one background saver under the manager and the integrations.

A save blocks the training loop only while its state is copied to host memory; its upload
and commit then run in the background, at most one at a time (the copy's memory is kept
and reused, so the next save waits for the one in flight). Two ways to run the upload:

* ``"process"`` (the default everywhere): the rank's persistent
  :class:`~s3ckpt.background.process.CheckpointProcess`, fed from shared memory. The
  loop's interpreter does nothing for the upload, so it loses only the copy.
* ``"thread"``: ``dcp.save`` of a :class:`~s3ckpt.dcp.staging.HostStager` copy on a
  worker thread of the loop's process, on a gloo group of its own (so the save's
  collectives never interleave with the loop's). Costs the loop the GIL the upload's
  Python holds; kept for those who cannot start a process.

Either way the engine that committed a save applies the run's retention after it
(``retention``: rank 0's), once the save's outcome is reported.

A rank whose copy fails raises its error at once, but first starts its save with a
:class:`~s3ckpt.background.protocol.CopyFailure` in place of the copy: every rank's save
meets it before its first collective (:func:`~s3ckpt.background.ranks.raise_copy_failures`)
and fails with it, so no rank waits for this one and nothing is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from s3ckpt.background.process import CheckpointProcess
from s3ckpt.background.protocol import CopyFailure
from s3ckpt.background.ranks import raise_copy_failures
from s3ckpt.background.trainer_side import TierHold
from s3ckpt.catalog.run_retention import RunRetention
from s3ckpt.dcp.compat import save_plain
from s3ckpt.dcp.local_plan import ReusingSavePlanner
from s3ckpt.dcp.staging import HostStager, plain_state_dict
from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.errors import CheckpointError, ConfigError

log = logging.getLogger("s3ckpt.background")

SaverMode = Literal["process", "thread"]


class BackgroundSaver:
    """The staging memory, the upload's runner and the save group of one manager or
    strategy. With several ranks, every rank constructs it at the same point.

    Each save's future resolves to DCP's metadata, or to ``reply`` of it, made where the
    save ran (in process mode, the checkpoint process: only that crosses to the trainer,
    see :meth:`CheckpointProcess.submit`)."""

    def __init__(
        self,
        mode: SaverMode = "process",
        process_group: Any = None,
        *,
        memory_slots: Sequence[Path] = (),
        reply: Callable[[Any], Any] | None = None,
        retention: RunRetention | None = None,
        **process_options: Any,
    ) -> None:
        self.mode = mode
        self._reply = reply
        self._retention = retention
        self._retaining: ThreadPoolExecutor | None = None  # thread mode's retention
        self._retained: Future[None] | None = None
        self._group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self._process: CheckpointProcess | None = None
        self._ready = False
        self._stager: HostStager | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._save_group: Any = None
        if mode == "process":
            self._process = CheckpointProcess(
                process_group, memory_slots=memory_slots, retention=retention, **process_options
            )
        else:
            self._stager = HostStager()
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3ckpt-save")
            # One save at a time on that thread: the planner keeps its local plan.
            self._planner = ReusingSavePlanner()
            if self.world > 1:
                ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
                # its collectives wait as long as the checkpoint processes' would
                timeout = process_options.get("timeout_s")
                self._save_group = dist.new_group(
                    ranks=ranks, backend="gloo",
                    timeout=None if timeout is None else timedelta(seconds=timeout),
                )  # fmt: skip

    @property
    def process(self) -> CheckpointProcess | None:
        """The checkpoint process (process mode)."""
        return self._process

    def prepare(self, timeout_s: float | None = None) -> None:
        """Process mode: wait until the checkpoint process is ready
        (:meth:`CheckpointProcess.prepare`); thread mode has nothing to wait for."""
        if self._process is not None:
            self._process.prepare(timeout_s)

    def hurried(self) -> contextlib.AbstractContextManager[None]:
        """Around a wait for the save in flight (:meth:`CheckpointProcess.hurried`)."""
        return self._process.hurried() if self._process is not None else contextlib.nullcontext()

    def ready(self, describe: str, agree: Any = None) -> None:
        """Get ready for the next save (:meth:`start` does it when not done): wait for the
        save in flight, start fresh checkpoint processes where needed. ``agree`` (process
        mode): what every rank must pass the same (the step, whether it uploads), checked
        in the all-gather that costs anyway; a :class:`~s3ckpt.errors.ConfigError` on
        every rank when they differ (they would otherwise wait for each other in
        different saves). Called before anything about the save is changed (a memory
        slot emptied), so a refused save changes nothing."""
        if self._process is None:
            return
        self._process.wait_idle()
        agreed = self._process.refresh(agree)
        if any(value != agreed[0] for value in agreed):
            raise ConfigError(
                f"{describe}: the ranks did not start the same save ("
                + ", ".join(f"rank {r}: {v}" for r, v in enumerate(agreed))
                + "); every rank saves the same step, each with a writer or each without"
            )
        self._ready = True

    def start(
        self,
        state_dict: dict[str, Any],
        writer: S3StorageWriter | None,
        describe: str,
        *,
        hold: TierHold | None = None,
        planner: Any = None,
    ) -> tuple[Future[Any], Exception | None]:
        """Copy ``state_dict`` to host memory, then start its upload with ``writer``; the
        upload's future, and this rank's copy failure if it had one (the caller raises it;
        with one rank it is raised here). ``describe`` names the save in that error. The
        previous save must be finished.

        With ``hold`` (process mode), the copy is also held as a memory-tier checkpoint;
        ``writer`` may then be None: held only, with no collective, so a rank whose copy
        fails raises at once (its step is then not held by every rank, which a restore
        sees). With replication and several ranks, a rank whose copy fails still takes
        part in the exchange, sending nothing, so its peers fail the save instead of
        waiting for it."""
        if not self._ready:
            self.ready(describe)
        self._ready = False
        slot = hold.slot if hold is not None else 0
        try:
            staged, failure = self._stage(state_dict, slot), None
            if hold is not None:
                hold.nbytes = staged.nbytes
        except Exception as exc:
            if self.world == 1 or (writer is None and not _replicates(hold)):
                raise
            staged, failure = None, exc
        copy_failure = None
        if failure is not None:
            copy_failure = CopyFailure(
                f"{describe} not saved: rank {self.rank} could not copy its state to host "
                f"memory ({type(failure).__name__}: {failure})"
            )
            if hold is not None:
                hold = _nothing_to_send(hold)
        return self._upload(staged, writer, hold, planner, copy_failure), failure

    def _stage(self, state_dict: dict[str, Any], slot: int) -> Any:
        if self._process is not None:
            return self._process.stage(state_dict, slot)
        assert self._stager is not None
        # The planner's view of the last copy goes too, so that the stager frees its
        # tensors here rather than on the upload's thread (HostStager.stage says why).
        self._planner.let_go()
        return self._stager.stage(plain_state_dict(state_dict))

    def _upload(
        self,
        staged: Any,
        writer: S3StorageWriter | None,
        hold: TierHold | None,
        planner: Any,
        copy_failure: CopyFailure | None,
    ) -> Future[Any]:
        if self._process is not None:
            if staged is None:
                staged = self._process.stage({}, hold.slot if hold is not None else 0)
            return self._process.submit(
                staged, writer, planner, hold=hold, reply=self._reply, copy_failure=copy_failure
            )
        assert self._thread is not None
        future = self._thread.submit(
            _save_on_thread, self._reply, copy_failure, staged if staged is not None else {},
            storage_writer=writer, planner=planner if planner is not None else self._planner,
            process_group=self._save_group, no_dist=self._save_group is None,
        )  # fmt: skip
        if self._retention is not None and writer is not None:
            if self._retaining is None:  # beside the next save, as in the checkpoint process
                self._retaining = ThreadPoolExecutor(1, thread_name_prefix="s3ckpt-retention")
            self._retained = self._retaining.submit(_retain, future, self._retention, writer)
        return future

    def wait_retained(self) -> None:
        """Wait for the retention after the last upload (``retention``) to be done."""
        if self._process is not None:
            self._process.wait_retained()
        elif self._retained is not None:
            self._retained.result()

    def close(self) -> None:
        """After the last save: wait for it and its retention, then release the process or
        the thread, the memory and the save group."""
        try:
            if self._process is not None:
                self._process.close()
            if self._thread is not None:
                self._thread.shutdown(wait=True)
            if self._retaining is not None:
                self._retaining.shutdown(wait=True)
        finally:
            if self._stager is not None:
                self._stager.close()
            if self._save_group is not None:
                try:
                    dist.destroy_process_group(self._save_group)
                except Exception:  # the default group may be gone already
                    log.debug("could not destroy the checkpoint process group", exc_info=True)
                self._save_group = None


def _replicates(hold: TierHold | None) -> bool:
    return hold is not None and hold.request.replicate is not None


def _nothing_to_send(hold: TierHold) -> TierHold:
    """``hold`` for a rank whose copy failed: nothing held, and nothing sent to its peers
    (it still receives theirs, and the exchange then fails on every rank)."""
    replicate = hold.request.replicate
    if replicate is not None:
        replicate = dataclasses.replace(
            replicate, sends=tuple((peer, "") for peer, _ in replicate.sends)
        )
    request = dataclasses.replace(hold.request, folder="", replicate=replicate)
    return dataclasses.replace(hold, request=request)


def _retain(save: Future[Any], retention: RunRetention, writer: S3StorageWriter) -> None:
    """Thread mode: ``retention`` once ``save`` has ended, if it committed."""
    if save.exception() is None and writer.location is not None:
        retention.after_commit(writer.location)


def _save_on_thread(
    reply: Callable[[Any], Any] | None,
    copy_failure: CopyFailure | None,
    state: dict[str, Any],
    **options: Any,
) -> Any:
    """A thread-mode save: DCP's metadata, or ``reply`` of it; with several ranks, first
    the copy failure of any rank, raised on every rank."""
    if options["process_group"] is not None:
        raise_copy_failures(copy_failure, options["process_group"])
    if copy_failure is not None:
        raise CheckpointError(copy_failure.reason)
    metadata = save_plain(state, **options)
    return metadata if reply is None else reply(metadata)


def state_bytes(metadata: Any) -> int:
    """Tensor bytes of the state saved (uncompressed), from the metadata DCP's save returns:
    what the throughput of a save is measured in. As a saver's ``reply``, the one number
    crosses back to the trainer instead of the metadata (:meth:`CheckpointProcess.submit`
    says what that saves)."""
    total = 0
    for md in getattr(metadata, "state_dict_metadata", {}).values():
        properties, size = getattr(md, "properties", None), getattr(md, "size", None)
        if properties is None or size is None:
            continue  # a non-tensor item
        numel = 1
        for extent in size:
            numel *= int(extent)
        total += numel * properties.dtype.itemsize
    return total
