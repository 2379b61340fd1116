"""The in-flight record of a save: how ``gc`` and ``prune`` know that a save is running.

Until its commit, a save's objects look exactly like the leftovers of a save that died,
and ``gc`` removes those once they are older than its grace period. A save that runs for
longer than the grace, or a ``gc`` run with a short grace, would delete objects a save is
about to commit. So every save keeps a small record, ``<checkpoint>/.s3ckpt-saving-<id>``:

* the coordinator writes it before any rank writes an object (DCP's global planning);
* every rank rewrites it every :data:`HEARTBEAT_S` while its ``write_data`` runs, and the
  coordinator again when it starts the commit;
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
from concurrent.futures import Future
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
    """

    def __init__(self, store: ObjectStore, location: S3URI, save_id: str) -> None:
        self.store, self.location, self.save_id = store, location, save_id
        self._task: Future[None] | None = None

    def __enter__(self) -> Heartbeat:
        self._task = io_loop().submit(self._beat())
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _beat(self) -> None:
        while True:
            # Jitter spreads the refreshes of many ranks over the interval.
            await asyncio.sleep(HEARTBEAT_S * random.uniform(0.8, 1.0))
            try:
                await mark_in_flight(self.store, self.location, self.save_id)
            except StorageError as exc:
                log.warning("could not refresh the in-flight record of %s: %s", self.location, exc)
