"""Codec measurements on real weights: ratio and single-core speed, plain zstd vs grouped.

    python -m benchmarks.compression [--level 1]

Reports, for MiniLM-L6's weights in fp32 and bf16: the stored/raw ratio of plain zstd and
of s3ckpt's byte-grouped encoding at the same level, and compression and decompression
throughput per core (thread CPU time, so the numbers do not depend on other load). Both
include the block CRC32Cs, which a save computes and a load checks in the same passes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import zstandard

from benchmarks.weights import load_minilm
from s3ckpt.dcp.tensor_bytes import tensor_view
from s3ckpt.format.compression import Compression, decode_block, encode
from s3ckpt.format.layout import DEFAULT_BLOCK_SIZE


def measure(tensors: list[torch.Tensor], level: int, grouped: bool) -> dict[str, Any]:
    options = Compression(level=level, min_saving=0.0)
    views = [tensor_view(t) for t in tensors]
    raw = sum(len(v) for v in views)
    started = time.thread_time()
    encoded = [
        encode(v, t.element_size() if grouped else 0, options)
        for v, t in zip(views, tensors, strict=True)
    ]
    compress_s = time.thread_time() - started
    stored = sum(len(e.payload) for e in encoded)
    started = time.thread_time()
    for e, v in zip(encoded, views, strict=True):
        _decode(e, len(v))
    decompress_s = time.thread_time() - started
    return {
        "ratio": stored / raw,
        "compress_mb_s_per_core": raw / compress_s / 1e6,
        "decompress_mb_s_per_core": raw / decompress_s / 1e6,
    }


def _decode(encoded: Any, raw_length: int) -> None:
    if encoded.codec == "raw":
        return
    out = memoryview(bytearray(raw_length))
    position = 0
    for n, size in enumerate(encoded.frames):
        start = n * DEFAULT_BLOCK_SIZE
        decode_block(
            encoded.payload[position : position + size],
            encoded.codec,
            out[start : start + DEFAULT_BLOCK_SIZE],
        )
        position += size


def report(level: int = 1) -> dict[str, Any]:
    weights = load_minilm()
    results: dict[str, Any] = {"zstd_version": zstandard.__version__, "level": level}
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [t.to(dtype).contiguous() for t in weights.values()]
        name = str(dtype).removeprefix("torch.")
        results[name] = {
            "plain": measure(tensors, level, False),
            "grouped": measure(tensors, level, True),
        }
    return results


def table(results: dict[str, Any]) -> str:
    lines = [f"codec on MiniLM-L6 weights, zstd level {results['level']}:",
             f"  {'':18} {'ratio':>7} {'compress MB/s/core':>19} {'decompress MB/s/core':>21}"]  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        for mode in ("plain", "grouped"):
            r = results[dtype][mode]
            lines.append(
                f"  {dtype + ' ' + mode:18} {r['ratio']:7.3f} {r['compress_mb_s_per_core']:19.0f} {r['decompress_mb_s_per_core']:21.0f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--level", type=int, default=1)
    print(table(report(parser.parse_args().level)))
