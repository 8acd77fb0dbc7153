"""Request-latency histograms: bucket edges as Prometheus' ``le``, and the engine's stamps giving
exact TTFT, ITL, queue, prefill, decode and E2E times under a clock that each step advances by
a known amount."""

from __future__ import annotations

import pytest
from helpers import greedy, random_prompt

from contract.request import GenerationRequest
from workers.request_metrics import (
    DECODE,
    E2E,
    ITL,
    ITL_BUCKETS,
    PREFILL,
    QUEUE,
    TTFT,
    TTFT_BUCKETS,
    Histogram,
    RequestMetrics,
)

STEP_S = 0.125  # a binary fraction: sums and differences of it are exact


def test_histogram_buckets_are_upper_inclusive_with_an_overflow():
    histogram = Histogram([0.1, 0.5, 1.0])
    for value in (0.05, 0.1, 0.3, 1.0, 7.0):
        histogram.observe(value)
    snap = histogram.snapshot()
    assert snap == {"bounds": [0.1, 0.5, 1.0], "counts": [2, 1, 1, 1], "sum": 8.45, "count": 5}


@pytest.mark.parametrize("bounds", [[], [0.5, 0.5], [1.0, 0.5]])
def test_histogram_refuses_bounds_that_do_not_increase(bounds):
    with pytest.raises(ValueError):
        Histogram(bounds)


class SteppedClock:
    """Time stands still except when the engine runs a forward pass, which takes STEP_S."""

    def __init__(self, engine):
        self.now = 0.0
        execute = engine.runner.execute

        def timed(batch, num_logits):
            self.now += STEP_S
            return execute(batch, num_logits)

        engine.runner.execute = timed

    def __call__(self) -> float:
        return self.now


def request_of_length(request_id: str, prompt_len: int, max_tokens: int) -> GenerationRequest:
    """Greedy, past EOS, on a random prompt seeded by the id's length."""
    return greedy(request_id, random_prompt(len(request_id), prompt_len), max_tokens,
                  ignore_eos=True)


def bucket_of(bounds, value: float) -> int:
    return next(i for i, bound in enumerate(bounds) if value <= bound)


@pytest.fixture
def timed_engine(make_engine, tiny_qwen):
    def build(**overrides):
        engine = make_engine(tiny_qwen, **overrides)
        engine.request_metrics = RequestMetrics(SteppedClock(engine))
        return engine
    return build


def test_batched_requests_give_exact_latencies(timed_engine):
    """Three requests prefilled together in step 1, then one decode step per token."""
    engine = timed_engine()
    lengths = {"a": 4, "bb": 5, "ccc": 6}
    engine.generate([request_of_length(rid, 20, n) for rid, n in lengths.items()])
    metrics = engine.request_metrics
    snap = metrics.snapshot()
    assert snap[TTFT]["count"] == 3 and snap[TTFT]["sum"] == 3 * STEP_S
    assert snap[TTFT]["counts"][bucket_of(TTFT_BUCKETS, STEP_S)] == 3
    itl_steps = sum(n - 1 for n in lengths.values())
    assert snap[ITL]["count"] == itl_steps and snap[ITL]["sum"] == itl_steps * STEP_S
    assert snap[ITL]["counts"][bucket_of(ITL_BUCKETS, STEP_S)] == itl_steps
    assert snap[E2E]["count"] == 3 and snap[E2E]["sum"] == sum(lengths.values()) * STEP_S
    assert snap[QUEUE]["sum"] == 0.0 and snap[QUEUE]["count"] == 3
    assert snap[PREFILL]["sum"] == 3 * STEP_S
    assert snap[DECODE]["sum"] == itl_steps * STEP_S
    assert metrics.prompt_tokens == 60 and metrics.generation_tokens == 15


def test_a_request_that_waits_counts_queue_time(timed_engine):
    """One sequence at a time: the second waits for the first's two steps."""
    engine = timed_engine(max_num_seqs=1)
    engine.generate([request_of_length("first", 20, 2), request_of_length("second", 20, 3)])
    snap = engine.request_metrics.snapshot()
    assert snap[QUEUE]["sum"] == 2 * STEP_S          # 0 for the first, 2 steps for the second
    assert snap[TTFT]["sum"] == STEP_S + 3 * STEP_S  # the second's first token ends step 3
    assert snap[E2E]["sum"] == 2 * STEP_S + 5 * STEP_S


def test_an_aborted_request_has_no_completion_times(timed_engine):
    engine = timed_engine()
    engine.add_request(request_of_length("gone", 20, 8))
    engine.step()
    engine.step()
    engine.abort("gone")
    snap = engine.request_metrics.snapshot()
    assert snap[TTFT]["count"] == 1 and snap[ITL]["count"] == 1
    assert all(snap[name]["count"] == 0 for name in (E2E, QUEUE, PREFILL, DECODE))
    assert engine.request_metrics.generation_tokens == 2


def test_choices_of_one_request_count_its_prompt_once(timed_engine):
    engine = timed_engine()
    n3 = request_of_length("n3", 20, 4)
    n3.sampling.n = 3
    engine.generate([n3])
    metrics = engine.request_metrics
    assert metrics.prompt_tokens == 20 and metrics.generation_tokens == 12
    assert metrics.snapshot()[TTFT]["count"] == 3 and metrics.snapshot()[E2E]["count"] == 3
