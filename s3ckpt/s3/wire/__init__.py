"""The data plane: every request body and every ranged-GET body, through one transport.

aiobotocore keeps signing and every control request (create, complete and abort of
multipart uploads, listings, HEADs, deletes, small GETs). The bytes of checkpoints,
upload bodies (``UploadPart``, ``PutObject``) and ranged GETs, plain HTTP and HTTPS, go
through this package alone: one connection pool per client (:mod:`~.pool`: keep-alive,
stale connections, timeouts, cancellation, TLS), one response parser
(:mod:`~.exchange`, h11 for heads and small bodies), bodies sent from the tensor's
memory (:mod:`~.uploads`, answering botocore's ``before-send``) and received straight
into it (:mod:`~.range_body`, :mod:`~.ranged_get`).

Why blocking sockets in worker threads, measured on this kind of machine (2 cores, the
zero-cost S3 server of ``benchmarks/``, 16 concurrent requests, client CPU per GiB):

* plain-HTTP upload bodies: ``sendall`` of the part's memory 0.36-0.45 CPU-s/GiB, against
  0.72-1.03 for aiohttp with the zero-copy body it replaced (uvloop's transport);
* ranged GETs: ``recv_into`` with ``MSG_WAITALL`` of 1 MiB into the tensor 0.37, against
  0.46-0.50 for an ``asyncio.BufferedProtocol`` on the event loop;
* TLS: ``SSLSocket.sendall`` encrypts from the tensor's memory straight into the
  kernel, and ``recv_into`` decrypts straight into the tensor, both with the GIL
  released: GETs 0.86 (0.95 with a socket timeout, which polls before every record)
  against 0.78-0.93 on asyncio's TLS transport, which copies through memory BIOs;
* the loop thread runs no per-byte Python, so a CPU-bound training loop beside a
  background save competes for the GIL only at call boundaries.

Endpoints reached through an HTTP proxy are left to aiobotocore entirely.
"""

from s3ckpt.s3.wire.data_plane import DataPlane
from s3ckpt.s3.wire.range_body import UnsupportedResponse, warn_range_ignored
from s3ckpt.s3.wire.sink import RangeSink, copy_into
from s3ckpt.s3.wire.tls import proxied, tls_context

__all__ = [
    "DataPlane",
    "RangeSink",
    "UnsupportedResponse",
    "copy_into",
    "proxied",
    "tls_context",
    "warn_range_ignored",
]
