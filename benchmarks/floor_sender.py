"""Unsigned PUTs through s3ckpt's native sender, for the ``loop`` benchmark's floors
(:mod:`benchmarks.loop_floors`), and the child process of its ``floor_process`` mode:
``python -m benchmarks.floor_sender PATH SIZE``.

The child maps the first ``SIZE`` bytes of the file at ``PATH`` (in /dev/shm: the state
the case copied there) once. For each save number read from stdin it sends those bytes as
16 MiB parts over four connections, then writes the number back (or ``error: ...``). It
imports no torch, so that it brings nothing into its process but the sending.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from s3ckpt.s3.wire import _sender
from s3ckpt.transfer.parts import DEFAULT_PART_SIZE as PART

SENDERS = 4  # connections (native threads) sending a save's parts


def put_head(path: str, length: int) -> bytes:
    """An unsigned PUT's head: the zero-cost server takes any request."""
    return f"PUT {path} HTTP/1.1\r\nHost: s3\r\nContent-Length: {length}\r\n\r\n".encode()


def send_parts(parts: Sequence[Any], prefix: str) -> None:
    """Every part as ``PUT {prefix}/{number}``, all of them in one call to the native
    sender (the GIL taken back once); raises on any answer but 200."""
    url = urlsplit(os.environ["AWS_ENDPOINT_URL"])
    requests = [(put_head(f"{prefix}/{n}", len(part)), part) for n, part in enumerate(parts)]
    for code, answer in _sender.exchange(
        url.hostname, url.port, requests, SENDERS, 10.0, 30.0, None
    ):
        if code or not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"PUT failed: {answer[:200]!r}")


def serve(path: str, size: int) -> None:
    """Send the mapped bytes once per save number on stdin, answering each on stdout."""
    prefix = f"/{os.environ['BENCH_BUCKET']}/{os.environ['BENCH_PREFIX']}/process"
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), size) as mapped:
        view = memoryview(mapped)
        for line in sys.stdin:
            number = int(line)
            parts = [view[start : start + PART] for start in range(0, size, PART)]
            try:
                send_parts(parts, f"{prefix}/{number}")
            except Exception as exc:  # the case fails with it instead of waiting forever
                print(f"error: {exc}", flush=True)
            else:
                print(number, flush=True)
            for part in parts:
                part.release()
        view.release()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
