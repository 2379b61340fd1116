"""The transfer engine: a rank's bytes to objects and back, and the commit. No torch.

* :mod:`~s3ckpt.transfer.parts`: pure part arithmetic within S3's limits;
* :mod:`~s3ckpt.transfer.upload`: items packed into objects, parts as tasks, byte budget,
  clean-up on failure;
* :mod:`~s3ckpt.transfer.object_stream`: one object cut into parts as its items arrive;
* :mod:`~s3ckpt.transfer.aborts`: aborting the multipart uploads a failed save left open;
* :mod:`~s3ckpt.transfer.download`: coalesced, block-aligned, parallel ranged GETs into
  destination buffers;
* :mod:`~s3ckpt.transfer.commit`: reading a committed manifest; committing one last;
* :mod:`~s3ckpt.transfer.inflight`: a save's in-flight record, for ``gc`` and ``prune``.
"""
