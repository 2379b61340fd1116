"""The DCP adapters: ``torch.distributed.checkpoint``'s storage API on top of the engine.

The only part of s3ckpt that knows DCP's planner and metadata types:

* :mod:`~s3ckpt.dcp.writer`: :class:`S3StorageWriter` (the lifecycle of a save);
* :mod:`~s3ckpt.dcp.save_commit`: the commit of a save (the writer's ``finish``);
* :mod:`~s3ckpt.dcp.reader`: :class:`S3StorageReader` (the lifecycle of a load);
* :mod:`~s3ckpt.dcp.restore`: per read item, which bytes, where they land, decoding and
  verifying, handing the result to the planner;
* :mod:`~s3ckpt.dcp.tensor_bytes`: zero-copy tensor bytes in and out;
* :mod:`~s3ckpt.dcp.metadata_pickle`: DCP's metadata to bytes and back, restricted unpickler;
* :mod:`~s3ckpt.dcp.location`: the ``checkpoint_id`` handling both adapters share;
* :mod:`~s3ckpt.dcp.compat`: every torch name beyond DCP's public storage API, in one place.

Importing this package does not import torch; its modules do.
"""
