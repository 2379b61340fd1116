"""Tools for trying s3ckpt out and testing it: the embedded S3 server, and simulated
clusters of nodes in network namespaces behind shaped links (:mod:`~s3ckpt.testing.cluster`).

Nothing in the engine imports this package; the CLI's ``local-s3`` command, the demo, the
tests and the benchmarks do.
"""
