"""``s3ckpt doctor``: what a store supports, probed, and what s3ckpt will do on it.

Someone pointing s3ckpt at a new FlashBlade (or any S3 endpoint) wants one command that
says whether it will work before a training job finds out. Each check makes a few small
requests under a scratch prefix (``<prefix>/.s3ckpt-doctor-<hex>/``, removed at the end)
and gives one :class:`Check`: ``ok``, ``degraded`` (s3ckpt works, with a fallback) or
``failed`` (s3ckpt cannot work). Requests are not retried (a doctor reports what it sees)
and time out after ``read_timeout``. The throughput sample is small and bounded; it says
whether the path is sane, not what a real save reaches.

On a bucket with versioning on (``Enabled`` or ``Suspended``), the versioning check says
what that means for space (a delete keeps the bytes as a noncurrent version), whether a
delete by version id frees them (what ``prune``, ``gc`` and ``rm`` do with s3ckpt's own
versions), and whether a lifecycle rule expires noncurrent versions; the clean-up deletes
the scratch prefix's versions by id.

The first check names the endpoint exactly as requests will use it (the URL the S3
client resolved, from ``--endpoint-url``, the environment or the AWS config file) and
where it came from (:func:`endpoint_source`), then the transport: TLS and what verifies
it for ``https``, and for ``http`` that nothing is encrypted. An endpoint that answers
but not as S3 does fails it with :class:`~s3ckpt.errors.NotS3EndpointError`'s message.

One module per part: :mod:`~s3ckpt.catalog.doctor.probe` (the run, its scratch prefix and
clean-up, :func:`diagnose`), :mod:`~s3ckpt.catalog.doctor.endpoint` (endpoint, TLS,
credentials, bucket), :mod:`~s3ckpt.catalog.doctor.bucket_versioning`,
:mod:`~s3ckpt.catalog.doctor.features` (the store's features, one check each) and
:mod:`~s3ckpt.catalog.doctor.report` (:class:`Check`, :class:`Diagnosis`).
"""

from s3ckpt.catalog.doctor.bucket_versioning import LIFECYCLE_HINT
from s3ckpt.catalog.doctor.endpoint import endpoint_source
from s3ckpt.catalog.doctor.features import MiB
from s3ckpt.catalog.doctor.probe import diagnose
from s3ckpt.catalog.doctor.report import Check, Diagnosis, Status

__all__ = [
    "LIFECYCLE_HINT",
    "Check",
    "Diagnosis",
    "MiB",
    "Status",
    "diagnose",
    "endpoint_source",
]
