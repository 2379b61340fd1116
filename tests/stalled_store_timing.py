"""How long a save takes to fail on a store that stopped taking bytes, with the engine's
defaults: ``python tests/stalled_store_timing.py`` (``S3Config.stall_timeout_s`` at its
default) or ``python tests/stalled_store_timing.py --no-stall-limit`` (no stall limit: a
stalled request is retried until ``deadline_s``, 900 s by default). SeaweedFS behind
``tests/stalling_proxy.py``, which stops reading after 2 MiB of request bytes (the save's
first part); a 48 MiB state, 8 MiB parts. Prints one JSON line: the seconds from
``dcp.save`` to its error, the error's class and its first 300 characters. The figures
of docs/reliability.md ("A store that stops taking bytes") come from it.
"""

from __future__ import annotations

import argparse
import json
import time
from urllib.parse import urlsplit

import torch
import torch.distributed.checkpoint as dcp
from stalling_proxy import StallingProxy

from s3ckpt import S3Config, S3StorageWriter, unwrap
from s3ckpt.testing.local_s3 import LocalS3Server

MiB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-stall-limit", action="store_true")
    args = parser.parse_args()
    # A keyword of None means "not given": no limit is asked for in an S3Config.
    config = S3Config(stall_timeout_s=None) if args.no_stall_limit else S3Config()
    state = {f"t{i}": torch.full((4 * MiB,), float(i)) for i in range(3)}
    with LocalS3Server() as server:
        url = urlsplit(server.endpoint_url)
        with StallingProxy((url.hostname or "127.0.0.1", url.port or 80)) as proxy:
            proxy.resume(stall_after=2 * MiB)
            writer = S3StorageWriter(
                f"s3://{server.bucket}/stalled",
                endpoint_url=proxy.endpoint_url(),
                access_key_id=server.access_key,
                secret_access_key=server.secret_key,
                region=server.region,
                part_size=8 * MiB,
                config=config,
            )
            started = time.monotonic()
            try:
                dcp.save(state, storage_writer=writer)
                error: BaseException | None = None
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                error = unwrap(exc)
            took = time.monotonic() - started
    print(
        json.dumps(
            {
                "stall_timeout_s": None if args.no_stall_limit else 60.0,
                "failed_after_s": round(took, 1),
                "error": type(error).__name__ if error else None,
                "message": str(error)[:300] if error else "",
            }
        )
    )


if __name__ == "__main__":
    main()
