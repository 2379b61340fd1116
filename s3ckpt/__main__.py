"""``python -m s3ckpt``: the same as the ``s3ckpt`` console script."""

from s3ckpt.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
