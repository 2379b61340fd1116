"""The data plane: every request body and every ranged-GET body, through one transport
(:class:`DataPlane`, a :class:`~s3ckpt.s3.transport.Transport`).

Part uploads and the whole-object PUTs of :class:`~s3ckpt.s3.store.ObjectStore`
(:mod:`~.uploads`) and the other requests of a save (its HEADs, create and complete of its
multipart uploads, its listings, its batch deletes: :class:`~.data_plane.SignedCalls`) are built and signed
here, at the URLs the client would use (:mod:`~.addresses`), and
answered as the client answers them; aiobotocore keeps the rest (aborts, copies, small
GETs, listings of multipart uploads and of versions, single deletes, the bucket's
settings), chosen by the method of the transport seam called.
The bytes of checkpoints,
upload bodies (``UploadPart``, ``PutObject``) and ranged GETs, plain HTTP and HTTPS, go
through this package alone: one connection pool per client (:mod:`~.pool`: keep-alive,
stale connections, stalls, cancellation, TLS as aiobotocore verifies it), one response
parser (h11, :mod:`~.exchange`), bodies sent from the tensor's memory (:mod:`~.uploads`;
:mod:`~.on_loop`) and received straight into it as its reader pulls them
(:mod:`~.get_exchange`, :mod:`~.range_body`).

Where each exchange runs, chosen for the least client CPU per GiB
(docs/decisions/0004-tls-path.md):

* **on the event loop**, everything but one case: ranged GETs, their responses read by a
  reader callback that receives the body into the tensor (plain TCP), or decrypts it
  into the tensor from ciphertext taken off the socket 256 KiB at a time (TLS on memory
  BIOs); and plain-HTTP upload bodies, sent by non-blocking ``send`` calls of the body's
  memory. In worker threads every call that releases the GIL has to take it back against
  the loop and the other requests' threads;
* **in worker threads**: upload bodies over TLS, on blocking ``SSLSocket`` connections,
  whose ``sendall`` encrypts the body straight from the tensor into the kernel's socket
  buffer with the GIL released;
* **in native threads**: plain-HTTP part uploads, handed over a batch at a time
  (:mod:`~.batch`): signed on the loop, sent and answered by C threads that take the GIL
  back once per batch, not several times per part, which is what a training loop beside
  a thread-mode save pays for (docs/decisions/0003-native-sender.md).

Endpoints reached through an HTTP proxy are left to aiobotocore entirely, and so are
responses the transport cannot receive in place (chunked, redirects).
"""

from s3ckpt.s3.wire.data_plane import DataPlane
from s3ckpt.s3.wire.get_exchange import UnsupportedResponse, warn_range_ignored
from s3ckpt.s3.wire.range_body import RangeBody
from s3ckpt.s3.wire.tls import proxied, tls_context

__all__ = [
    "DataPlane",
    "RangeBody",
    "UnsupportedResponse",
    "proxied",
    "tls_context",
    "warn_range_ignored",
]
