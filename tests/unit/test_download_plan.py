import pytest

from s3ckpt.download import ReadTarget, _Scatter, plan_requests
from s3ckpt.http_range import copy_into


def _target(key, start, end, token=None):
    return ReadTarget(key, start, end, memoryview(bytearray(end - start)), token or (key, start))


def test_adjacent_targets_are_coalesced_into_one_request():
    targets = [_target("a", 0, 10), _target("a", 10, 30), _target("a", 30, 31)]
    requests = plan_requests(targets, max_request_size=1000, max_gap=0)
    assert [(r.key, r.start, r.end, len(r.targets)) for r in requests] == [("a", 0, 31, 3)]


def test_gaps_beyond_the_limit_split_requests_and_objects_never_mix():
    targets = [_target("a", 0, 10), _target("a", 100, 110), _target("b", 10, 20)]
    requests = plan_requests(targets, max_request_size=1000, max_gap=50)
    assert sorted((r.key, r.start, r.end) for r in requests) == [
        ("a", 0, 10),
        ("a", 100, 110),
        ("b", 10, 20),
    ]


def test_large_ranges_are_cut_into_parallel_requests():
    targets = [_target("a", 0, 100), _target("a", 100, 250)]
    requests = plan_requests(targets, max_request_size=64, max_gap=0)
    assert [(r.start, r.end) for r in requests] == [(0, 64), (64, 128), (128, 192), (192, 250)]
    assert [len(r.targets) for r in requests] == [1, 2, 1, 1]


def test_scatter_fills_every_target_and_reports_completion_once():
    payload = bytes(range(250))
    targets = [_target("a", 0, 100, "x"), _target("a", 100, 250, "y")]
    done = []
    for request in plan_requests(targets, max_request_size=64, max_gap=0):
        sink = _Scatter(request, lambda t: done.append(t.token))
        # deliver in uneven chunks, as a socket would
        for lo in range(request.start, request.end, 7):
            hi = min(lo + 7, request.end)
            copy_into(sink, lo, payload[lo:hi])
    assert done == ["x", "y"]
    assert bytes(targets[0].buffer) == payload[:100]
    assert bytes(targets[1].buffer) == payload[100:]


def test_buffer_must_match_the_range():
    with pytest.raises(ValueError):
        ReadTarget("a", 0, 10, memoryview(bytearray(5)), None)
