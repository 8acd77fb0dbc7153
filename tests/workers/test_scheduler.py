"""The scheduler: token budget (decodes first), partial-prefill limit, policies with aging,
preemption by recompute, requests that can never fit, and chunking that never changes outputs.

Scheduler-level tests drive :class:`Scheduler` over a bare block pool (no model): a step
schedules, commits what was scheduled and appends a token to every sequence whose tokens are
all computed, as the engine does. Engine-level tests compare greedy token ids (fp32).
"""

from __future__ import annotations

import logging

import pytest
from helpers import fitted_decode_costs, fitted_prompt_costs, greedy, output_ids, random_prompt

from contract.request import GenerationChunk, GenerationRequest, InvalidRequestError, SamplingParams
from workers.block_manager import BlockManager
from workers.block_pool import BlockPool
from workers.scheduler import Scheduler
from workers.sequence import Sequence
from workers.step_time import PromptCostModel, StepTimeTarget

BLOCK = 4
ROOT = b"\0" * 32


def make_scheduler(num_blocks: int = 64, budget: int = 8, max_num_seqs: int = 8,
                   **options) -> Scheduler:
    return Scheduler(BlockManager(BlockPool(num_blocks, BLOCK)), max_num_seqs, budget, **options)


def make_seq(request_id: str, length: int, first: int = 10) -> Sequence:
    request = GenerationRequest(request_id, list(range(first, first + length)),
                                SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    return Sequence(request, ROOT, BLOCK)


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One engine step without a model: (request id, tokens computed) in batch order."""
    batch = scheduler.schedule()
    for seq, num_tokens in zip(batch.seqs, batch.num_new_tokens, strict=True):
        scheduler.blocks.commit(seq, num_tokens)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)  # the sampled token
    return [(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]


def test_decodes_go_first_then_the_running_prefill_then_admissions():
    scheduler = make_scheduler(budget=10)
    long, short = make_seq("long", 40), make_seq("short", 3, first=100)
    scheduler.add(long)
    assert step(scheduler) == [("long", 10)]  # alone: the whole budget
    scheduler.add(short)
    # a prompt being chunked continues before admissions, capped at half the budget while
    # another request waits; the short prompt fits in what is left
    assert step(scheduler) == [("long", 5), ("short", 3)]
    # short now decodes: it goes first although long is older; long takes the rest
    assert step(scheduler) == [("short", 1), ("long", 9)]
    assert step(scheduler) == [("short", 1), ("long", 9)]
    assert step(scheduler) == [("short", 1), ("long", 7)]  # 10 + 5 + 9 + 9 + 7 = 40
    assert step(scheduler) == [("long", 1), ("short", 1)]  # two decodes, oldest first


def test_one_partial_prefill_at_a_time_and_short_prompts_pass_the_waiting_long_one():
    scheduler = make_scheduler(budget=8)
    for seq in (make_seq("long1", 40), make_seq("long2", 40, first=200),
                make_seq("short", 3, first=400)):
        scheduler.add(seq)
    # long2 would stay mid-prefill too: it waits; short's whole prompt fits in what long1's
    # cut to the threshold (4) leaves, so long1 is cut and short finishes its prompt now
    assert step(scheduler) == [("long1", 4), ("short", 3)]
    scheduler.add(make_seq("long3", 40, first=600))
    trace = [step(scheduler) for _ in range(10)]
    # Now only long prompts wait, and none could start (one partial prefill at a time) or fit
    # in the rest: long1 is not cut and the budget is never left idle (7 + short's decode).
    # long2 starts in the step that ends long1's prompt; long3 (later) waits for long2.
    assert trace[:5] == [[("short", 1), ("long1", 7)]] * 5
    assert trace[5:] == [[("long1", 1), ("short", 1), ("long2", 6)]] * 5
    assert all(sum(n for _, n in batch) == 8 for batch in trace)
    assert [seq.request_id for seq in scheduler.waiting] == ["long3"]


def test_partial_prefill_limit_of_two():
    scheduler = make_scheduler(budget=8, max_num_partial_prefills=2)
    for seq in (make_seq("long1", 40), make_seq("long2", 40, first=200),
                make_seq("short", 3, first=400)):
        scheduler.add(seq)
    assert step(scheduler) == [("long1", 4), ("long2", 4)]


def test_prefix_policy_prefers_the_longest_cached_prefix_and_ages():
    scheduler = make_scheduler(budget=64, max_num_seqs=1, policy="prefix", aging_steps=3)
    cached = make_seq("cached", 12)
    scheduler.add(cached)
    step(scheduler)
    scheduler.finish(cached)  # its 3 full blocks stay cached (evictable)
    holder = make_seq("holder", 2, first=900)  # occupies the only running slot
    scheduler.add(holder)
    step(scheduler)
    cold, warm = make_seq("cold", 12, first=500), make_seq("warm", 14)  # warm shares 3 blocks
    scheduler.add(cold)
    scheduler.add(warm)
    assert [s.request_id for s in scheduler._waiting_in_order()] == ["warm", "cold"]
    fcfs = make_scheduler(policy="fcfs")
    fcfs.waiting.extend([cold, warm])
    assert [s.request_id for s in fcfs._waiting_in_order()] == ["cold", "warm"]
    for _ in range(3):
        step(scheduler)  # holder keeps decoding; nobody is admitted
    assert [s.request_id for s in scheduler.waiting] == ["cold", "warm"]
    # cold has waited 3 steps: it now goes before warm despite warm's cached prefix
    assert [s.request_id for s in scheduler._waiting_in_order()] == ["cold", "warm"]
    scheduler.finish(holder)
    assert step(scheduler) == [("cold", 12)]


def test_preemption_takes_the_newest_and_is_counted():
    scheduler = make_scheduler(num_blocks=4, budget=16)
    a, b = make_seq("a", 7), make_seq("b", 7, first=100)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler) == [("a", 7), ("b", 7)]  # 2 blocks each: the pool is full
    assert step(scheduler) == [("a", 1), ("b", 1)]  # token 8 still fits in block 2
    # a's token 9 needs a third block: b, the newest, is preempted and recomputed later
    assert step(scheduler) == [("a", 1)]
    assert scheduler.counters.preemptions == 1
    assert list(scheduler.waiting) == [b] and b.block_table == [] and b.num_computed_tokens == 0
    assert scheduler.blocks.pool.num_in_use == 3


def test_preempting_a_sequence_already_in_the_batch_takes_it_out():
    scheduler = make_scheduler(num_blocks=5, budget=8, max_num_partial_prefills=2)
    old, new = make_seq("old", 20), make_seq("new", 3, first=100)
    scheduler.add(old)
    assert step(scheduler) == [("old", 8)]  # 2 blocks
    scheduler.add(new)
    assert step(scheduler) == [("old", 4), ("new", 3)]  # 3 + 1 blocks: 4 of 5
    # new decodes first (batched, 1 budget token), then old's 7-token chunk needs 2 more
    # blocks, 1 is free: new, the newest, is preempted although it is already in the batch
    assert step(scheduler) == [("old", 7)]
    assert scheduler.counters.preemptions == 1
    assert list(scheduler.waiting) == [new]
    assert scheduler.blocks.pool.num_in_use == 5


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        make_scheduler(policy="lifo")


def target_scheduler(prompt_ms: int | None, budget: int = 64, cap_ms: int | None = None,
                     costs: PromptCostModel | None = None,
                     long_prompts_only: bool = False) -> Scheduler:
    """A scheduler whose step-time target leaves ``prompt_ms`` prompt tokens beside one decode
    row: a decode row costs 1 ms, a prompt token 1 ms (``costs``), the target is
    ``1 + prompt_ms`` ms; ``cap_ms`` caps every step."""
    target = StepTimeTarget(None if prompt_ms is None else 0.001 * (1 + prompt_ms),
                            None if cap_ms is None else 0.001 * cap_ms,
                            fitted_decode_costs(0.0, 0.001), costs or fitted_prompt_costs(0.001),
                            BLOCK, long_prompts_only=long_prompts_only)
    return make_scheduler(budget=budget, step_target=target)


def test_step_time_target_caps_prompt_tokens_only_beside_decodes():
    scheduler = target_scheduler(prompt_ms=6)
    scheduler.add(make_seq("first", 20))
    assert step(scheduler) == [("first", 20)]  # nothing decodes: the whole token budget
    scheduler.add(make_seq("second", 30, first=100))
    assert step(scheduler) == [("first", 1), ("second", 6)]
    assert step(scheduler) == [("first", 1), ("second", 6)]


def test_a_target_for_long_prompts_only_leaves_whole_a_prompt_the_budget_holds():
    scheduler = target_scheduler(prompt_ms=6, long_prompts_only=True)
    scheduler.add(make_seq("first", 20))
    assert step(scheduler) == [("first", 20)]
    scheduler.add(make_seq("second", 30, first=100))  # the 64-token budget holds it whole
    assert step(scheduler) == [("first", 1), ("second", 30)]
    scheduler.add(make_seq("long", 200, first=300))  # longer than the budget: 7 ms - 2 rows
    assert step(scheduler) == [("first", 1), ("second", 1), ("long", 5)]
    assert step(scheduler) == [("first", 1), ("second", 1), ("long", 5)]


def test_step_time_target_still_gives_prompts_a_block():
    scheduler = target_scheduler(prompt_ms=0)
    scheduler.add(make_seq("first", 8))
    step(scheduler)
    scheduler.add(make_seq("second", 30, first=100))
    assert step(scheduler) == [("first", 1), ("second", BLOCK)]


def test_step_time_target_never_cuts_decodes():
    scheduler = target_scheduler(prompt_ms=0)
    ids = [f"s{i}" for i in range(6)]
    for i, request_id in enumerate(ids):
        scheduler.add(make_seq(request_id, 4, first=10 * i + 10))
    step(scheduler)
    # six decode rows take 6 ms of a 1 ms target: all six run, and the waiting prompt gets
    # its one block
    scheduler.add(make_seq("late", 12, first=500))
    assert step(scheduler) == [(request_id, 1) for request_id in ids] + [("late", BLOCK)]


def test_step_time_cap_chunks_a_lone_prompt_and_cuts_deep_chunks_shorter():
    # a prompt token costs 1 ms plus 0.025 ms per key before it; a 40 ms cap
    costs = fitted_prompt_costs(0.001, 0.000025)
    scheduler = target_scheduler(None, budget=64, cap_ms=40, costs=costs)
    scheduler.add(make_seq("long", 200))  # longer than the token budget
    chunks = [step(scheduler)[0][1] for _ in range(4)]
    assert chunks == [29, 20, 16, 14]  # 29 * (1 ms + 0.025 ms * 14.5) = 39.5 ms; 30: 41.3
    depth = 0
    for chunk in chunks:
        assert costs.seconds(depth, chunk) <= 0.040 < costs.seconds(depth, chunk + 1)
        depth += chunk


def test_step_time_cap_admits_an_arrival_beside_a_long_prompt():
    scheduler = target_scheduler(None, budget=64, cap_ms=40)
    scheduler.add(make_seq("long", 400))
    assert step(scheduler) == [("long", 40)]  # 1 ms a token
    scheduler.add(make_seq("short", 12, first=900))
    # the long chunk leaves half the step to the arrival, whose whole prompt fits in it
    assert step(scheduler) == [("long", 20), ("short", 12)]
    assert step(scheduler) == [("short", 1), ("long", 39)]  # the cap, less a decode row
    # a prompt that the token budget holds whole runs past the cap: the step gives it its
    # first token
    scheduler.add(make_seq("whole", 20, first=2000))
    assert step(scheduler) == [("short", 1), ("long", 19), ("whole", 20)]


def test_the_lower_of_target_and_cap_applies_beside_decodes():
    scheduler = target_scheduler(prompt_ms=6, cap_ms=4)
    scheduler.add(make_seq("first", 100))  # longer than the token budget
    assert step(scheduler) == [("first", 4)]
    scheduler = target_scheduler(prompt_ms=6, cap_ms=40)
    scheduler.add(make_seq("first", 20))
    assert step(scheduler) == [("first", 20)]
    scheduler.add(make_seq("second", 30, first=100))
    assert step(scheduler) == [("first", 1), ("second", 6)]


# ---- engine level --------------------------------------------------------------------------


def test_a_request_that_could_never_fit_is_refused_at_admission(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=4)  # 64 tokens of KV in all
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(greedy("huge", random_prompt(1, 50), max_tokens=20, ignore_eos=True))
    assert (error.value.param, error.value.code) == ("max_tokens", "context_length_exceeded")
    assert "64" in str(error.value)
    assert not engine.has_work()
    # the largest request that fits still runs to completion alone
    fits = greedy("fits", random_prompt(2, 50), max_tokens=14, ignore_eos=True)
    chunks = engine.generate([fits])["fits"]
    assert chunks[-1].finish_reason == "length" and len(output_ids(chunks)) == 14
    assert engine.pool.num_in_use == 0


def test_preemption_keeps_greedy_outputs_token_for_token(tiny_qwen, make_engine):
    requests = [greedy(f"r{i}", random_prompt(30 + i, 20 + 3 * i), max_tokens=30, ignore_eos=True)
                for i in range(6)]
    reference = make_engine(tiny_qwen, num_blocks=128).generate(requests)
    engine = make_engine(tiny_qwen, num_blocks=10, max_num_batched_tokens=32)
    chunks = engine.generate(requests)
    assert engine.scheduler.counters.preemptions > 0
    for request in requests:
        assert output_ids(chunks[request.request_id]) == output_ids(
            reference[request.request_id]), request.request_id
        assert all(c.cached_tokens == 0 for c in chunks[request.request_id])
    assert engine.scheduler.counters.prefix_hit_tokens == 0
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()


def test_p7_p8_under_preemption_shared_prefixes(tiny_qwen, make_engine):
    """Shared prefixes and a pool small enough to preempt: hits are counted once, at first
    admission, never for recomputation; at rest nothing is in use and the pool is consistent."""
    shared = random_prompt(80, 32)
    prompts = [shared + random_prompt(800 + i, 5 + 4 * i) for i in range(8)]
    requests = [greedy(f"p{i}", p, max_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)]
    reference = make_engine(tiny_qwen, num_blocks=128).generate(requests)
    engine = make_engine(tiny_qwen, num_blocks=14, max_num_batched_tokens=48)
    for request in requests:
        engine.add_request(request)
    chunks: dict[str, list[GenerationChunk]] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for chunk in engine.step():
            chunks[chunk.request_id].append(chunk)
        engine.pool.check_invariants()
    counters = engine.scheduler.counters
    assert counters.preemptions > 0
    cached = {rid: {c.cached_tokens for c in out} for rid, out in chunks.items()}
    assert all(len(values) == 1 for values in cached.values())  # fixed at first admission
    assert all(next(iter(cached[r.request_id])) <= len(r.token_ids) - 1 for r in requests)
    assert counters.prefix_hit_tokens == sum(next(iter(v)) for v in cached.values()) > 0
    assert counters.prefix_query_tokens == sum(len(p) for p in prompts)
    for request in requests:
        assert output_ids(chunks[request.request_id]) == output_ids(
            reference[request.request_id])
    assert engine.pool.num_in_use == 0
    assert engine.pool.num_free + engine.pool.num_evictable == 14


def generate_counting_prefill(engine, requests) -> tuple[dict, list[int]]:
    """``engine.generate(requests)``, and the prompt tokens computed at each step."""
    for request in requests:
        engine.add_request(request)
    chunks = {request.request_id: [] for request in requests}
    per_step = []
    while engine.has_work():
        before = engine.counters.prefill_tokens
        for chunk in engine.step():
            chunks[chunk.request_id].append(chunk)
        per_step.append(engine.counters.prefill_tokens - before)
    return chunks, per_step


@pytest.mark.parametrize("budget", [16, 64, 100])
def test_chunking_never_changes_tiny_model_outputs(tiny_qwen, make_engine, budget):
    """Budgets under the longest prompt (the tiny model holds 512 positions; chunks of 512 are
    SmolLM2's test below)."""
    requests = [greedy(f"c{i}", random_prompt(60 + i, 40 + 37 * i), max_tokens=6, ignore_eos=True)
                for i in range(5)]  # 40 .. 188 tokens
    reference = make_engine(tiny_qwen, num_blocks=128, max_num_batched_tokens=4096,
                            max_num_seqs=1).generate(requests)
    engine = make_engine(tiny_qwen, num_blocks=128, max_num_batched_tokens=budget)
    chunks, per_step = generate_counting_prefill(engine, requests)
    for request in requests:
        assert output_ids(chunks[request.request_id]) == output_ids(
            reference[request.request_id])
    assert max(per_step) == budget  # prompts really were chunked, at the budget


def test_chunking_never_changes_smollm_outputs(smollm, make_engine):
    """Two ~600-token prompts sharing their first 560 tokens: each unchunked (the second a
    prefix hit) vs chunked at 16, 64 and 512 tokens per step, greedy ids equal. The shared
    head keeps the test quick: the second prompt's head is a cache hit under every budget.
    The first prompt really runs in chunks of the budget: the second, waiting, could neither
    start (one partial prefill at a time) nor fit beside it, so its chunks are not cut."""
    vocab = smollm.model.config.vocab_size
    head = random_prompt(90, 560, vocab)
    requests = [greedy(f"s{i}", head + random_prompt(91 + i, 40 + 17 * i, vocab), max_tokens=2,
                       ignore_eos=True)
                for i in range(2)]
    unchunked = make_engine(smollm, num_blocks=96, max_num_batched_tokens=2048, max_num_seqs=1)
    reference = unchunked.generate(requests)
    assert unchunked.counters.steps == 4  # each prompt in one step, then one decode
    for budget in (16, 64, 512):
        engine = make_engine(smollm, num_blocks=96, max_num_batched_tokens=budget)
        chunks, per_step = generate_counting_prefill(engine, requests)
        assert per_step[0] == budget
        # the second prompt is admitted as the first one's last chunk runs: its head is a hit
        # as far as the first one's blocks were registered by then
        assert 512 <= engine.scheduler.counters.prefix_hit_tokens <= 560
        for request in requests:
            assert output_ids(chunks[request.request_id]) == output_ids(
                reference[request.request_id]), (budget, request.request_id)


def test_an_explicit_max_model_len_the_cache_cannot_hold_is_lowered_with_a_warning(
        tiny_qwen, make_engine, caplog):
    with caplog.at_level(logging.WARNING, logger="workers.engine"):
        engine = make_engine(tiny_qwen, num_blocks=4, max_model_len=500)
    assert engine.max_model_len == 64
    assert "max_model_len 500 lowered to 64 tokens" in caplog.text
    assert "the KV cache holds 64 (4 blocks of 16)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.engine"):
        assert make_engine(tiny_qwen, num_blocks=4, max_model_len=48).max_model_len == 48
    assert "lowered" not in caplog.text


def test_requests_sharing_a_prompt_being_computed_wait_for_it_and_reuse_it():
    """Four requests sharing a 16-token prefix arrive together: the first computes it, the
    others wait one step each time their next block is being computed, then reuse it."""
    scheduler = make_scheduler(budget=64)
    shared = list(range(10, 26))  # 4 full blocks
    seqs = [Sequence(GenerationRequest(f"s{i}", shared + [500 + i, 600 + i],
                                       SamplingParams(temperature=0.0, max_tokens=4)),
                     ROOT, BLOCK) for i in range(4)]
    other = make_seq("other", 6, first=900)  # shares nothing: admitted beside the first
    for seq in (*seqs, other):
        scheduler.add(seq)
    assert step(scheduler) == [("s0", 18), ("other", 6)]
    assert scheduler.counters.shared_prefix_waits == 3
    # s0's 4 blocks are cached now: the others compute only their own 2 tokens
    assert step(scheduler) == [("s0", 1), ("other", 1), ("s1", 2), ("s2", 2), ("s3", 2)]
    assert [seq.num_cached_tokens for seq in seqs] == [0, 16, 16, 16]
    assert scheduler.counters.prefix_hit_tokens == 48


def test_a_request_waits_only_for_blocks_still_to_be_computed():
    """A request whose shared part is cached already is admitted at once; one whose next block
    a running prompt has yet to compute waits, until that prompt has passed it."""
    scheduler = make_scheduler(budget=12, max_num_partial_prefills=2)
    long = make_seq("long", 40)
    scheduler.add(long)
    assert step(scheduler) == [("long", 12)]  # blocks 0-2 computed, 3-9 in flight
    cached_only = make_seq("cached-only", 9)  # long's first 9 tokens: blocks 0-1 cached
    follower = make_seq("follower", 30)  # long's first 30: its block 3 is in flight
    scheduler.add(cached_only)
    scheduler.add(follower)
    assert step(scheduler) == [("long", 6), ("cached-only", 1)]
    assert cached_only.num_cached_tokens == 8
    assert follower in scheduler.waiting and scheduler.counters.shared_prefix_waits == 1
    while follower in scheduler.waiting:
        step(scheduler)
    # admitted once long had computed past the 28 tokens it can reuse (7 blocks)
    assert long.num_computed_tokens >= 28 and follower.num_cached_tokens == 28


def test_a_burst_sharing_a_new_prefix_computes_it_once_and_outputs_equal_cold(
        tiny_qwen, make_engine):
    """Six requests sharing a 64-token prefix arrive in one step: the prefix is computed once,
    the other five reuse it, and every output equals the request's own cold run (fp32)."""
    shared = random_prompt(90, 64)
    requests = [greedy(f"b{i}", shared + random_prompt(900 + i, 5 + i), max_tokens=8,
                       ignore_eos=True) for i in range(6)]
    engine = make_engine(tiny_qwen)
    chunks, _ = generate_counting_prefill(engine, requests)
    assert engine.counters.prefill_tokens == 64 + sum(5 + i for i in range(6))
    assert engine.scheduler.counters.prefix_hit_tokens == 5 * 64
    assert engine.scheduler.counters.shared_prefix_waits == 5
    for request in requests:
        cold = make_engine(tiny_qwen).generate([request])[request.request_id]
        assert output_ids(chunks[request.request_id]) == output_ids(cold), request.request_id
        assert chunks[request.request_id][-1].cached_tokens == (
            0 if request.request_id == "b0" else 64)
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()


def test_the_engine_fits_prompt_costs_by_depth_and_caps_steps_by_them(
        tiny_qwen, make_engine, monkeypatch):
    engine = make_engine(tiny_qwen, max_num_batched_tokens=32, max_step_time_s=1e-9)
    seen = []
    observe = engine.prompt_costs.observe
    monkeypatch.setattr(engine.prompt_costs, "observe",
                        lambda chunks, seconds, tokens: (seen.append((chunks, tokens)),
                                                         observe(chunks, seconds, tokens)))
    first = greedy("first", random_prompt(5, 100), max_tokens=2, ignore_eos=True)
    reference = make_engine(tiny_qwen).generate([first])
    assert output_ids(engine.generate([first])["first"]) == output_ids(reference["first"])
    # unmeasured at first: the token budget alone; then a cap far below any step leaves the
    # prompt longer than the budget a block (16 tokens) a step (its last 4 tokens, below a
    # block, tell nothing of the cost)
    assert seen == [([(0, 32)], 32), ([(32, 16)], 16), ([(48, 16)], 16), ([(64, 16)], 16),
                    ([(80, 16)], 16)]
    seen.clear()
    engine.generate([greedy("second", random_prompt(6, 30), max_tokens=1, ignore_eos=True)])
    assert seen == [([(0, 30)], 30)]  # the budget holds it whole: past the cap


def test_outputs_do_not_change_under_a_step_time_target(tiny_qwen, make_engine, monkeypatch):
    """fp32 greedy outputs are the same when every prompt arriving beside a decode is
    computed a block a step (a target of a microsecond: min_tokens applies once measured)."""
    first = greedy("first", random_prompt(60, 40), max_tokens=64, ignore_eos=True)
    later = [greedy(f"r{i}", random_prompt(61 + i, 40 + 9 * i), max_tokens=12, ignore_eos=True)
             for i in range(3)]
    reference = make_engine(tiny_qwen).generate([first, *later])
    engine = make_engine(tiny_qwen, step_time_target_s=1e-6)
    prompt_chunks = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        prompt_chunks.extend(n for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                             if seq.num_computed_tokens < seq.num_prompt_tokens
                             and seq.request_id != "first")
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    chunks = {request.request_id: [] for request in [first, *later]}
    engine.add_request(first)
    for _ in range(5):  # its prefill, then decodes: both costs are measured
        for chunk in engine.step():
            chunks[chunk.request_id].append(chunk)
    for request in later:
        engine.add_request(request)
    while engine.has_work():
        for chunk in engine.step():
            chunks[chunk.request_id].append(chunk)
    for request_id, expected in reference.items():
        assert output_ids(chunks[request_id]) == output_ids(expected), request_id
    assert max(prompt_chunks) == engine.config.block_size
    assert sum(prompt_chunks) == 40 + 49 + 58
    assert engine.pool.num_in_use == 0
