"""The transfer engine: a rank's bytes to objects and back, and the commit. No torch.

* :mod:`~s3ckpt.transfer.parts`: part arithmetic within S3's limits; one object cut into
  the requests that store it as its items arrive;
* :mod:`~s3ckpt.transfer.upload`: the coordinator of a rank's upload: items packed into
  objects, their requests as tasks, byte budget, clean-ups registered by each task;
* :mod:`~s3ckpt.transfer.thread_mode`: thread mode's GIL tuning behind one switch;
* :mod:`~s3ckpt.transfer.aborts`: aborting the multipart uploads a failed save left open;
* :mod:`~s3ckpt.transfer.download`: coalesced, block-aligned, parallel ranged GETs into
  destination buffers;
* :mod:`~s3ckpt.transfer.commit`: reading a committed manifest; committing one last;
* :mod:`~s3ckpt.transfer.inflight`: a save's in-flight record, for ``gc`` and ``prune``.
"""
