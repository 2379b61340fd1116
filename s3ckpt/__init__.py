"""s3ckpt: object-storage checkpoint engine for PyTorch Distributed Checkpoint."""
