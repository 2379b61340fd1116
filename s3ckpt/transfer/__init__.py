"""The transfer engine: a rank's bytes to objects and back, and the commit. No torch.

* :mod:`~s3ckpt.transfer.parts`: pure part arithmetic within S3's limits;
* :mod:`~s3ckpt.transfer.upload`: items packed into objects, parts as tasks, byte budget,
  abort and clean-up on failure;
* :mod:`~s3ckpt.transfer.download`: coalesced, block-aligned, parallel ranged GETs into
  destination buffers;
* :mod:`~s3ckpt.transfer.commit`: reading a committed manifest; committing one last;
* :mod:`~s3ckpt.transfer.inflight`: a save's in-flight record, for ``gc`` and ``prune``.
"""
