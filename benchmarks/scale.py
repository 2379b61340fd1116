"""Scale simulation: the commit and metadata path of DCP saves and loads at 8 to 4,096 ranks.

One process plays every rank through DCP's StorageWriter/StorageReader API: synthetic
per-rank save plans (every parameter sharded across all ranks, FSDP-style, tiny shards),
DCP's own global planning (``create_default_global_save_plan``), each simulated rank's
``write_data`` with real uploads of its data and index objects to the embedded SeaweedFS,
then the coordinator's ``finish`` (metadata, commit check, manifest) with real requests.
Loads replay two ranks' ``read_metadata``/``read_data`` (the coordinator, which GETs the
manifest and metadata, and another rank, which receives them by broadcast) with every
GET counted.

Format 1 (items listed in the manifest and pickled per item in DCP's metadata, as
s3ckpt 0.1 wrote them) is measured side by side on the same saves: its manifest and
metadata are built from the same records, uploaded, and read back the way a format-1
load reads them (every rank GETs both).

Measured per world size: commit record bytes (the manifest) per rank, DCP metadata
bytes, coordinator commit latency (``finish``) beyond pickling and uploading DCP's
metadata, and the coordinator's memory growth during it, whole-object GET bytes per rank before the first tensor byte, all GET
bytes of the load over the checkpoint's stored bytes, and PUT requests per key prefix.
Beyond what one machine simulates, a linear model of the measured bytes per item and
per rank extrapolates to 10,000 ranks and to the Llama3-70B anchor (1,856 ranks x 2,900
items). See ``docs/scale.md``.

    python -m benchmarks.scale [--runs 4x400,8,64,512,1024,4096] [--items 32]

A run is ``RANKS`` (with ``--items`` items per rank) or ``RANKSxITEMS``; ``4x400`` is a
4-rank save of 400 parameters sharded four ways (1,600 chunks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from s3ckpt import S3StorageReader, S3StorageWriter
from s3ckpt.dcp import metadata_pickle
from s3ckpt.format.layout import data_key, index_key
from s3ckpt.format.manifest import Manifest
from s3ckpt.s3.store import ObjectStore
from s3ckpt.testing.local_s3 import LocalS3Server
from s3ckpt.transfer.rank_index import with_items

SHARD = 4  # elements per shard (tiny tensors: the metadata path is what is measured)
ANCHORS = [(1856, 2900, "Llama3-70B on 1,856 H200s"), (10_000, 2900, "10,000 ranks")]
RESULTS = Path(__file__).parent / "results" / "scale.json"


# -- synthetic plans ---------------------------------------------------------------------------


def rank_plans(ranks: int, items: int) -> list[SavePlan]:
    """``items`` parameters, each sharded across all ranks (rank r holds shard r)."""
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([ranks * SHARD])
    return [
        SavePlan(
            [
                WriteItem(
                    index=MetadataIndex(f"model.layers.{i}.weight", torch.Size([r * SHARD])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size([r * SHARD]), torch.Size([SHARD])),
                        properties=props,
                        size=size,
                    ),
                )
                for i in range(items)
            ]
        )
        for r in range(ranks)
    ]


class _Planner:
    """The little of a SavePlanner/LoadPlanner that the storage layer calls."""

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return torch.full((SHARD,), float(item.index.offset[0]))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return torch.empty(SHARD)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        expected = float(read_item.storage_index.offset[0])
        if not torch.all(tensor == expected):
            raise AssertionError(f"{read_item.storage_index} read back wrong")

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise AssertionError("no byte items here")


def load_plan(ranks: int, items: int, rank: int) -> LoadPlan:
    """Rank ``rank`` loads the shards it saved (same world size, same sharding)."""
    reads = []
    for i in range(items):
        index = MetadataIndex(f"model.layers.{i}.weight", torch.Size([rank * SHARD]), rank)
        reads.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=index,
                dest_offsets=torch.Size([0]),
                storage_index=index,
                storage_offsets=torch.Size([0]),
                lengths=torch.Size([SHARD]),
            )
        )
    return LoadPlan(reads)


# -- counting ----------------------------------------------------------------------------------


class RssPeak:
    """Peak growth of this process's resident memory while the block runs (sampled every
    5 ms from /proc: unlike tracemalloc, it does not slow the code measured)."""

    def __init__(self) -> None:
        self.peak_growth = 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_growth = max(self.peak_growth, self._rss() - self._base)

    def __enter__(self) -> RssPeak:
        self._base = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_growth = max(self.peak_growth, self._rss() - self._base)


class Counted:
    """Counts GET bytes (whole objects and ranges) and PUT keys of this process."""

    def __init__(self) -> None:
        self.whole = 0
        self.ranged = 0
        self.puts: list[str] = []
        real_get, real_open, real_put = ObjectStore.get, ObjectStore.open_range, ObjectStore.put

        async def get(store: ObjectStore, key: str) -> bytes:
            body = await real_get(store, key)
            self.whole += len(body)
            return body

        @contextlib.asynccontextmanager
        async def open_range(store: ObjectStore, key: str, start: int, end: int) -> Any:
            async with real_open(store, key, start, end) as read:
                yield read
            self.ranged += end - start

        async def put(store: ObjectStore, key: str, body: Any, **kwargs: Any) -> str:
            self.puts.append(key)
            return await real_put(store, key, body, **kwargs)

        ObjectStore.get, ObjectStore.open_range, ObjectStore.put = get, open_range, put  # type: ignore[method-assign]

    def reset(self) -> None:
        self.whole = self.ranged = 0
        self.puts = []


# -- one world size ----------------------------------------------------------------------------


def simulate(server: LocalS3Server, counted: Counted, ranks: int, items: int) -> dict[str, Any]:
    options = {"endpoint_url": server.endpoint_url, **_credentials(server)}
    uri = f"s3://{server.bucket}/scale-{int(time.time())}/ranks-{ranks}"
    coordinator = S3StorageWriter(uri, **options)
    coordinator.set_up_storage_writer(True, rank=0)
    plans = rank_plans(ranks, items)
    coordinator.prepare_local_plan(plans[0])
    plans, metadata = create_default_global_save_plan(plans)
    plans = coordinator.prepare_global_plan(plans)

    counted.reset()
    started = time.perf_counter()
    results = []
    for rank, plan in enumerate(plans):  # every rank's write_data, one after the other
        writer = S3StorageWriter(uri, **options)
        writer.set_up_storage_writer(rank == 0, rank=rank)
        results.append(writer.write_data(plan, _Planner()).value())
    write_s = time.perf_counter() - started
    per_prefix = Counter(key.rsplit("/", 1)[0] for key in counted.puts)

    with RssPeak() as rss:
        started = time.perf_counter()
        coordinator.finish(metadata, results)
        finish_s = time.perf_counter() - started
    finish_peak = rss.peak_growth

    store = ObjectStore(coordinator.config, server.bucket)
    location = coordinator.location
    assert location is not None
    manifest = Manifest.from_json(_get(store, location.key("manifest.json")), uri)
    metadata_body = _get(store, location.key(manifest.metadata_key))
    started = time.perf_counter()  # what the commit spends on DCP's metadata: pickle and PUT
    _timed_put(store, location.key(".scale-metadata-upload"), metadata_pickle.dumps(metadata))
    metadata_put_s = time.perf_counter() - started

    v1 = _format_1(store, location, manifest, metadata_body)
    stored = manifest.total_bytes + len(manifest.to_json())
    loads = {rank: _load(uri, options, counted, ranks, items, rank) for rank in {0, ranks - 1}}
    data_per_rank = items * SHARD * 4
    # Every rank's whole-object GETs: the coordinator's, and the others' (all alike).
    v2_get_total = loads[0]["whole"] + (ranks - 1) * loads[ranks - 1]["whole"]
    v2_get_total += ranks * data_per_rank
    v1_get_total = ranks * (v1["manifest_bytes"] + v1["metadata_bytes"] + data_per_rank)
    data = sum(o.size for o in manifest.objects)
    v1_stored = data + v1["manifest_bytes"] + v1["metadata_bytes"]
    return {
        "ranks": ranks,
        "items_per_rank": items,
        "write_data_s_all_ranks": round(write_s, 2),
        "format2": {
            "manifest_bytes": len(manifest.to_json()),
            "manifest_bytes_per_rank": round(len(manifest.to_json()) / ranks, 1),
            "metadata_bytes": len(metadata_body),
            "index_bytes_per_rank": round(sum(i.size for i in manifest.indexes) / ranks, 1),
            "commit_s": round(finish_s, 3),
            "metadata_upload_s": round(metadata_put_s, 3),
            "commit_beyond_metadata_s": round(finish_s - metadata_put_s, 3),
            "commit_rss_growth_mib": round(finish_peak / 2**20, 1),
            "coordinator_get_bytes_before_data": loads[0]["whole"],
            "other_rank_get_bytes_before_data": loads[ranks - 1]["whole"],
            "load_get_bytes_over_stored": round(v2_get_total / stored, 3),
        },
        "format1": {
            "manifest_bytes": v1["manifest_bytes"],
            "manifest_bytes_per_rank": round(v1["manifest_bytes"] / ranks, 1),
            "metadata_bytes": v1["metadata_bytes"],
            "commit_build_and_upload_s": round(v1["commit_s"], 3),
            "every_rank_get_bytes_before_data": v1["manifest_bytes"] + v1["metadata_bytes"],
            "load_get_bytes_over_stored": round(v1_get_total / v1_stored, 3),
        },
        "puts_per_prefix_max": max(per_prefix.values()),
        "puts_per_prefix_spread_4096": _spread_max(ranks, 4096),
    }


def _credentials(server: LocalS3Server) -> dict[str, str]:
    return {
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "region": server.region,
    }


def _get(store: ObjectStore, key: str) -> bytes:
    from s3ckpt.s3.loop import io_loop

    return io_loop().run(store.get(key))


def _timed_put(store: ObjectStore, key: str, body: bytes) -> float:
    from s3ckpt.s3.loop import io_loop

    started = time.perf_counter()
    io_loop().run(store.put(key, body))
    return time.perf_counter() - started


def _format_1(store: ObjectStore, location: Any, manifest: Manifest, metadata_body: bytes) -> dict:
    """Build, upload and size format 1's manifest and metadata from the same records."""
    from s3ckpt.s3.loop import io_loop

    started = time.perf_counter()
    full = io_loop().run(with_items(store, location, manifest))
    legacy = dataclasses.replace(full, version=1, indexes=())
    manifest_body = legacy.to_json()
    metadata = metadata_pickle.loads(metadata_body, "scale")
    metadata.storage_data = {
        MetadataIndex(item.fqn, torch.Size(item.chunk_offsets)): item.stored for item in full.items
    }
    body = metadata_pickle.dumps(metadata)
    io_loop().run(store.put(location.key(".scale-v1-metadata"), body))
    io_loop().run(store.put(location.key(".scale-v1-manifest"), manifest_body))
    return {
        "manifest_bytes": len(manifest_body),
        "metadata_bytes": len(body),
        "commit_s": time.perf_counter() - started,
    }


