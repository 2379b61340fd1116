"""How long ``gc`` waits before it removes what nothing references (no I/O, imports nothing).

The grace period protects what the listing cannot tell apart from garbage: the objects of
a checkpoint that an overwrite replaced while loads may still be reading them, and saves
written by releases that kept no in-flight record. Saves in flight are protected by their
in-flight records whatever the grace (:mod:`s3ckpt.transfer.inflight`). Kept apart from
:mod:`s3ckpt.catalog.gc` so that the CLI can state the limits without importing the
S3 stack.
"""

DEFAULT_GRACE = 3600.0
MIN_SAFE_GRACE = 900.0  # the CLI refuses less unless forced
