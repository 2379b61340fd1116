"""The claim protocol (commits on stores without conditional writes), under every schedule.

Writers run as tasks against an in-memory store whose every request takes effect at one
instant (S3's strong read-after-write and list-after-write consistency) but at a moment
chosen by a seeded random scheduler, so thousands of seeds cover the interleavings of
claim, list, check, manifest write and release. Whatever the schedule: never two
winners, a winner's manifest is the one stored, losers get CommitConflictError, and no
claim is left behind. A deliberately broken variant of the protocol fails the same check,
which shows the schedules are adversarial enough to matter.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from s3ckpt.config import S3URI
from s3ckpt.errors import CommitConflictError
from s3ckpt.format.layout import claim_key
from s3ckpt.format.manifest import MANIFEST_NAME
from s3ckpt.s3.store import ObjectMeta
from s3ckpt.transfer import commit

LOCATION = S3URI("bucket", "run/step-1")


class ScheduledStore:
    """Linearizable objects in a dict; each request waits a random number of scheduler
    turns before and after the instant it takes effect."""

    bucket = "bucket"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.objects: dict[str, bytes] = {}
        self.puts: list[str] = []

    async def _turns(self) -> None:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)

    async def _atomic(self, action: Callable[[], object]) -> object:
        await self._turns()
        result = action()
        await self._turns()
        return result

    async def put(self, key: str, body: bytes, **_: object) -> None:
        def write() -> None:
            self.objects[key] = body
            self.puts.append(key)

        await self._atomic(write)

    async def exists(self, key: str) -> bool:
        return bool(await self._atomic(lambda: key in self.objects))

    async def delete_many(self, keys: list[str]) -> None:
        await self._atomic(lambda: [self.objects.pop(k, None) for k in keys])

    async def list(self, prefix: str) -> AsyncIterator[ObjectMeta]:
        snapshot = await self._atomic(
            lambda: [ObjectMeta(k, len(v), "") for k, v in sorted(self.objects.items())]
        )
        for meta in snapshot:  # type: ignore[attr-defined]
            if meta.key.startswith(prefix):
                yield meta


Protocol = Callable[[ScheduledStore, S3URI, str, bytes], Awaitable[list[str]]]


def _race(seed: int, writers: int) -> tuple[list[str], ScheduledStore]:
    """Run ``writers`` commits of one id concurrently; the save ids that won."""
    store = ScheduledStore(random.Random(seed))
    winners: list[str] = []

    async def writer(save_id: str) -> None:
        try:
            await commit._commit_with_claim(store, LOCATION, save_id, save_id.encode())  # type: ignore[arg-type]
            winners.append(save_id)
        except CommitConflictError:
            pass

    async def main() -> None:
        await asyncio.gather(*(writer(f"{n:04x}") for n in range(writers)))

    asyncio.run(main())
    return winners, store


@pytest.fixture(autouse=True)
def _quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit, "CLAIM_BACKOFF_S", 0.0005)


@pytest.mark.parametrize("writers", [2, 3, 5])
def test_never_two_winners_and_no_claim_left(writers: int) -> None:
    seeds = range(400 if writers < 5 else 150)
    outcomes = [_race(seed, writers) for seed in seeds]
    for seed, (winners, store) in zip(seeds, outcomes, strict=True):
        assert len(winners) <= 1, (seed, winners)
        claims = [k for k in store.objects if ".s3ckpt-claim-" in k]
        assert claims == [], (seed, claims)
        manifest = store.objects.get(LOCATION.key(MANIFEST_NAME))
        assert manifest == (winners[0].encode() if winners else None), seed
        assert store.puts.count(LOCATION.key(MANIFEST_NAME)) == len(winners), seed
    # Backing off resolves contention: the races that end without a winner are rare.
    no_winner = sum(not winners for winners, _ in outcomes)
    assert no_winner <= len(outcomes) // 50, no_winner


def test_a_late_writer_finds_the_commit_and_loses() -> None:
    winners, store = _race(seed=1, writers=1)
    assert winners == ["0000"]

    async def late() -> None:
        await commit._commit_with_claim(store, LOCATION, "beef", b"beef")  # type: ignore[arg-type]

    with pytest.raises(CommitConflictError, match=r"committed .* first"):
        asyncio.run(late())
    assert store.objects[LOCATION.key(MANIFEST_NAME)] == b"0000"


def test_a_claim_left_by_a_dead_writer_blocks_commits_with_a_clear_error() -> None:
    store = ScheduledStore(random.Random(0))
    store.objects[LOCATION.key(claim_key("dead"))] = b"dead"

    async def commit_once() -> None:
        await commit._commit_with_claim(store, LOCATION, "live", b"live")  # type: ignore[arg-type]

    with pytest.raises(CommitConflictError, match=r"dead.*s3ckpt gc"):
        asyncio.run(commit_once())
    assert LOCATION.key(MANIFEST_NAME) not in store.objects


async def _release_before_commit(
    store: ScheduledStore, location: S3URI, save_id: str, body: bytes
) -> list[str]:
    """Broken on purpose: lets go of the claim before writing the manifest."""
    claim = location.key(claim_key(save_id))
    await store.put(claim, b"")
    rivals = [m.key async for m in store.list(location.key(".s3ckpt-claim-")) if m.key != claim]
    manifest_exists = await store.exists(location.key(MANIFEST_NAME))
    await store.delete_many([claim])
    if manifest_exists:
        raise CommitConflictError("lost")
    if rivals:
        return rivals
    await store.put(location.key(MANIFEST_NAME), body)
    return []


def test_the_schedules_catch_a_broken_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit, "_claim_and_commit", _release_before_commit)
    doubled = [seed for seed in range(400) if len(_race(seed, 3)[0]) > 1]
    assert doubled, "no schedule exposed the broken protocol"