def _load(
    uri: str, options: dict[str, Any], counted: Counted, ranks: int, items: int, rank: int
) -> dict[str, int]:
    """One rank's load: the coordinator reads manifest and metadata; another rank gets them
    as a broadcast would hand them over (no GET) and reads only its index objects."""
    reader = S3StorageReader(uri, **options)
    if rank == 0:
        counted.reset()
        metadata = reader.read_metadata()
    else:
        source = S3StorageReader(uri, **options)
        source.read_metadata()
        assert source.manifest is not None
        store = ObjectStore(source.config, source.location.bucket)  # type: ignore[union-attr]
        body = _get(store, source.location.key(source.manifest.metadata_key))  # type: ignore[union-attr]
        counted.reset()
        metadata = reader._adopt(reader._require_location(), source.manifest, body)
    reader.set_up_storage_reader(metadata, rank == 0)
    before = counted.whole
    reader.read_data(load_plan(ranks, items, rank), _Planner()).wait()  # type: ignore[arg-type]
    return {"whole": counted.whole, "index": counted.whole - before, "data": counted.ranged}


def _spread_max(ranks: int, spread: int) -> int:
    keys = [data_key(r, "0" * 16, 0, spread) for r in range(ranks)]
    keys += [index_key(r, "0" * 16, spread) for r in range(ranks)]
    return max(Counter(k.rsplit("/", 1)[0] for k in keys).values())


