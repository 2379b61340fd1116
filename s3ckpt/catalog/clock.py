"""The store's clock: what every age the catalog measures is taken against.

``LastModified`` (objects, in-flight records) and ``Initiated`` (multipart uploads) are
stamped by the store's clock. Measured against this machine's clock, every age is wrong by
the difference between the two: a ``gc`` host whose clock runs ahead by more than the
in-flight lease would take a running save's record for a dead one, and one running behind
would keep what it should remove. So ``gc``, ``prune``, ``rm`` and ``ls --all`` ask the
store for its time: the ``Date`` header of one ``HeadBucket`` response
(:meth:`~s3ckpt.s3.store.ObjectStore.server_time`).

``Date`` counts whole seconds and is stamped while the request is served, so the time
read is at most a second and a round trip behind the store's: every age comes out that
much younger, which keeps things, never removes them. Only a store that sends no ``Date``
leaves the local clock (with a warning).
"""

from __future__ import annotations

import logging
import time

from s3ckpt.s3.store import ObjectStore

log = logging.getLogger(__name__)


async def store_time(store: ObjectStore) -> float:
    """The store's time now, in seconds since the epoch (see the module docstring)."""
    stamped = await store.server_time()
    if stamped is None:
        log.warning(
            "s3://%s: the store sent no Date header; ages are measured with this machine's clock",
            store.bucket,
        )
        return time.time()
    return stamped
