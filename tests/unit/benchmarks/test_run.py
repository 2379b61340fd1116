"""The benchmark runner's schedule: compressed and uncompressed loads take turns."""

from benchmarks.run import ALTERNATING, ROUNDS, merge_runs, schedule_runs


def test_paired_cases_take_turns_round_by_round_after_the_others():
    saves, loads = ALTERNATING
    schedule = schedule_runs(["raw_upload", "s3ckpt_load", *saves, *loads])
    assert schedule[:2] == [("raw_upload", 0), ("s3ckpt_load", 0)]
    expected_saves = [(case, r) for r in range(ROUNDS) for case in saves]
    expected_loads = [(case, r) for r in range(ROUNDS) for case in loads]
    assert schedule[2:] == expected_saves + expected_loads  # round r's loads read its saves


def test_a_lone_paired_case_still_runs_every_round():
    assert schedule_runs(["s3ckpt_load_zstd"]) == [("s3ckpt_load_zstd", r) for r in range(ROUNDS)]


def _result(samples, baseline, peak):
    return {"case": "c", "bytes": 8, "samples": samples,
            "rss_baseline_mib": baseline, "rss_peak_mib": peak}  # fmt: skip


def test_runs_merge_their_samples_and_keep_the_largest_rise():
    first = _result([{"wall": 1.0, "cpu": 1.0}], baseline=100, peak=150)
    second = _result([{"wall": 2.0, "cpu": 2.0}], baseline=300, peak=400)
    merged = merge_runs(merge_runs(None, first), second)
    assert [s["wall"] for s in merged["samples"]] == [1.0, 2.0]
    assert merged["rss_peak_mib"] - merged["rss_baseline_mib"] == 100


def test_a_failed_run_is_the_result():
    ok = _result([{"wall": 1.0, "cpu": 1.0}], baseline=0, peak=1)
    failed = {"case": "c", "error": "boom"}
    assert merge_runs(ok, failed) == failed
    assert merge_runs(failed, ok) == failed
