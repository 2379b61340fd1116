"""The ``s3ckpt`` command, a thin layer over :mod:`s3ckpt.catalog`. No torch.

* :mod:`~s3ckpt.cli.main`: the parser, the entry point and exit statuses;
* :mod:`~s3ckpt.cli.commands`: one function per subcommand (ls, show, verify, prune, gc,
  rm, doctor);
* :mod:`~s3ckpt.cli.output`: what each subcommand prints, as text or ``--json``;
* :mod:`~s3ckpt.cli.humanize`: sizes, durations, times and tables for people;
* :mod:`~s3ckpt.cli.progress`: the progress bar (or log lines) on stderr.
"""
