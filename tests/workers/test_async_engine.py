"""The asyncio front of the engine: concurrent streams, cancellation, validation, KV events.

No sleeps: ordering comes from the engine thread's inbox, which applies commands in the order
they were sent, so a request sent after an abort finishing proves the abort was applied.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator

import pytest
from helpers import count_calls, greedy, output_ids, random_prompt

from contract.identity import block_digests
from contract.kv_events import KVEvent
from contract.request import GenerationChunk, GenerationRequest, InvalidRequestError, SamplingParams
from workers.async_engine import AsyncEngine

BLOCK = 16


@pytest.fixture
def events() -> list[KVEvent]:
    return []


@pytest.fixture
def async_engine(tiny_qwen, make_engine, events) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(tiny_qwen, num_blocks=32), on_events=events.extend)
    yield engine
    engine.shutdown()
    assert not engine._thread.is_alive()


async def collect(engine: AsyncEngine, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(request)]


async def test_concurrent_streams_complete_and_match_the_sync_engine(
        async_engine, tiny_qwen, make_engine):
    requests = [greedy(f"s{i}", random_prompt(i, 20 + 6 * i), max_tokens=12 + 2 * i,
                       ignore_eos=True) for i in range(4)]
    expected = make_engine(tiny_qwen, num_blocks=32).generate(requests)

    results = await asyncio.gather(*(collect(async_engine, r) for r in requests))
    for request, chunks in zip(requests, results, strict=True):
        assert output_ids(chunks) == output_ids(expected[request.request_id])
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        # A consumer that falls behind gets queued tokens merged into one chunk: counts stay
        # cumulative and exact whatever the chunking.
        counts = [c.completion_tokens for c in chunks]
        assert counts == list(itertools.accumulate(len(c.token_ids) for c in chunks))
        assert counts[-1] == request.sampling.max_tokens
    engine = async_engine.engine
    assert max(engine.counters.batch_sizes) >= 2  # the streams shared steps
    assert engine.pool.num_in_use == 0


async def test_closing_the_stream_early_aborts_and_frees_blocks(async_engine):
    engine = async_engine.engine
    long = greedy("long", random_prompt(1, 40), max_tokens=400, ignore_eos=True)
    stream = async_engine.generate(long)
    first = await stream.__anext__()
    second = await stream.__anext__()
    assert (first.finish_reason, second.finish_reason) == (None, None)
    await stream.aclose()  # the client went away

    # sent after the abort, so its last chunk proves the abort was applied before it
    after = await collect(async_engine,
                          greedy("after", random_prompt(2, 20), max_tokens=2, ignore_eos=True))
    assert after[-1].finish_reason == "length"
    assert engine.sequence("long") is None
    assert engine.pool.num_in_use == 0
    assert engine.pool.num_free + engine.pool.num_evictable == engine.pool.num_blocks
    assert not engine.has_work()
    # the long request stopped short of its 400 tokens (finished, it alone would have
    # computed 399 decode tokens)
    assert engine.counters.decode_tokens < 399


async def test_invalid_request_raises_before_any_chunk(async_engine):
    bad = [
        (GenerationRequest("empty", []), "prompt"),
        (GenerationRequest("vocab", [5, 1000]), "prompt"),
        (greedy("top-p", [5, 6], top_p=0.0, ignore_eos=True), "top_p"),
        (greedy("too-long", [5, 6], max_tokens=10_000, ignore_eos=True), "max_tokens"),
    ]
    for request, param in bad:
        stream = async_engine.generate(request)
        with pytest.raises(InvalidRequestError) as error:
            await stream.__anext__()
        assert error.value.param == param
    # a request id already streaming
    running = async_engine.generate(greedy("dup", [5, 6, 7], max_tokens=300, ignore_eos=True))
    assert (await running.__anext__()).finish_reason is None
    with pytest.raises(InvalidRequestError) as error:
        await async_engine.generate(
            greedy("dup", [8, 9], max_tokens=2, ignore_eos=True)).__anext__()
    assert error.value.param == "id"
    await running.aclose()
    # the engine still serves afterwards
    chunks = await collect(async_engine, greedy("ok", [5, 6, 7], max_tokens=3, ignore_eos=True))
    # a consumer that lags gets its queued tokens merged, so count tokens, not chunks
    assert len(output_ids(chunks)) == 3
    assert [c.completion_tokens for c in chunks][-1] == 3
    assert chunks[-1].finish_reason == "length"
    assert async_engine.engine.pool.num_in_use == 0


async def test_a_request_is_validated_once_at_the_engines_door(async_engine, monkeypatch):
    """The worker process checks a request once: the sampling ranges and the context."""
    calls = count_calls(monkeypatch, SamplingParams, ["validate", "check_context"])
    chunks = await collect(
        async_engine, greedy("once", random_prompt(3, 20), max_tokens=4, n=2, ignore_eos=True))
    assert len(output_ids(chunks)) == 8
    assert calls == {"validate": 1, "check_context": 1}


async def test_a_submitted_stream_closed_unread_aborts_its_request(async_engine):
    engine = async_engine.engine
    stream = async_engine.submit(
        greedy("unread", random_prompt(4, 40), max_tokens=400, ignore_eos=True))
    stream.close()  # the caller went away before reading a chunk
    after = await collect(
        async_engine, greedy("after-unread", random_prompt(5, 20), max_tokens=2, ignore_eos=True))
    assert after[-1].finish_reason == "length"
    assert engine.sequence("unread") is None
    assert engine.pool.num_in_use == 0
    assert engine.counters.decode_tokens < 399


async def test_kv_events_reach_the_callback(async_engine, events):
    engine = async_engine.engine
    token_ids = random_prompt(3, 2 * BLOCK + 8)
    chunks = await collect(async_engine, greedy("ev", token_ids, max_tokens=4, ignore_eos=True))
    assert chunks[-1].finish_reason == "length"
    # the prompt's two full blocks were stored at its first step, published before the last
    # chunk was produced; 2 * 16 + 8 + 3 computed tokens fill no third block
    expected = block_digests(engine.identity.root_digest, token_ids, BLOCK)
    assert len(expected) == 2
    assert events == [KVEvent("stored", expected)]


async def test_duplicate_id_refused_in_the_engine_thread_leaves_the_first_request_alone(
        tiny_qwen, make_engine):
    """Both requests pass the off-thread check (neither is queued yet); the engine thread then
    refuses the second. Its failure must not abort the first request under the same id."""
    entered, release = threading.Event(), threading.Event()

    def hold_engine_thread(events: list[KVEvent]) -> None:
        entered.set()
        release.wait(timeout=30)

    async_engine = AsyncEngine(make_engine(tiny_qwen, num_blocks=32),
                               on_events=hold_engine_thread)
    try:
        holder = asyncio.ensure_future(
            collect(async_engine, greedy("hold", random_prompt(9, 20), 2, ignore_eos=True)))
        assert await asyncio.to_thread(entered.wait, 30)  # engine thread parked in a callback
        first = async_engine.generate(
            greedy("dup", random_prompt(10, 20), max_tokens=5, ignore_eos=True))
        second = async_engine.generate(
            greedy("dup", random_prompt(11, 20), max_tokens=5, ignore_eos=True))
        first_chunk = asyncio.ensure_future(first.__anext__())
        second_chunk = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)  # let both generators validate and queue their "add"
        release.set()
        with pytest.raises(InvalidRequestError) as error:
            await asyncio.wait_for(second_chunk, timeout=30)
        assert error.value.param == "id"

        async def rest() -> list[GenerationChunk]:
            return [await first_chunk] + [chunk async for chunk in first]

        chunks = await asyncio.wait_for(rest(), timeout=30)  # a lost stream would hang here
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert output_ids(chunks) == output_ids(make_engine(tiny_qwen, num_blocks=32).generate(
            [greedy("dup", random_prompt(10, 20), max_tokens=5, ignore_eos=True)])["dup"])
        await asyncio.wait_for(holder, timeout=30)
    finally:
        release.set()
        async_engine.shutdown()


async def test_n_choices_stream_until_every_choice_has_finished(async_engine):
    request = GenerationRequest("n2", random_prompt(41, 24), SamplingParams(
        temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True))
    chunks = await collect(async_engine, request)

    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert sum(len(c.token_ids) for c in mine) == 6
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].is_last and sum(c.is_last for c in chunks) == 1
    assert async_engine.engine.pool.num_in_use == 0


async def test_a_lagging_consumer_gets_the_backlog_merged_in_order(async_engine, tiny_qwen,
                                                                   make_engine):
    request = greedy("lag", random_prompt(42, 20), max_tokens=24, ignore_eos=True)
    expected = make_engine(tiny_qwen, num_blocks=32).generate([request])["lag"]
    stream = async_engine.generate(
        greedy("lag", random_prompt(42, 20), max_tokens=24, ignore_eos=True))
    first = await anext(stream)
    # Stall this consumer until the engine has finished the request: the rest waits queued.
    while async_engine.engine.sequence("lag") is not None:
        await asyncio.sleep(0.01)
    rest = [chunk async for chunk in stream]

    assert len(rest) == 1  # 23 queued one-token chunks arrive as one message
    assert output_ids([first, *rest]) == output_ids(expected)
    assert first.text + rest[0].text == "".join(c.text for c in expected)
    assert rest[0].finish_reason == "length" and rest[0].completion_tokens == 24
