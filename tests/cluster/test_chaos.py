"""Chaos cases at CI sizes (issue 7, item 4): each fault of ``benchmarks/chaos.py`` struck once
under load on its own application (two fp32 workers, a private ``redis-server``, one ngram
draft replica), served under ``/chaos`` by the session cluster's HTTP proxy.

Every case asserts: each request accepted before the fault, and each sent while it lasted,
completes or ends with an explicit error (HTTP status or SSE error event), none hangs, no KV
block is left in use once the load drains (and each pool's counts add up), and a repeated
shared-prefix request is served from the cache again afterwards. The case then asserts what
its fault must (and must only) cost.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
from private_redis import PrivateRedis, private_redis_server
from ray import serve

from bench.records import RequestRecord
from benchmarks import chaos, soak

SIZES = chaos.QUICK


@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    yield from private_redis_server()


@pytest.fixture(scope="module")
def target(cluster, private_redis: PrivateRedis) -> Iterator[chaos.ChaosTarget]:
    """The chaos application beside the session's (whose fixture started Serve's HTTP proxy on
    its port; the chaos app answers there under ``/chaos``)."""
    yield chaos.deploy(private_redis, cluster.config.port)
    serve.delete(chaos.APP)


async def strike(target: chaos.ChaosTarget, name: str) -> chaos.CaseResult:
    """Runs case ``name`` and checks what every case must hold."""
    result = await chaos.run_case(target, chaos.CASE_TABLE[name], SIZES,
                                  seed=chaos.CASES.index(name))
    figures = result.figures
    print(json.dumps(figures))  # shown with a failure: the whole row, not pytest's cut
    assert figures["accepted_before_fault"] == SIZES.streams, figures
    for group in (figures["before"], figures["during"]):
        assert group["hung"] == 0, figures
        assert group["completed"] + group["explicit_error"] + group["cut"] == group["sent"]
    assert figures["during"]["sent"] == SIZES.during
    assert (figures["leaked_blocks"], figures["running"], figures["waiting"]) == (0, 0, 0), figures
    assert figures["pool_counts_ok"] and figures["workers"] >= 1, figures
    assert figures["recovery_s"] is not None, figures
    # The probe's prefix is 128 words (tokens): at least 7 full 16-token blocks are shared.
    assert figures["cached_tokens_before"] >= 7 * 16, figures
    assert figures["cached_tokens_after"] >= figures["cached_tokens_before"], figures
    return result


def all_completed(figures: dict) -> bool:
    return (figures["before"]["completed"], figures["during"]["completed"]) == (
        SIZES.streams, SIZES.during)


async def test_worker_killed_mid_stream(target):
    """Streams on the killed worker end with an SSE error event; the others complete."""
    result = await strike(target, "worker_kill")
    victim = result.figures["worker"]
    on_victim = [r for r in result.before if r.worker == victim]
    elsewhere = [r for r in result.before if r.worker != victim]
    assert on_victim, "the victim served the first accepted stream"
    assert [r.failure for r in on_victim] == ["sse_error"] * len(on_victim)
    assert all(r.ok for r in elsewhere), [r.error for r in elsewhere]
    assert result.figures["during"]["cut"] == 0, result.figures


async def test_redis_killed_and_restarted_empty(target):
    """Nothing fails while Redis is down: routing falls back without the index."""
    result = await strike(target, "redis_restart")
    assert all_completed(result.figures), result.figures
    assert result.figures["index_fallbacks"], result.figures


async def test_index_slower_than_its_deadline(target):
    """Lookups that miss the deadline are counted, and their requests still complete."""
    result = await strike(target, "index_slow")
    assert all_completed(result.figures), result.figures
    assert result.figures["index_fallbacks"].get("reason=index_timeout", 0) > 0, result.figures


async def test_ingress_replica_restarted(target):
    """Streams through the killed ingress cannot get an SSE error event (the process writing
    them is gone): Serve's proxy closes each without the last chunk, which the client sees as
    an incomplete chunked body, at once, never a hang. Requests sent meanwhile wait for the
    replacement (or get 503) and are served."""
    result = await strike(target, "ingress_restart")
    assert {r.failure for r in result.before} <= {None, "broken_stream"}, result.figures
    assert all("incomplete chunked read" in r.error for r in result.before if not r.ok)
    assert set(result.figures["during"]["statuses"]) <= {"200", "503"}, result.figures
    assert result.figures["during"]["cut"] == 0, result.figures


async def test_draft_replica_killed_while_drafting(target):
    """Plain decoding continues: every stream completes with the text of a fault-free run."""
    result = await strike(target, "draft_kill")
    assert all_completed(result.figures), result.figures
    assert result.figures["draft_calls_missed"] > 0, result.figures
    assert result.figures["identical_outputs"] == SIZES.streams, result.figures


# -- the reports' arithmetic (no cluster) ------------------------------------------------------


def record(failure: str | None = None, status: int | None = 200) -> RequestRecord:
    return RequestRecord(label="r", start_s=0.0, failure=failure, http_status=status)


def test_outcomes_separate_explicit_errors_from_cuts_and_hangs():
    records = [record(), record("sse_error"), record("http", 503), record("broken_stream"),
               record("incomplete_stream"), record("timeout", None)]
    assert [chaos.outcome(r) for r in records] == [
        "completed", "explicit_error", "explicit_error", "cut", "cut", "hung"]
    counts = chaos.tally(records)
    assert (counts["sent"], counts["completed"], counts["explicit_error"], counts["cut"],
            counts["hung"]) == (6, 1, 2, 2, 1)
    assert counts["statuses"] == {"200": 4, "503": 1, "None": 1}


def test_counter_increase_treats_a_lower_value_as_a_restart():
    before = {"reason=index_timeout": 5.0, "reason=index_error": 2.0}
    after = {"reason=index_timeout": 9.0, "reason=index_error": 1.0, "reason=index_down": 3.0}
    assert chaos.counter_increase(before, after) == {
        "reason=index_timeout": 4.0, "reason=index_error": 1.0, "reason=index_down": 3.0}
    assert chaos.counter_increase(after, after) == {}


def test_pool_report_flags_blocks_in_use_and_counts_that_do_not_add_up():
    fine = {"blocks_total": 10, "blocks_free": 6, "blocks_evictable": 4, "blocks_in_use": 0,
            "running": 0, "waiting": 0}
    leaking = fine | {"blocks_free": 5, "blocks_in_use": 1, "running": 1}
    assert chaos.pool_report([fine, fine]) == {"workers": 2, "leaked_blocks": 0,
                                               "pool_counts_ok": True, "running": 0,
                                               "waiting": 0}
    assert chaos.pool_report([fine, leaking])["leaked_blocks"] == 1
    assert not chaos.pool_report([fine | {"blocks_free": 7}])["pool_counts_ok"]


def test_soak_rss_slope_is_fitted_on_the_second_half_only():
    # 3 MiB/min before the half-way mark, then flat: the second half's slope is 0.
    samples = [{"t_s": t, "pid": 7, "role": "NalarWorker",
                "rss_mib": 100 + 3 * min(t, 60) / 60} for t in range(0, 121, 5)]
    slopes = soak.rss_slopes(samples, 120.0)
    assert slopes["7"]["slope_second_half_mib_per_min"] == pytest.approx(0.0, abs=1e-9)
    growing = [s | {"rss_mib": 100 + 1.5 * s["t_s"] / 60} for s in samples]
    slope = soak.rss_slopes(growing, 120.0)["7"]["slope_second_half_mib_per_min"]
    assert slope == pytest.approx(1.5)


def test_soak_prompts_fit_the_context_and_the_mix_varies():
    workload = soak.MixedWorkload(max_model_len=1024, long_fraction=0.5, cancel_fraction=0.5,
                                  seed=3)
    items = [workload.next() for _ in range(200)]
    longest = max(i.request.estimated_prompt_tokens + i.request.max_tokens for i in items)
    assert 1024 - soak.PROMPT_MARGIN_TOKENS - 80 <= longest <= 1024 - soak.PROMPT_MARGIN_TOKENS
    assert 60 < sum(i.cancel_after_s is not None for i in items) < 140
    assert {i.sampling["n"] for i in items} == {1, 2}
    assert {i.sampling["temperature"] for i in items} == {0.0, 0.7, 1.0}
    assert any("stop" in i.sampling for i in items) and any("seed" in i.sampling for i in items)


def test_soak_capacity_needs_no_failure_and_no_queue_building_up():
    def phase(ttfts: list[float], wall_s: float = 11.0, failed: int = 0) -> soak.Phase:
        records = [RequestRecord("r", start_s=i, ttft_s=t, e2e_s=1.0)
                   for i, t in enumerate(ttfts)]
        records += [record("http", 500) for _ in range(failed)]
        return soak.Phase(records, 0, wall_s, 10.0)

    assert soak.sustained(phase([0.2] * 9), 1.0)[0]  # flat TTFT, drained in 1 s
    assert not soak.sustained(phase([0.2] * 9, wall_s=12.5), 1.0)[0]  # a backlog drained
    assert not soak.sustained(phase([0.2] * 6 + [0.5] * 3), 1.0)[0]  # TTFT growing
    assert not soak.sustained(phase([0.2] * 9, failed=1), 1.0)[0]
    assert not soak.sustained(phase([]), 1.0)[0]
    # A queue already standing in the first third: flat, but 3x the lowest rate's TTFT.
    assert soak.sustained(phase([0.6] * 9), 1.0, unloaded_ttft_s=0.3)[0]
    assert not soak.sustained(phase([0.9] * 9), 1.0, unloaded_ttft_s=0.3)[0]


async def test_soak_ramp_reruns_a_failed_rate_once_before_it_stops(monkeypatch):
    verdicts = iter([True, False, True, False, False, True])  # 1st, 2nd (then rerun), 3rd ...
    rates = []

    async def drive(client, workload, rate, *rest):
        rates.append(rate)
        return rate

    monkeypatch.setattr(soak, "drive", drive)
    unloaded = []

    def sustained(phase, rate, unloaded_ttft_s):
        unloaded.append(unloaded_ttft_s)
        return next(verdicts), {"rate": rate, "ttft_median_first_third_s": 0.5 + rate}

    monkeypatch.setattr(soak, "sustained", sustained)
    args = soak.parse_args(["--ramp-start", "1", "--ramp-factor", "2", "--ramp-steps", "6"])
    capacity, ramp = await soak.measure_capacity(None, args)
    # 1 holds; 2 fails, and holds when rerun; 4 fails twice: the ramp stops at 2.
    assert rates == [1, 2, 2, 4, 4] and capacity == 2
    assert unloaded == [math.inf] + [1.5] * 4  # the first rate's TTFT bounds the later ones
    assert [(r["rate"], r["sustained"], r["rerun"]) for r in ramp] == [
        (1, True, False), (2, False, False), (2, True, True), (4, False, False),
        (4, False, True)]
