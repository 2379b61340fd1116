"""A save's transient records are built with automatic garbage collection paused: no
collection runs while they are alive, collection comes back as it was, and threads that
build at once share one pause."""

from __future__ import annotations

import gc
import threading

import torch

from s3ckpt.dcp import metadata_pickle
from s3ckpt.dcp.compat import Metadata
from s3ckpt.format.layout import StoredItem
from s3ckpt.format.manifest import ItemEntry
from s3ckpt.format.rank_index import RankIndex
from s3ckpt.transfer.collector import collector_paused
from s3ckpt.transfer.rank_index import index_body


def _collections() -> int:
    return sum(generation["collections"] for generation in gc.get_stats())


def _entry(n: int) -> ItemEntry:
    stored = StoredItem(key="data/r0-0", offset=n * 16384, length=16384, crc32c=(n,))
    return ItemEntry(f"layer.{n}.weight", (0, 0), "tensor", "float32", (64, 64), stored)


def _index(items: int) -> RankIndex:
    return RankIndex("save", 0, tuple(_entry(n) for n in range(items)))


def test_no_collection_runs_while_an_index_of_thousands_of_items_is_encoded():
    index = _index(5000)  # about 15,000 dicts and lists in its JSON body: 20 young collections
    gc.collect()  # no young collection left due on the way into the block, whatever ran before
    before = _collections()
    encoded = index_body(index)
    assert _collections() == before
    assert RankIndex.from_json(encoded, "index", {}).items == index.items
    assert gc.isenabled()


def test_checking_and_pickling_metadata_runs_no_collection():
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state = {
        f"w{n}": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([4, 4]),
            [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))],
        )
        for n in range(3000)
    }
    storage = {
        MetadataIndex(f"w{n}", torch.Size([0, 0])): StoredItem("data/r0-0", n * 64, 64, (n,))
        for n in range(3000)
    }
    metadata = Metadata(state_dict_metadata=state, storage_data=storage)
    # Pickling an object the first time gives it a real ``__dict__`` it keeps (Python
    # 3.11's lazy instance dicts): once per object, as a reused plan's metadata has.
    metadata_pickle.dumps(metadata)
    before = _collections()
    body = metadata_pickle.dumps(metadata)
    metadata_pickle.check_loadable(body, "s3://bucket/prefix")
    assert _collections() == before
    assert gc.isenabled()


def test_collection_resumes_only_if_it_was_on_and_after_the_last_builder():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def builder() -> None:
        with collector_paused():
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=builder)
    other.start()
    inside.wait(10)
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread still builds
    leave.set()
    other.join(10)
    assert gc.isenabled()


def test_an_error_while_building_resumes_collection():
    try:
        with collector_paused():
            raise ValueError("bad item")
    except ValueError:
        pass
    assert gc.isenabled()
