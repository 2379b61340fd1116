"""The heartbeat of an in-flight record: leaving its block waits until no refresh is left
running, so none can recreate the record that the commit deletes right after."""

from __future__ import annotations

import asyncio
import threading

import pytest

from s3ckpt.config import S3URI, S3Config
from s3ckpt.format.layout import saving_key
from s3ckpt.s3.loop import io_loop
from s3ckpt.transfer import inflight
from s3ckpt.transfer.inflight import Heartbeat, clear_in_flight

LOCATION = S3URI.parse("s3://bucket/run/step-1")
SAVE_ID = "00112233445566ff"
RECORD = LOCATION.key(saving_key(SAVE_ID))


class SlowStore:
    """A store whose PUTs are held until :attr:`release` is set. A held PUT is on the wire:
    the server applies it once released even if the client gave up on it meanwhile (the
    landing runs as a task of its own), which is what a refresh cancelled in flight does."""

    def __init__(self, read_timeout: float = 120.0) -> None:
        self.config = S3Config(read_timeout=read_timeout)
        self.bucket = LOCATION.bucket
        self.records: dict[str, bytes] = {}
        self.started, self.release = threading.Event(), threading.Event()
        self.landings: list[asyncio.Task[None]] = []
        self.abandoned = 0  # PUTs whose caller was cancelled

    async def _land(self, key: str, body: bytes) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.005)
        self.records[key] = body

    async def put(self, key: str, body: bytes, **_: object) -> str:
        landing = asyncio.get_running_loop().create_task(self._land(key, bytes(body)))
        self.landings.append(landing)
        self.started.set()
        try:
            await asyncio.shield(landing)
        except asyncio.CancelledError:
            self.abandoned += 1
            raise
        return '"etag"'

    async def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            self.records.pop(key, None)

    def settle(self) -> None:
        """Wait (on the loop) until every PUT the server received has landed."""

        async def landed() -> None:
            if self.landings:
                await asyncio.wait(self.landings)

        io_loop().run(landed())


@pytest.fixture
def fast_beat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inflight, "HEARTBEAT_S", 0.001)


def test_a_refresh_on_the_wire_lands_before_the_block_ends(fast_beat) -> None:
    store = SlowStore()
    beat = Heartbeat(store, LOCATION, SAVE_ID)  # type: ignore[arg-type]
    beat.__enter__()
    assert store.started.wait(30)
    releaser = threading.Timer(0.2, store.release.set)  # the server answers a little later
    releaser.start()
    beat.__exit__(None, None, None)
    assert RECORD in store.records and store.abandoned == 0  # finished, not abandoned
    io_loop().run(clear_in_flight(store, LOCATION, SAVE_ID))  # type: ignore[arg-type]
    releaser.join()
    store.settle()
    assert store.records == {}  # nothing landed after the clear
    assert len(store.landings) == 1  # and no refresh started after the block


def test_a_refresh_that_hangs_is_cancelled_before_the_block_ends(fast_beat) -> None:
    store = SlowStore(read_timeout=0.2)  # the bound on waiting for a refresh
    with Heartbeat(store, LOCATION, SAVE_ID):  # type: ignore[arg-type]
        assert store.started.wait(30)
    assert store.abandoned == 1  # the refresh was cancelled and its cancellation awaited
    io_loop().run(clear_in_flight(store, LOCATION, SAVE_ID))  # type: ignore[arg-type]
    assert store.records == {} and len(store.landings) == 1
    store.release.set()  # what the server does with the abandoned PUT is the store's
    store.settle()


def test_a_sleeping_heartbeat_stops_at_once() -> None:
    store = SlowStore()
    with Heartbeat(store, LOCATION, SAVE_ID):  # type: ignore[arg-type]
        pass  # HEARTBEAT_S (a minute) away from the first refresh
    assert store.landings == [] and not store.started.is_set()


def test_leaving_the_block_on_the_loop_thread_cannot_deadlock(fast_beat) -> None:
    store = SlowStore()
    store.release.set()

    async def on_the_loop() -> bool:
        beat = Heartbeat(store, LOCATION, SAVE_ID)  # type: ignore[arg-type]
        beat.__enter__()
        await asyncio.sleep(0)
        beat.__exit__(None, None, None)  # cancels without waiting: the loop is ours
        return beat._task is None

    assert io_loop().run(asyncio.wait_for(on_the_loop(), 30))
