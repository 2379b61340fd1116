"""The S3 transport: typed S3 operations on one asyncio event loop per process. No torch.

* :mod:`~s3ckpt.s3.loop`: the event loop thread, fork-safe, and the bounded fan-out of
  requests on it;
* :mod:`~s3ckpt.s3.client`: the aiobotocore client, created lazily once per loop;
* :mod:`~s3ckpt.s3.store`: :class:`ObjectStore`, one short method per S3 operation;
* :mod:`~s3ckpt.s3.requests`: one try of each operation and the retries around it;
* :mod:`~s3ckpt.s3.transport`: how a try travels, one typed method per operation, chosen
  once per client: through :mod:`~s3ckpt.s3.aiobotocore_transport`, or on the data plane
  (:mod:`~s3ckpt.s3.wire`);
* :mod:`~s3ckpt.s3.operations`: each operation's parameters as the client takes them,
  built once for both;
* :mod:`~s3ckpt.s3.ranged_read`: a ranged GET its reader pulls, failed tries resumed;
* :mod:`~s3ckpt.s3.get_attempt`: one attempt of a ranged GET through aiobotocore;
* :mod:`~s3ckpt.s3.retry`: what is retried, backoff, deadlines;
* :mod:`~s3ckpt.s3.error_mapping`: the one place S3 and HTTP errors become ``s3ckpt.errors``;
* :mod:`~s3ckpt.s3.wire`: the data plane, one transport for every upload body and every
  ranged-GET body, HTTP and HTTPS, sent from and received into tensor memory;
* :mod:`~s3ckpt.s3.compat_botocore`, :mod:`~s3ckpt.s3.compat_aiobotocore`: the one place
  each of those libraries' internals is touched.
"""
