"""Races the other suites leave out: housekeeping interleaved with every step of a save, and
two writers on one id when the winner's commit response is lost.

``test_catalog.py`` runs prune and gc next to a save paused before its commit and
``test_commit.py`` races two writers on a reliable network; here prune and gc run to
completion before every single request of a save's uploads and commit, and the commit
race goes through the fault proxy.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy, Rule

from s3ckpt import CommitConflictError, S3StorageReader, S3StorageWriter, catalog, unwrap
from s3ckpt.config import make_config
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.s3.store import ObjectStore

MiB = 1024 * 1024


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((3 * MiB,), value), "meta": {"value": value}}  # 12 MiB: 3 parts


def _loads(uri: str, options: dict[str, Any], value: float) -> bool:
    restored = {"w": torch.zeros(3 * MiB), "meta": {"value": 0.0}}
    dcp.load(restored, storage_reader=S3StorageReader(uri, **options))
    return bool(torch.equal(restored["w"], torch.full((3 * MiB,), value)))


def test_prune_and_gc_before_every_request_of_a_save_never_break_it(
    s3_prefix, s3_options, monkeypatch
):
    config = make_config(None, **s3_options)
    for step in (1, 2):
        dcp.save(
            _state(step), storage_writer=S3StorageWriter(f"{s3_prefix}/step-{step}", config=config)
        )
    passes: list[str] = []
    housekeeping_request = contextvars.ContextVar("housekeeping_request", default=False)

    def housekeeping() -> None:  # on a thread of its own: it blocks on the I/O loop
        housekeeping_request.set(True)  # its own requests (prune's probe) go straight through
        catalog.prune(s3_prefix, keep_last=1, config=config)
        report = catalog.collect_garbage(s3_prefix, config=config)  # default grace
        assert report.garbage == [] and report.uploads == []
        passes.append("ok")

    for name in ("create_multipart", "upload_part", "complete_multipart", "put"):
        original = getattr(ObjectStore, name)

        async def interleaved(self, *args, _original=original, **kwargs):
            if not housekeeping_request.get():
                await asyncio.to_thread(housekeeping)
            return await _original(self, *args, **kwargs)

        monkeypatch.setattr(ObjectStore, name, interleaved)
    uri = f"{s3_prefix}/step-3"
    dcp.save(_state(3.0), storage_writer=S3StorageWriter(uri, part_size=5 * MiB, config=config))
    monkeypatch.undo()

    assert len(passes) >= 6  # create, 3 parts, complete, metadata, probe, manifest
    assert [c.name for c in catalog.list_checkpoints(s3_prefix, config=config)] == [
        "step-2",
        "step-3",
    ]
    assert _loads(uri, s3_options, 3.0)
    assert catalog.verify_checkpoint(uri, config=config).ok


def test_two_writers_on_one_id_with_the_winners_response_lost(
    local_s3, s3_prefix, s3_options, list_keys
):
    """The winner must not mistake its own landed manifest for a rival's; one error only."""
    with FaultProxy(local_s3.endpoint_url, seed=3) as proxy:
        proxy.add(Rule("reset_response", methods=("PUT",), match=MANIFEST_NAME, after=-1, limit=1))
        options = {**s3_options, "endpoint_url": proxy.endpoint_url, "conditional_commit": True}
        barrier = threading.Barrier(2)
        outcomes: dict[float, BaseException | None] = {}

        def save(value: float) -> None:
            writer = S3StorageWriter(s3_prefix, **options)
            commit = writer.finish

            def finish(metadata, results):
                barrier.wait(timeout=60)  # both have uploaded; both commit at once
                commit(metadata, results)

            writer.finish = finish  # type: ignore[method-assign]
            try:
                dcp.save(_state(value), storage_writer=writer)
                outcomes[value] = None
            except BaseException as exc:
                outcomes[value] = unwrap(exc)

        threads = [threading.Thread(target=save, args=(v,)) for v in (1.0, 2.0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert proxy.counts["reset_response"] == 1
    winners = [v for v, exc in outcomes.items() if exc is None]
    losers = [exc for exc in outcomes.values() if exc is not None]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert isinstance(losers[0], CommitConflictError) and "first" in str(losers[0])
    assert _loads(s3_prefix, s3_options, winners[0])

    config = make_config(None, **s3_options)  # the loser deleted its own objects
    manifest = catalog.show_checkpoint(s3_prefix, config=config)
    assert list_keys(s3_prefix) == sorted([*manifest.all_keys(), MANIFEST_NAME])
    assert _loads(s3_prefix, s3_options, winners[0])
