"""A training script's CheckpointManager against a store that stops taking bytes, in a
fresh process (``test_stalled_store.py``): step 1 commits; the store then stops reading
(``tests/stalling_proxy.py``) and step 2's save fails, raised at the manager's next call;
the store takes bytes again, step 1 still loads, and step 3 commits and loads. Prints one
JSON report on stdout.

Usage: ``_stalled_manager_worker.py HOST PORT ACCESS_KEY SECRET_KEY REGION URI``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the proxy

import torch
from stalling_proxy import StallingProxy

from s3ckpt import CheckpointManager, StoreStalledError

MiB = 1024 * 1024
STALL_S = 2.0


def state(seed: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((MiB,), seed + i) for i in range(3)}  # 12 MiB


def matches(step: int | None, loaded: dict[str, torch.Tensor], seed: float) -> bool:
    return step is not None and all(torch.equal(loaded[k], v) for k, v in state(seed).items())


def main() -> None:
    host, port, access_key, secret_key, region, uri = sys.argv[1:7]
    report: dict[str, object] = {}
    with StallingProxy((host, int(port))) as proxy:
        manager = CheckpointManager(
            uri,
            endpoint_url=proxy.endpoint_url(),
            access_key_id=access_key,
            secret_access_key=secret_key,
            region=region,
            part_size=5 * MiB,
            stall_timeout_s=STALL_S,
            connect_timeout=1.0,
            async_mode="thread",
        )
        manager.save(1, state(1.0))
        manager.wait()

        proxy.resume(stall_after=2 * MiB)  # step 2's data: the store stops mid-part
        started = time.monotonic()
        manager.save(2, state(2.0))
        try:
            manager.wait()
            report["raised"] = None
        except Exception as exc:  # the failure, raised at the next call
            report["raised"] = type(exc).__name__
            report["stalled"] = isinstance(exc, StoreStalledError)
            report["message"] = str(exc)
        report["failed_after_s"] = time.monotonic() - started
        report["store_stopped"] = proxy.stalled

        proxy.resume()
        previous = {k: torch.zeros_like(v) for k, v in state(0.0).items()}
        step = manager.load_latest(previous)
        report["latest_after_failure"] = step
        report["previous_loads"] = step == 1 and matches(step, previous, 1.0)

        manager.save(3, state(3.0))
        manager.wait()
        again = {k: torch.zeros_like(v) for k, v in state(0.0).items()}
        step = manager.load_latest(again)
        report["latest_after_retry"] = step
        report["retry_loads"] = step == 3 and matches(step, again, 3.0)
        manager.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
