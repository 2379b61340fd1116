"""Saves and loads through a proxy that injects real network faults (``tests/faultproxy.py``).

Transient faults (throttling, resets mid-body, stalls past the read timeout, truncated
responses, lost responses) must be invisible: every save commits and every load comes
back bit-exact. Faults a retry cannot fix must end the operation quickly with the right
error, leaving nothing visible and the previous checkpoint intact; corrupted bytes must be
caught and named. Each test adds its counts to the fault matrix of ``docs/reliability.md``
(:mod:`tests.reliability_report`), rendered when the whole module has run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import reliability_report as report
import torch
import torch.distributed.checkpoint as dcp
from faultproxy import FaultProxy, Rule
from s3_servers import ON_BOTH

from s3ckpt import (
    BucketNotFoundError,
    CorruptCheckpointError,
    S3StorageReader,
    S3StorageWriter,
    TransientStorageError,
    unwrap,
)
from s3ckpt.errors import DeadlineExceededError
from s3ckpt.transfer.download import REREADS

pytestmark = [ON_BOTH]  # SeaweedFS and moto
MiB = 1024 * 1024
KiB = 1024
READ_TIMEOUT = 2.0
BASE_DELAY = 0.02  # the backoff's base (S3Config.retry_base_delay_s; 0.25 s by default)
ROUNDS = 2  # checkpoints saved and loaded per transient scenario


@dataclass(frozen=True)
class Scenario:
    title: str
    rules: tuple[Rule, ...]


SCENARIOS = {
    "throttled": Scenario("503 SlowDown on 30% of requests", (Rule("slowdown", rate=0.3),)),
    "reset-upload": Scenario(
        "connection reset mid request body (uploads)",
        (Rule("reset_request", methods=("PUT",), match="partNumber=", after=256 * KiB, rate=0.7),),
    ),
    "reset-download": Scenario(
        "connection reset mid response body (loads)",
        (Rule("reset_response", methods=("GET",), after=64 * KiB, rate=0.4),),
    ),
    "stall": Scenario(
        f"stalled connections (silent > read_timeout {READ_TIMEOUT:g} s)",
        (
            Rule("stall", methods=("GET",), match="/data/", after=256 * KiB, limit=2),
            Rule("stall", methods=("PUT",), match="partNumber=", after=-1, limit=1),
        ),
    ),
    "truncate": Scenario(
        "truncated responses (closed early)",
        (Rule("truncate", methods=("GET",), after=100_000, rate=0.4),),
    ),
    "lost-responses": Scenario(
        "lost responses to writes (create, parts, complete, commit)",
        (
            Rule("reset_response", methods=("PUT",), match="manifest.json", after=-1, limit=1),
            Rule("reset_response", methods=("POST",), match="?uploads", after=-1, limit=2),
            Rule("reset_response", methods=("POST",), match="uploadId=", after=-1, limit=2),
            Rule("reset_response", methods=("PUT",), match="partNumber=", after=-1, rate=0.3),
        ),
    ),
    "chunked-errors": Scenario(
        "503 SlowDown with chunked bodies on 15% of requests",
        (Rule("chunked_error", rate=0.15),),
    ),
    "redirect": Scenario(
        "307 redirect answered to a ranged GET (handed to aiobotocore)",
        (Rule("redirect", methods=("GET",), match="/data/", limit=1),),
    ),
    "silent": Scenario(
        f"silent endpoint: requests accepted, never answered (> read_timeout {READ_TIMEOUT:g} s)",
        (
            Rule("stall", methods=("GET",), match="/data/", after=-1, limit=2),
            Rule("stall", methods=("PUT",), after=-1, limit=1),
        ),
    ),
    "corrupt-in-transit": Scenario(
        "flipped bits in 30% of GET response bodies (transient: re-read)",
        (Rule("corrupt", methods=("GET",), match="/data/", after=77_777, rate=0.3),),
    ),
    "corrupt-small-objects": Scenario(
        "flipped bits in 30% of all GET bodies: manifest, metadata, index objects, data "
        "(transient: re-read)",
        (Rule("corrupt", methods=("GET",), after=5, rate=0.3),),
    ),
    "mixed": Scenario(
        "all of the above at 10% each",
        (
            Rule("slowdown", rate=0.1),
            Rule("reset_request", methods=("PUT",), after=64 * KiB, rate=0.1),
            Rule("reset_response", rate=0.1),
            Rule("truncate", methods=("GET",), after=10_000, rate=0.1),
        ),
    ),
}
# + corruption, persistent failure, deadline, the 2,000-request campaign, two failing
# clean-ups; on each server
EXPECTED_ROWS = 2 * (len(SCENARIOS) + 6)


@pytest.fixture(scope="module")
def matrix() -> Iterator[report.Suite]:
    """Rows of the fault matrix, recorded once all are in (``make reliability-report``
    renders them into the docs)."""
    yield from report.filled(
        "faults",
        EXPECTED_ROWS,
        notes=[
            f"Transient scenarios save and load {ROUNDS} checkpoints of about 17 MB each "
            "(5 MiB parts, 2 MiB ranged GETs); faults hit one request at most twice.",
            f"Retries back off from a {BASE_DELAY:g} s base (retry_base_delay_s; "
            "0.25 s by default): the server is on the same host.",
            "Failed cleanly: the operation raised the documented error (a corrupted read "
            "names its object and item); a failed save left no new object and no multipart "
            "upload, and the previous checkpoint still loaded bit-exact.",
        ],
    )


@pytest.fixture
def server(request: pytest.FixtureRequest) -> str:
    """The S3 server behind the proxy, as the fault matrix names it."""
    return "moto" if request.node.callspec.params.get("local_s3") == "moto_s3" else "SeaweedFS"


def _titled(title: str, server: str) -> str:
    return f"{title} [{server}]"


@pytest.fixture
def proxy(local_s3) -> Iterator[FaultProxy]:
    with FaultProxy(local_s3.endpoint_url, seed=7, stall_s=3 * READ_TIMEOUT) as running:
        yield running


@pytest.fixture
def through(s3_options, proxy) -> dict[str, Any]:
    """Options that send every request through the proxy, with short timeouts and a short
    backoff base (a server on this host: the waits between tries are not what is checked)."""
    return {
        **s3_options,
        "endpoint_url": proxy.endpoint_url,
        "read_timeout": READ_TIMEOUT,
        "connect_timeout": READ_TIMEOUT,
        "part_size": 5 * MiB,
        "retry_base_delay_s": BASE_DELAY,
    }


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB, generator=g),  # 12 MiB
        "ids": torch.randint(0, 2**62, (600_000,), generator=g),  # 4.8 MB
        "half": torch.randn(1000, 7, generator=g).to(torch.bfloat16),
        "extra": {"step": seed, "name": f"run-{seed}"},
    }


def _blank() -> dict[str, Any]:
    return {
        "big": torch.zeros(3 * MiB),
        "ids": torch.zeros(600_000, dtype=torch.int64),
        "half": torch.zeros(1000, 7, dtype=torch.bfloat16),
        "extra": {"step": -1, "name": ""},
    }


def _compare(expected: dict[str, Any], actual: dict[str, Any]) -> tuple[int, int]:
    """(bytes compared, bytes that differ) over every tensor; other values must be equal."""
    verified = lost = 0
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            a, b = value.view(-1).view(torch.uint8), actual[key].view(-1).view(torch.uint8)
            verified += a.numel()
            lost += int((a != b).sum()) if a.shape == b.shape else a.numel()
        else:
            assert actual[key] == value, key
    return verified, lost


def _load(uri: str, options: dict[str, Any]) -> dict[str, Any]:
    restored = _blank()
    dcp.load(restored, storage_reader=S3StorageReader(uri, request_size=2 * MiB, **options))
    return restored


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_saves_and_loads_come_through_transient_faults_bit_exact(
    name, proxy, through, s3_prefix, matrix, list_keys, pending_uploads, server
):
    scenario = SCENARIOS[name]
    proxy.add(*(dataclasses.replace(rule) for rule in scenario.rules))  # fresh limits per run
    verified = lost = 0
    for round_ in range(ROUNDS):
        uri, state = f"{s3_prefix}/step-{round_}", _state(round_)
        dcp.save(state, storage_writer=S3StorageWriter(uri, **through))
        counts = _compare(state, _load(uri, through))
        verified, lost = verified + counts[0], lost + counts[1]
        assert pending_uploads(uri) == []  # retried creates left no stray uploads
        assert "manifest.json" in list_keys(uri)
    assert lost == 0
    if name == "mixed":  # rare kinds may miss a run; the mix as a whole may not
        assert sum(proxy.counts.values()) >= 3, proxy.counts
    else:
        assert {rule.fault for rule in scenario.rules} <= set(proxy.counts), proxy.counts
    matrix.add(
        report.Row(
            _titled(scenario.title, server),
            dict(proxy.counts),
            operations=2 * ROUNDS,
            survived=2 * ROUNDS,
            bytes_verified=verified,
        )
    )


def test_a_read_corrupted_every_time_is_caught_and_names_object_and_item(
    proxy, through, s3_prefix, matrix, local_s3, server
):
    """Damage that every read meets (as a damaged object would give) fails the load, after
    the re-reads that would have cured damage in transit."""
    state = {"big": torch.randn(3 * MiB)}
    dcp.save(state, storage_writer=S3StorageWriter(s3_prefix, **through))
    proxy.add(Rule("corrupt", methods=("GET",), match="/data/", after=123_457, per_request=None))
    reader = S3StorageReader(s3_prefix, request_size=2 * MiB, **through)
    with pytest.raises(BaseException) as info:
        dcp.load({"big": torch.zeros(3 * MiB)}, storage_reader=reader)
    error = unwrap(info.value)
    assert isinstance(error, CorruptCheckpointError), error
    assert "/data/r00000-" in str(error) and "'big'" in str(error)
    assert proxy.counts["corrupt"] >= 1 + REREADS  # the first read, then every re-read
    proxy.clear()  # the stored bytes were never damaged: a clean read is exact
    restored = {"big": torch.zeros(3 * MiB)}
    dcp.load(restored, storage_reader=S3StorageReader(s3_prefix, **through))
    verified, lost = _compare(state, restored)
    assert lost == 0
    _failed_cleanly(
        matrix,
        "flipped bit in every GET response body of an object",
        server,
        dict(proxy.counts),
        verified,
    )


def _persistent_part_failures() -> Rule:
    return Rule("slowdown", methods=("PUT",), match="partNumber=", per_request=None)


def _assert_previous_intact(uri, state, through, list_keys, pending_uploads, before) -> int:
    assert pending_uploads(uri) == []
    assert list_keys(uri) == before
    verified, lost = _compare(state, _load(uri, through))
    assert lost == 0
    return verified


def _failed_cleanly(
    matrix: report.Suite, title: str, server: str, faults: dict[str, int], verified: int = 0
) -> None:
    """The matrix's row of one operation that failed cleanly."""
    matrix.add(
        report.Row(
            _titled(title, server),
            faults,
            operations=1,
            failed_cleanly=1,
            bytes_verified=verified,
        )
    )


