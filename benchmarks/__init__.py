"""Benchmarks of s3ckpt against its peers and the raw ceilings (``make bench``)."""
