"""The engine's warm-up before serving: a measured prompt cost, and no other trace.

Without a measured prompt cost the step-time cap cannot size a chunk, so on a fresh server a
long prompt's first chunk ran uncapped while short requests waited it out (6.4 s through HTTP
on a Zen 4, docs/performance.md).
"""

from __future__ import annotations

import pytest
from helpers import greedy

PROMPT = [(37 * i) % 900 + 20 for i in range(40)]


def outputs(engine) -> list[int]:
    chunks = engine.generate([greedy("r", PROMPT, 8, ignore_eos=True)])["r"]
    return [t for chunk in chunks for t in chunk.token_ids]


def test_a_warmed_up_engine_knows_a_prompts_cost_and_keeps_nothing_else(tiny_qwen, make_engine):
    cold, warm = make_engine(tiny_qwen, num_blocks=32), make_engine(tiny_qwen, num_blocks=32)
    assert not warm.prompt_costs.known
    assert warm.warm_up(64) > 0
    assert warm.prompt_costs.known
    assert warm.drain_events() == []  # the index never hears of its blocks
    assert warm.pool.num_available == 32 and warm.pool.cached_digests() == []
    counts = (warm.counters.steps, warm.counters.prefill_tokens, warm.counters.decode_tokens,
              warm.scheduler.counters.prefix_query_tokens, warm.request_metrics.prompt_tokens,
              warm.request_metrics.generation_tokens)
    assert counts == (0, 0, 0, 0, 0, 0)
    assert outputs(warm) == outputs(cold)
    assert warm.counters.prefill_tokens == cold.counters.prefill_tokens == len(PROMPT)


def test_warm_up_refuses_an_engine_with_requests(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=32)
    engine.add_request(greedy("r", PROMPT, 4, ignore_eos=True))
    with pytest.raises(RuntimeError, match="before any request"):
        engine.warm_up()