@pytest.fixture
def failing_parts(proxy, through, s3_prefix, matrix, list_keys, pending_uploads, server):
    """``failing_parts(seed)``: ``_state(seed)`` committed, then every part upload refused
    (503). It returns ``gave_up(title)``, which checks a save given up on since: no upload
    left, no object changed, the previous checkpoint loads bit-exact without faults; and
    adds the matrix's row ``title``."""

    def start(seed: int) -> Callable[[str], None]:
        previous = _state(seed)
        dcp.save(previous, storage_writer=S3StorageWriter(s3_prefix, **through))
        before = list_keys(s3_prefix)
        proxy.add(_persistent_part_failures())

        def gave_up(title: str) -> None:
            faults = dict(proxy.counts)
            proxy.clear()
            verified = _assert_previous_intact(
                s3_prefix, previous, through, list_keys, pending_uploads, before
            )
            _failed_cleanly(matrix, title, server, faults, verified)

        return gave_up

    return start


def test_a_save_that_keeps_failing_gives_up_cleanly_through_its_future(
    through, s3_prefix, failing_parts
):
    gave_up = failing_parts(1)
    started = time.monotonic()
    # Retried until the save's deadline (not for a count of tries), then given up on.
    writer = S3StorageWriter(s3_prefix, overwrite=True, deadline_s=3.0, **through)
    future = dcp.async_save(_state(2), storage_writer=writer)
    with pytest.raises(BaseException) as info:
        future.result(timeout=120)
    error = unwrap(info.value)
    assert isinstance(error, TransientStorageError) and error.code == "SlowDown", error
    assert "deadline_s" in str(error) and error.operation == "UploadPart"
    assert writer.retries > 0
    assert time.monotonic() - started < 60
    gave_up("503 on every part upload (persistent), deadline_s=3")


