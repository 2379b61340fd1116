"""The in-flight record of a save: how ``gc`` and ``prune`` know that a save is running.

Until its commit, a save's objects look exactly like the leftovers of a save that died,
and ``gc`` removes those once they are older than its grace period. A save that runs for
longer than the grace, or a ``gc`` run with a short grace, would delete objects a save is
about to commit. So every save keeps a small record, ``<checkpoint>/.s3ckpt-saving-<id>``:

* the coordinator writes it before any rank writes an object (DCP's global planning);
* every rank rewrites it every :data:`HEARTBEAT_S` while its ``write_data`` runs, and the
  coordinator again when it starts the commit, unless it wrote the record itself less
  than :data:`HEARTBEAT_S` before (the lease then outlasts the commit by minutes);
* the coordinator deletes it once the save is committed or cleaned up.

A record whose ``LastModified`` (the server's clock) is less than :data:`LEASE_S` old marks
its directory busy: ``gc`` and ``prune`` leave it alone whatever their grace. A save that
died stops refreshing its record, which ``gc`` then removes with the rest of its objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from types import TracebackType

from s3ckpt.config import S3URI
from s3ckpt.errors import StorageError
from s3ckpt.format.layout import HEARTBEAT_S, saving_key
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore

log = logging.getLogger(__name__)


async def mark_in_flight(store: ObjectStore, location: S3URI, save_id: str) -> None:
    """Write (or refresh) the save's record."""
    body = json.dumps({"save_id": save_id}).encode()
    await store.put(location.key(saving_key(save_id)), body, content_type="application/json")


async def clear_in_flight(store: ObjectStore, location: S3URI, save_id: str) -> None:
    """Delete the save's record; a failure only delays ``gc`` (logged)."""
    try:
        await store.delete_many([location.key(saving_key(save_id))])
    except StorageError as exc:
        log.warning("could not delete the in-flight record of save %s: %s", save_id, exc)


class Heartbeat:
    """Refreshes a save's record every :data:`HEARTBEAT_S` while the ``with`` block runs.

    The refreshes run on the I/O loop, so a rank busy in its calling thread (compressing,
    waiting for uploads) still keeps its record fresh. A failed refresh is logged, not
    raised: it matters only if the save outlives :data:`LEASE_S` without another success.

    Leaving the block stops the refreshes and waits until they have stopped: a refresh
    that is on the wire then is left to finish (for up to the store's ``read_timeout``;
    past that it is cancelled, and the cancellation awaited), so that none lands after the
    block, where it would recreate the record that the commit or the clean-up deletes
    next and hold ``gc`` and ``prune`` off the directory for a lease.
    """

    def __init__(self, store: ObjectStore, location: S3URI, save_id: str) -> None:
        self.store, self.location, self.save_id = store, location, save_id
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._refreshing = False

    def __enter__(self) -> Heartbeat:
        self._stopping = False
        if _on_loop_thread():
            self._task = asyncio.get_running_loop().create_task(self._beat())
        else:
            self._task = io_loop().submit(self._start(), scoped=False).result()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if _on_loop_thread():  # the loop cannot run while we wait on it: cancel, do not wait
            self._stopping = True
            task.cancel()
            return
        io_loop().submit(self._stop(task), scoped=False).result()

    async def _start(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._beat())

    async def _stop(self, task: asyncio.Task[None]) -> None:
        """End the beat (on the loop): at once when it sleeps, after the refresh it has on
        the wire otherwise (bounded by the store's read timeout); return once it has ended."""
        self._stopping = True
        if not self._refreshing:
            task.cancel()
        _, pending = await asyncio.wait([task], timeout=self.store.config.read_timeout)
        if pending:
            log.warning("a refresh of the in-flight record of %s hangs; cancelled", self.location)
            task.cancel()
            await asyncio.wait([task])

    async def _beat(self) -> None:
        while not self._stopping:
            # Jitter spreads the refreshes of many ranks over the interval.
            await asyncio.sleep(HEARTBEAT_S * random.uniform(0.8, 1.0))
            self._refreshing = True
            try:
                await mark_in_flight(self.store, self.location, self.save_id)
            except StorageError as exc:
                log.warning("could not refresh the in-flight record of %s: %s", self.location, exc)
            finally:
                self._refreshing = False


def _on_loop_thread() -> bool:
    """Whether the caller runs on the I/O loop's own thread."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return running is io_loop().loop
