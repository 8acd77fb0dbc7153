"""Soak: 500 requests through the AsyncEngine on the tiny random Qwen2 (fp32) with a small KV
pool, so requests wait, share prefixes, get preempted and recomputed, and are cancelled at
random times. Afterwards nothing leaks: every block is free or evictable, the pool's
invariants hold, every request that was not cancelled finished with ``stop`` or ``length``,
and the counters agree with what the streams reported."""

from __future__ import annotations

import asyncio
import random

from contract.kv_events import KVEvent
from contract.request import GenerationChunk, GenerationRequest, SamplingParams
from workers.async_engine import AsyncEngine

NUM_REQUESTS = 500
NUM_BLOCKS = 24
SEED = 1234


def random_sampling(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "temperature", "top_k", "top_p", "seeded", "stop"])
    max_tokens = rng.randint(1, 16)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if kind == "temperature":
        return SamplingParams(temperature=rng.uniform(0.3, 1.5), max_tokens=max_tokens)
    if kind == "top_k":
        return SamplingParams(temperature=1.0, top_k=rng.randint(1, 50), max_tokens=max_tokens)
    if kind == "top_p":
        return SamplingParams(temperature=1.0, top_p=rng.uniform(0.1, 0.95),
                              max_tokens=max_tokens)
    if kind == "seeded":
        return SamplingParams(temperature=1.0, seed=rng.randint(0, 1 << 30),
                              max_tokens=max_tokens)
    return SamplingParams(temperature=1.0, stop=[rng.choice(["e", "a", " t", "in"])],
                          max_tokens=max_tokens)


def random_requests(rng: random.Random) -> list[GenerationRequest]:
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(16, 64))] for _ in range(6)]
    requests = []
    for i in range(NUM_REQUESTS):
        suffix = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))]
        token_ids = rng.choice(prefixes) + suffix if rng.random() < 0.5 else suffix
        requests.append(GenerationRequest(f"soak-{i}", token_ids, random_sampling(rng)))
    return requests


async def test_soak_no_leaks_no_hangs_consistent_counters(tiny_qwen, make_engine):
    rng = random.Random(SEED)
    engine = make_engine(tiny_qwen, num_blocks=NUM_BLOCKS, max_num_seqs=16,
                         max_num_batched_tokens=96, scheduling_policy="prefix")
    engine._generator.manual_seed(SEED)
    events: list[KVEvent] = []
    async_engine = AsyncEngine(engine, on_events=events.extend)
    requests = random_requests(rng)
    plans = {r.request_id: (rng.uniform(0, 1.5),  # arrival delay, s
                            rng.random() < 0.15,  # cancel by closing the stream ...
                            rng.random() < 0.05,  # ... or by cancelling the task
                            rng.randint(0, 5)) for r in requests}
    results: dict[str, list[GenerationChunk]] = {}

    async def client(request: GenerationRequest) -> None:
        delay, close_early, _, after_chunks = plans[request.request_id]
        await asyncio.sleep(delay)
        chunks = results.setdefault(request.request_id, [])
        stream = async_engine.generate(request)
        try:
            async for chunk in stream:
                chunks.append(chunk)
                if close_early and len(chunks) > after_chunks:
                    break
        finally:
            await stream.aclose()

    tasks = {r.request_id: asyncio.ensure_future(client(r)) for r in requests}
    for request_id, (delay, _, cancel_task, _) in plans.items():
        if cancel_task:
            asyncio.get_running_loop().call_later(delay + rng.uniform(0, 0.2),
                                                  tasks[request_id].cancel)
    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*tasks.values(), return_exceptions=True), 300)
        errors = [o for o in outcomes if isinstance(o, BaseException)
                  and not isinstance(o, asyncio.CancelledError)]
        assert errors == []
        # every abort was queued before this request, so its end proves they were applied
        last = [c async for c in async_engine.generate(
            GenerationRequest("last", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2)))]
        assert last[-1].finish_reason is not None
    finally:
        async_engine.shutdown()

    pool = engine.pool
    pool.check_invariants()
    assert pool.num_in_use == 0
    assert pool.num_free + pool.num_evictable == NUM_BLOCKS
    assert not engine.has_work() and engine.load_by_request() == {}
    counters = engine.scheduler.counters
    assert counters.preemptions > 0  # the pool really ran out

    cancelled = {rid for rid, (_, close, cancel, _) in plans.items() if close or cancel}
    finished = 0
    for request in requests:
        chunks = results.get(request.request_id, [])
        tokens = [t for c in chunks for t in c.token_ids]
        for index, chunk in enumerate(chunks):
            assert chunk.completion_tokens == len([t for c in chunks[:index + 1]
                                                   for t in c.token_ids])
            assert chunk.cached_tokens <= len(request.token_ids) - 1
        if request.request_id in cancelled and (not chunks or chunks[-1].finish_reason is None):
            continue
        finished += 1
        reason = chunks[-1].finish_reason
        assert reason in ("stop", "length"), request.request_id
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert len(tokens) <= request.sampling.max_tokens
        if reason == "length":
            assert len(tokens) == request.sampling.max_tokens
        assert len({c.cached_tokens for c in chunks}) == 1  # fixed at first admission
    assert finished >= 0.75 * NUM_REQUESTS

    # hits are a part of the lookups, and prefills cover every uncached prompt token looked up
    assert 0 < counters.prefix_hit_tokens < counters.prefix_query_tokens
    assert engine.counters.prefill_tokens >= (counters.prefix_query_tokens
                                              - counters.prefix_hit_tokens)
    # the index's view (stored minus removed digests) is exactly what the pool can serve
    live: set[bytes] = set()
    for event in events:
        if event.kind == "stored":
            assert not live & set(event.digests)
            live.update(event.digests)
        elif event.kind == "removed":
            live.difference_update(event.digests)
    assert live == set(pool.cached_digests())