def test_the_deadline_ends_a_save_that_would_retry_for_long(through, s3_prefix, failing_parts):
    gave_up = failing_parts(3)
    started = time.monotonic()
    writer = S3StorageWriter(
        s3_prefix, overwrite=True, max_attempts=1000, deadline_s=2.0, **through
    )
    with pytest.raises(BaseException) as info:
        dcp.save(_state(4), storage_writer=writer)
    error = unwrap(info.value)
    assert isinstance(error, DeadlineExceededError), error
    assert "deadline_s" in str(error)
    # The 2 s deadline and the work around it: some seconds. Ignoring the deadline, the
    # 1000 attempts would back off for hours, so a bound of a minute cannot be hit by load.
    assert time.monotonic() - started < 60
    gave_up("503 on every part upload, 1000 attempts allowed, deadline_s=2")


def test_errors_a_retry_cannot_fix_are_not_retried(proxy, through, s3_prefix):
    """A missing bucket (refused credentials, on a store that checks them: test_errors.py)."""
    missing = "s3://no-such-bucket-s3ckpt/" + s3_prefix.split("/", 3)[3]
    with pytest.raises(BaseException) as info:
        dcp.save(_state(5), storage_writer=S3StorageWriter(missing, **through))
    assert isinstance(unwrap(info.value), BucketNotFoundError)
    assert sum(proxy.requests.values()) == 1  # the bucket check, once


