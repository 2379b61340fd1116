"""``make demo`` (``python -m s3ckpt.demo``): a real training run that crashes mid-checkpoint.

``__main__`` orchestrates (local S3 server, SIGKILL, restart, summary, CLI); ``train`` is
the training process and the example of :class:`s3ckpt.CheckpointManager` in a loop;
``model`` and ``corpus`` are the small GPT and the generated text it learns;
``report`` turns the runs' JSON lines into the summary.
"""
