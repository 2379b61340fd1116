"""The saving side of ``test_crash.py``: a zygote that imports torch once and forks savers.

The test SIGKILLs a saving process twenty-odd times; a fresh interpreter per kill would
spend most of the run importing torch. The zygote imports everything, starts no thread
and no event loop (s3ckpt starts its loop lazily, per process), and forks one saver per
request, so a saver is ready in milliseconds.

stdin, from the test: ``<endpoint> <prefix> <first step> <mode>`` forks a saver.
stdout, to the test: ``pid <pid>``; the saver's ``part <key>`` (an UploadPart starts),
``committing <key>`` (mode ``commit``: it now sleeps instead of writing the manifest) and
``committed <step>``; then ``exited <pid>`` once the zygote has reaped it. Savers save
``step-0001``, ``step-0002``... from the first step on until killed. Credentials come from
the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import traceback
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt.dcp.writer import S3StorageWriter
from s3ckpt.s3.store import ObjectStore

MiB = 1024 * 1024
PART_SIZE = 5 * MiB
ELEMENTS = 10 * MiB // 4  # two float32 tensors of 10 MiB: a 20 MiB object, 4 parts


def state(step: int) -> dict[str, Any]:
    """The state saved as ``step``: every byte depends on the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "ramp": torch.arange(ELEMENTS, dtype=torch.float32) + step,
        "noise": torch.randn(ELEMENTS, generator=g),
        "meta": {"step": step},
    }


def blank() -> dict[str, Any]:
    return {"ramp": torch.zeros(ELEMENTS), "noise": torch.zeros(ELEMENTS), "meta": {"step": -1}}


def checkpoint_uri(prefix: str, step: int) -> str:
    return f"{prefix}/step-{step:04d}"


def _say(line: str) -> None:
    """One write(2) per line: lines of the zygote and its saver never interleave."""
    os.write(1, f"{line}\n".encode())


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies, so no saver outlives a failed test."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def _instrument(mode: str) -> None:
    """Announce every part; in ``commit`` mode, hold the manifest PUT forever."""
    upload_part, try_parts, put = ObjectStore.upload_part, ObjectStore.try_parts, ObjectStore.put

    async def announced_part(self: ObjectStore, key: str, *args: Any, **kwargs: Any) -> Any:
        _say(f"part {key}")
        return await upload_part(self, key, *args, **kwargs)

    async def announced_parts(self: ObjectStore, key: str, *args: Any, **kwargs: Any) -> Any:
        _say(f"part {key}")  # a batch of parts, tried at once
        return await try_parts(self, key, *args, **kwargs)

    async def held_put(self: ObjectStore, key: str, body: Any, **kwargs: Any) -> str:
        if key.endswith("/manifest.json"):
            _say(f"committing {key}")
            await asyncio.sleep(3600)
        return await put(self, key, body, **kwargs)

    ObjectStore.upload_part = announced_part  # type: ignore[method-assign]
    ObjectStore.try_parts = announced_parts  # type: ignore[method-assign]
    if mode == "commit":
        ObjectStore.put = held_put  # type: ignore[method-assign]


def _save_forever(endpoint: str, prefix: str, step: int, mode: str) -> None:
    _die_with_parent()
    _instrument(mode)
    while True:
        writer = S3StorageWriter(
            checkpoint_uri(prefix, step), endpoint_url=endpoint, part_size=PART_SIZE
        )
        dcp.save(state(step), storage_writer=writer)
        _say(f"committed {step}")
        step += 1


def main() -> None:
    _die_with_parent()
    while line := sys.stdin.readline():
        endpoint, prefix, first, mode = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                _save_forever(endpoint, prefix, int(first), mode)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        _say(f"pid {pid}")
        os.waitpid(pid, 0)
        _say(f"exited {pid}")


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main()