# -- the model beyond one machine ----------------------------------------------------------------


def model(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Extrapolate from the largest run: bytes per item x rank (format 1, and DCP metadata)
    and per rank (format 2's manifest and index objects)."""
    big = max(rows, key=lambda r: r["ranks"] * r["items_per_rank"])
    n = big["ranks"] * big["items_per_rank"]
    v1_manifest_item = big["format1"]["manifest_bytes"] / n
    v1_metadata_item = big["format1"]["metadata_bytes"] / n
    v2_metadata_item = big["format2"]["metadata_bytes"] / n
    v2_manifest_rank = big["format2"]["manifest_bytes_per_rank"]
    v2_index_item = big["format2"]["index_bytes_per_rank"] / big["items_per_rank"]
    out = []
    for ranks, items, label in ANCHORS:
        total = ranks * items
        v1 = total * (v1_manifest_item + v1_metadata_item)
        v2_manifest = ranks * v2_manifest_rank
        v2_meta = total * v2_metadata_item
        out.append(
            {
                "label": label,
                "ranks": ranks,
                "items_per_rank": items,
                "format1_manifest_gb": round(total * v1_manifest_item / 1e9, 2),
                "format1_every_rank_reads_gb": round(v1 / 1e9, 2),
                "format1_load_reads_tb": round(v1 * ranks / 1e12, 2),
                "format2_manifest_mb": round(v2_manifest / 1e6, 2),
                "format2_manifest_bytes_per_rank": v2_manifest_rank,
                "format2_metadata_gb_read_once": round(v2_meta / 1e9, 2),
                "format2_index_mb_per_rank": round(items * v2_index_item / 1e6, 2),
                "format2_load_reads_gb": round(
                    (v2_manifest + v2_meta + total * v2_index_item) / 1e9, 2
                ),
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> Iterator[str]:
    yield (
        "| ranks | items/rank | manifest B/rank (f1 -> f2) | metadata (f1 -> f2) | "
        "commit s (f2, beyond metadata) | commit RSS growth MiB | GET before data, other rank "
        "(f1 -> f2) | load GET / stored (f1 -> f2) | PUTs/prefix (spread 4096) |"
    )
    yield "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for r in rows:
        f1, f2 = r["format1"], r["format2"]
        yield (
            f"| {r['ranks']} | {r['items_per_rank']} | {f1['manifest_bytes_per_rank']:,.0f} -> "
            f"{f2['manifest_bytes_per_rank']:,.0f} | {_kib(f1['metadata_bytes'])} -> "
            f"{_kib(f2['metadata_bytes'])} | {f2['commit_s']} ({f2['commit_beyond_metadata_s']}) | "
            f"{f2['commit_rss_growth_mib']} | {_kib(f1['every_rank_get_bytes_before_data'])} -> "
            f"{_kib(f2['other_rank_get_bytes_before_data'])} | "
            f"{f1['load_get_bytes_over_stored']} -> {f2['load_get_bytes_over_stored']} | "
            f"{r['puts_per_prefix_max']} ({r['puts_per_prefix_spread_4096']}) |"
        )


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="4x400,8,64,512,1024,4096")
    parser.add_argument("--items", type=int, default=32, help="items (shards) per rank")
    args = parser.parse_args()
    runs = [
        (int(r), int(i)) if "x" in run else (int(run), args.items)
        for run in args.runs.split(",")
        for r, _, i in [run.partition("x")]
    ]
    rows = []
    with LocalS3Server() as server:
        counted = Counted()
        for ranks, items in runs:
            print(f"simulating {ranks} ranks x {items} items ...", flush=True)
            rows.append(simulate(server, counted, ranks, items))
            print("\n".join(list(table(rows))[-1:]), flush=True)
    modelled = model(rows)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"runs": rows, "model": modelled}, indent=2))
    print("\n".join(table(rows)))
    print(json.dumps(modelled, indent=2))


if __name__ == "__main__":
    main()
