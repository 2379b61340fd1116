"""``make demo``: save and restore a model through s3ckpt against an embedded S3 server.

Starts a private SeaweedFS on 127.0.0.1, trains a small model for a few steps, saves its
model and optimizer state with ``dcp.async_save`` (training continues while the upload
runs), commits, loads the checkpoint into a fresh model, and checks every tensor.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointExistsError, S3StorageReader, S3StorageWriter, unwrap
from s3ckpt.config import S3URI, make_config
from s3ckpt.local_s3 import LocalS3Server
from s3ckpt.loop import io_loop
from s3ckpt.manifest import read_manifest
from s3ckpt.store import ObjectStore

MiB = 1024 * 1024


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(4096, 512),
        torch.nn.Linear(512, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 512),
        torch.nn.LayerNorm(512),
    )


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        tokens = torch.randint(0, 4096, (16, 32))
        loss = model(tokens).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 20}


def main() -> int:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    print("s3ckpt demo: starting an embedded S3 server (SeaweedFS) on 127.0.0.1 ...")
    with LocalS3Server() as server:
        options = {
            "endpoint_url": server.endpoint_url,
            "access_key_id": server.access_key,
            "secret_access_key": server.secret_key,
            "region": server.region,
        }
        uri = f"s3://{server.bucket}/demo-run/step-20"
        print(f"  endpoint {server.endpoint_url}, checkpoint {uri}")

        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = _train(model, optimizer, 20)
        state = _state(model, optimizer)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
        print(
            f"trained 20 steps (loss {loss:.4f}); state is about {nbytes / MiB:.0f} MiB (model + AdamW moments)"
        )

        started = time.perf_counter()
        future = dcp.async_save(state, storage_writer=S3StorageWriter(uri, **options))
        blocked = time.perf_counter() - started
        expected = {k: v.clone() for k, v in state["model"].items()}  # what the staged copy holds
        _train(model, optimizer, 3)  # training goes on while the upload runs
        future.result()
        total = time.perf_counter() - started
        print(f"async_save: caller blocked {blocked * 1000:.0f} ms, committed after {total:.2f} s")

        location = S3URI.parse(uri)
        manifest = io_loop().run(
            read_manifest(ObjectStore(make_config(None, **options), location.bucket), location)
        )
        print(
            f"committed: {len(manifest.items)} items in {len(manifest.objects)} data object(s), "
            f"{manifest.total_bytes / MiB:.1f} MiB, save id {manifest.save_id}"
        )

        fresh_model = _model()
        fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
        _train(fresh_model, fresh_optimizer, 1)
        restored = _state(fresh_model, fresh_optimizer)
        started = time.perf_counter()
        dcp.load(restored, storage_reader=S3StorageReader(uri, **options))
        print(
            f"load: {time.perf_counter() - started:.2f} s, every block verified against its CRC32C"
        )
        same = all(torch.equal(restored["model"][k], v) for k, v in expected.items())
        print(f"restored model matches the saved one bit for bit: {same}")

        try:
            dcp.save(state, storage_writer=S3StorageWriter(uri, **options))
        except BaseException as exc:  # DCP wraps storage errors
            error = unwrap(exc)
            if not isinstance(error, CheckpointExistsError):
                raise
            print(f"saving again to the same id is refused: {type(error).__name__}")
        print("stopping the server; done.")
        return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