def test_verify_reads_again_through_damage_in_transit(proxy, through, s3_prefix):
    """``s3ckpt verify`` reports damage in the object, not a bit flipped on the wire."""
    from s3ckpt import catalog
    from s3ckpt.config import make_config

    dcp.save(_state(7), storage_writer=S3StorageWriter(s3_prefix, **through))
    proxy.add(Rule("corrupt", methods=("GET",), match="/data/", after=1000, limit=1))
    report = catalog.verify_checkpoint(s3_prefix, config=make_config(None, **through))
    assert report.ok, report.problems
    assert proxy.counts["corrupt"] == 1


@pytest.mark.parametrize("target", ["manifest.json", "/metadata-", "/index/"])
def test_a_small_object_damaged_on_every_read_fails_as_corrupt(
    target, proxy, through, s3_prefix, make_reader
):
    """Re-reads cure damage in transit; damage that persists through them is reported as
    a damaged checkpoint, whichever checked object it is in."""
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=S3StorageWriter(s3_prefix, **through))
    proxy.add(Rule("corrupt", methods=("GET",), match=target, after=3, per_request=None))
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=S3StorageReader(s3_prefix, **through))
    assert isinstance(unwrap(info.value), CorruptCheckpointError), unwrap(info.value)
    assert proxy.counts["corrupt"] >= 1 + REREADS
    proxy.clear()
    restored = {"w": torch.zeros(1000)}
    dcp.load(restored, storage_reader=S3StorageReader(s3_prefix, **through))
    assert torch.equal(restored["w"], torch.arange(1000.0))


@pytest.mark.timeout(600)
def test_a_campaign_of_2000_requests_at_25_percent_faults_survives_bit_exact(
    proxy, through, s3_prefix, matrix, pending_uploads, server
):
    """A fault on a quarter of all requests, with no cap on how often one request is hit:
    some request meets four or more in a row (which a count of four tries per request
    failed on); retrying until the deadline carries every save and load through. Four
    savers run side by side, as ranks would. The reset comes before the response head, so
    it can fall on any request: a reset inside the body would spare every request whose
    answer has none (parts, PUTs, HEADs), about half of them here.

    No fault here stalls a connection (the stall scenarios test the read timeout), so a
    slow answer from a loaded server is given time instead of being cut at 2 s and retried
    into a storm; and each save or load has a deadline well inside the test's timeout, so
    that an operation that cannot finish fails with its last error named. The backoff's
    base is short (``through``): what is checked is that every operation survives
    bit-exact, not how long the waits between tries are."""
    proxy.add(
        Rule("slowdown", rate=0.15, per_request=None),
        Rule("reset_response", rate=0.10 / 0.85, after=-1, per_request=None),
    )
    options = {**through, "read_timeout": CAMPAIGN_READ_TIMEOUT, "deadline_s": CAMPAIGN_DEADLINE}

    def one_round(number: int) -> tuple[int, int, int]:
        uri, state = f"{s3_prefix}/step-{number}", _campaign_state(number)
        writer = S3StorageWriter(uri, **options)
        dcp.save(state, storage_writer=writer, no_dist=True)
        restored = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = S3StorageReader(uri, **options)
        dcp.load(restored, storage_reader=reader, no_dist=True)
        assert pending_uploads(uri) == []
        return (*_compare(state, restored), writer.retries + reader.retries)

    verified = lost = retried = rounds = 0
    with ThreadPoolExecutor(4) as pool:
        while sum(proxy.requests.values()) < 2000:
            assert rounds < 400, proxy.requests
            for good, bad, tries in pool.map(one_round, range(rounds, rounds + 4)):
                verified, lost, retried = verified + good, lost + bad, retried + tries
            rounds += 4
    requests = sum(proxy.requests.values())
    faults = sum(proxy.counts.values())
    assert lost == 0 and requests >= 2000
    assert faults >= 0.2 * requests, (faults, requests)
    assert retried >= faults // 2, (retried, faults)  # the savers counted their retries
    matrix.add(
        report.Row(
            _titled(f"{requests} requests, a fault on 25% of them, uncapped", server),
            dict(proxy.counts),
            operations=2 * rounds,
            survived=2 * rounds,
            bytes_verified=verified,
        )
    )


