"""bench.stats on synthetic records whose figures are worked out by hand."""

from __future__ import annotations

import math

import pytest

from bench.records import RequestRecord
from bench.stats import (
    distribution,
    is_good,
    parse_goodput,
    prefix_reuse_ratio,
    summarize,
    throughput_over_time,
)


def _ok(ttft, e2e, completion, prompt=100, cached=None, worker=None, itl=(), start=0.0,
        accepted=None, rejected=None):
    return RequestRecord(label="t", start_s=start, ttft_s=ttft, itl_s=list(itl), e2e_s=e2e,
                         prompt_tokens=prompt, completion_tokens=completion,
                         cached_tokens=cached, usage_reported=True, worker=worker,
                         accepted_prediction_tokens=accepted,
                         rejected_prediction_tokens=rejected)


def _failed():
    return RequestRecord(label="t", start_s=0.0, e2e_s=0.01, failure="http",
                         error="HTTP 500: boom", http_status=500, prompt_tokens=999,
                         completion_tokens=999, cached_tokens=999, worker="w-dead")


@pytest.fixture
def records():
    # TTFT 100/200/300/400 ms; TPOT (e2e - ttft) / (completion - 1) = 100/50/-/10 ms.
    return [
        _ok(0.1, 1.1, 11, prompt=100, cached=0, worker="a", itl=[0.1] * 10,
            accepted=6, rejected=2),
        _ok(0.2, 0.7, 11, prompt=200, cached=100, worker="a", itl=[0.05] * 10),
        _ok(0.3, 0.3, 1, prompt=100, cached=None, worker="b"),
        _ok(0.4, 0.5, 11, prompt=100, cached=50, worker=None, itl=[0.01] * 10,
            accepted=2, rejected=6),
        _failed(),
    ]


def test_latency_distribution_known_answers():
    result = distribution("ttft", [0.1, 0.2, 0.3, 0.4])
    assert result["mean_ttft_ms"] == pytest.approx(250)
    assert result["median_ttft_ms"] == pytest.approx(250)
    assert result["p90_ttft_ms"] == pytest.approx(370)  # rank 2.7: 300 + 0.7 * 100
    assert result["p99_ttft_ms"] == pytest.approx(397)  # rank 2.97
    assert result["std_ttft_ms"] == pytest.approx(math.sqrt(12500))  # population std
    assert distribution("itl", [])["mean_itl_ms"] is None


def test_summary_counts_only_successes(records):
    summary = summarize(records, duration_s=10.0)
    assert summary["completed"] == 4
    assert summary["failed"] == 1
    assert summary["failures"] == {"http": 1}
    assert summary["total_input_tokens"] == 500
    assert summary["total_output_tokens"] == 34
    assert summary["total_cached_tokens"] == 150
    assert summary["request_throughput"] == pytest.approx(0.4)
    assert summary["output_throughput"] == pytest.approx(3.4)
    assert summary["total_token_throughput"] == pytest.approx(53.4)
    assert summary["mean_ttft_ms"] == pytest.approx(250)
    assert summary["median_tpot_ms"] == pytest.approx(50)  # 100, 50, 10: one-token one left out
    assert summary["mean_tpot_ms"] == pytest.approx(160 / 3)
    assert summary["mean_e2el_ms"] == pytest.approx(650)
    # ITL pools every gap: ten of 100 ms, ten of 50 ms, ten of 10 ms.
    assert summary["mean_itl_ms"] == pytest.approx(160 / 3)
    assert summary["median_itl_ms"] == pytest.approx(50)
    assert summary["request_goodput"] is None


def test_goodput_requires_every_slo(records):
    # TTFT <= 250 ms holds for the first two; TPOT <= 60 ms for the 2nd, 3rd (one token: 0)
    # and 4th. Both hold only for the second request.
    summary = summarize(records, 10.0, parse_goodput(["ttft:250", "tpot:60"]))
    assert summary["good_requests"] == 1
    assert summary["request_goodput"] == pytest.approx(0.1)
    assert summarize(records, 10.0, {"ttft": 200})["good_requests"] == 2  # inclusive bound
    assert not is_good(records[-1], {"e2el": 1e9})  # a failure is never good


def test_structured_outputs_count_only_the_checked_successes(records):
    assert summarize(records, 1.0)["valid_output_fraction"] is None  # none asked
    records[0].valid_output, records[1].valid_output = True, False
    records[3].valid_output = True
    records[4].valid_output = True  # a failure's is never counted (the runner never sets it)
    summary = summarize(records, 1.0)
    assert (summary["checked_outputs"], summary["valid_outputs"]) == (3, 2)
    assert summary["valid_output_fraction"] == pytest.approx(2 / 3)


def test_prefix_reuse_is_token_weighted(records):
    # Reporting successes: cached 0 + 100 + 50 over prompt 100 + 200 + 100.
    assert prefix_reuse_ratio(records) == pytest.approx(150 / 400)
    assert summarize(records, 1.0)["prefix_reuse_ratio"] == pytest.approx(0.375)
    assert prefix_reuse_ratio([_ok(0.1, 0.2, 2, cached=None)]) is None


def test_worker_share_and_imbalance(records):
    summary = summarize(records, 1.0)
    assert summary["worker_requests"] == {"a": 2, "b": 1, "unknown": 1}
    assert summary["worker_share"] == {"a": 0.5, "b": 0.25, "unknown": 0.25}
    assert summary["worker_load_imbalance"] == pytest.approx(2.0)


def test_speculative_acceptance(records):
    summary = summarize(records, 1.0)
    assert summary["accepted_prediction_tokens"] == 8
    assert summary["rejected_prediction_tokens"] == 8
    assert summary["spec_acceptance_rate"] == pytest.approx(0.5)
    assert summarize(records[1:3], 1.0)["spec_acceptance_rate"] is None


def test_parse_goodput_rejects_bad_specs():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in ("ttft", "itl:5", "ttft:fast", "tpot:0"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def test_throughput_over_time_spreads_tokens_over_chunks():
    # Request 1: starts at 0 s, chunks at 0.5 and 1.5 s, 4 tokens, ends 1.6 s.
    # Request 2: starts at 1 s, one chunk at 1.2 s, 3 tokens, ends 2.5 s.
    first = _ok(0.5, 1.6, 4, itl=[1.0])
    second = _ok(0.2, 1.5, 3, start=1.0)
    series = throughput_over_time([first, second, _failed()], duration_s=3.0)
    assert series["time_s"] == [0.0, 1.0, 2.0]
    assert series["output_tokens_per_s"] == pytest.approx([2.0, 5.0, 0.0])
    assert series["requests_per_s"] == pytest.approx([0.0, 1.0, 1.0])


def test_load_imbalance_counts_idle_workers_when_the_worker_count_is_known(records):
    from bench.stats import load_imbalance
    assert load_imbalance(records) == pytest.approx(2.0)  # a: 2, b: 1, unknown: 1
    assert load_imbalance(records, workers=3) == pytest.approx(2.0)
    assert load_imbalance(records, workers=4) == math.inf  # one of four served nothing
    assert load_imbalance(records[:1]) is None
