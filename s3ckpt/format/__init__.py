"""The on-store format: what is written where, and how it is checked. No torch, no I/O.

* :mod:`~s3ckpt.format.layout`: object keys and :class:`StoredItem`, one item's storage record;
* :mod:`~s3ckpt.format.manifest`: the manifest's schema (the commit record);
* :mod:`~s3ckpt.format.checksums`: block CRC32Cs: computing, combining, checking;
* :mod:`~s3ckpt.format.compression`: optional zstd per checksum block, byte-grouped floats;
* :mod:`~s3ckpt.format.byteplanes` (and ``_byteplanes.c``): byte grouping itself.

``docs/format.md`` describes the layout and the manifest schema.
"""