CAMPAIGN_READ_TIMEOUT = 20.0
CAMPAIGN_DEADLINE = 90.0  # one save or load; a round takes well under a second here


def _campaign_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64 * KiB, generator=g), "ids": torch.arange(10_000) * seed}


def _failing_completes(proxy) -> None:
    """Every CompleteMultipartUpload refused (501, not retried): the save fails with each
    of its uploads open and its id known."""
    proxy.add(Rule("not_implemented", methods=("POST",), match="uploadId=", per_request=None))


def _save_through(through, uri: str) -> None:
    writer = S3StorageWriter(uri, max_object_size=8 * MiB, **through)
    state = {f"t{i}": torch.full((MiB,), float(i)) for i in range(8)}  # 8 x 4 MiB
    with pytest.raises(BaseException) as info:
        dcp.save(state, storage_writer=writer)
    assert "CompleteMultipartUpload" in str(unwrap(info.value)), unwrap(info.value)


def test_a_clean_up_that_cannot_list_still_aborts_every_upload_it_knows(
    proxy, through, s3_prefix, list_keys, pending_uploads, matrix, server
):
    """Uploads whose id is known are aborted without listing: a store that fails every
    ListMultipartUploads still gets every upload of the failed save aborted."""
    _failing_completes(proxy)
    proxy.add(Rule("slowdown", methods=("GET",), match="uploads", per_request=None))
    _save_through(through, s3_prefix)
    assert proxy.counts["not_implemented"] >= 1  # the completes failed
    assert proxy.counts["slowdown"] == 0  # no listing was needed
    faults = dict(proxy.counts)
    proxy.clear()
    assert pending_uploads(s3_prefix) == []
    assert list_keys(s3_prefix) == []
    _failed_cleanly(
        matrix, "a failed save's clean-up where every listing of uploads fails", server, faults
    )


def test_one_failing_abort_stops_none_of_the_rest_and_gc_finds_what_was_left(
    proxy, through, s3_prefix, s3_options, list_keys, pending_uploads, caplog, matrix, server
):
    _failing_completes(proxy)
    proxy.add(
        Rule("not_implemented", methods=("DELETE",), match="-0000.bin?uploadId", per_request=None)
    )
    with caplog.at_level(logging.WARNING, logger="s3ckpt.transfer.upload"):
        _save_through(through, s3_prefix)
    faults = dict(proxy.counts)
    proxy.clear()
    left = pending_uploads(s3_prefix)
    assert len(left) == 1 and left[0].endswith("-0000.bin"), left
    assert list_keys(s3_prefix) == []  # the deletes ran all the same
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "-0000.bin not aborted" in logged, logged
    from s3ckpt import catalog
    from s3ckpt.config import make_config

    collected = catalog.collect_garbage(s3_prefix, grace=0, config=make_config(None, **s3_options))
    assert [u.key.rsplit("/", 1)[-1] for u in collected.uploads] == [left[0].rsplit("/", 1)[-1]]
    assert pending_uploads(s3_prefix) == []
    _failed_cleanly(
        matrix, "a failed save's clean-up where one abort fails (gc removes it)", server, faults
    )
