"""A worker that survives its own faults: a failed step fails only its batch's requests; an
error elsewhere in the engine loop never hangs a request; a dead loop fails fast and fails the
replica's health check; aborting an unknown or finished request is harmless."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

import pytest
from helpers import greedy, output_ids, random_prompt, step_through_failures

import workers.engine as engine_module
from contract.request import GenerationChunk, GenerationRequest, InvalidRequestError
from workers.async_engine import AsyncEngine, EngineDeadError
from workers.engine import StepFailedError


def fail_when_batched(engine, request_id: str, after_calls: int = 2) -> dict:
    """Make the runner raise on a step containing ``request_id`` once it has run
    ``after_calls`` such steps (so the victim holds computed, registered blocks)."""
    execute, state = engine.runner.execute, {"calls": 0, "failed_batch": None}

    def flaky(batch, num_logits):
        if any(seq.request.request_id == request_id for seq in batch.seqs):
            state["calls"] += 1
            if state["calls"] > after_calls and state["failed_batch"] is None:
                state["failed_batch"] = sorted(seq.request.request_id for seq in batch.seqs)
                raise RuntimeError("injected kernel fault")
        return execute(batch, num_logits)

    engine.runner.execute = flaky
    return state


def assert_pool_at_rest(engine) -> None:
    engine.pool.check_invariants()
    assert engine.pool.num_in_use == 0
    assert not engine.has_work()


def test_a_failed_step_aborts_only_its_batch(tiny_qwen, make_engine):
    requests = [greedy("bad", random_prompt(1, 40), 12, ignore_eos=True),
                greedy("mate", random_prompt(2, 30), 12, ignore_eos=True),
                greedy("later", random_prompt(3, 35), 12, ignore_eos=True)]
    reference = make_engine(tiny_qwen, num_blocks=64).generate(requests)
    engine = make_engine(tiny_qwen, num_blocks=64, max_num_seqs=2)  # "later" waits
    state = fail_when_batched(engine, "bad")
    for request in requests:
        engine.add_request(request)
    chunks: dict[str, list[GenerationChunk]] = {r.request_id: [] for r in requests}
    with pytest.raises(StepFailedError) as error:
        while engine.has_work():
            for chunk in engine.step():
                chunks[chunk.request_id].append(chunk)
    assert sorted(error.value.request_ids) == state["failed_batch"] == ["bad", "mate"]
    assert "injected kernel fault" in str(error.value)
    assert engine.sequence("bad") is None and engine.sequence("mate") is None
    while engine.has_work():  # the engine keeps serving the request outside the step
        for chunk in engine.step():
            chunks[chunk.request_id].append(chunk)
    assert output_ids(chunks["later"]) == output_ids(reference["later"])
    assert chunks["later"][-1].finish_reason == "length"
    assert_pool_at_rest(engine)


def fail_row(engine, monkeypatch, request_id: str, stage: str, after_calls: int = 2,
             error: Exception | None = None) -> None:
    """Make one row's work after the forward pass raise ``error`` (by default a
    RuntimeError) for ``request_id`` once it has run ``after_calls`` times: sampling it
    (``"sample"``: every sampling call holding its row raises from then on, the batched call
    and its own) or committing its token (``"commit"``)."""
    error = error or RuntimeError("injected row fault")
    state = {"calls": 0}

    def failing(seq_request_id: str) -> bool:
        if seq_request_id == request_id:
            state["calls"] += 1
        return state["calls"] > after_calls and seq_request_id == request_id

    if stage == "sample":
        real = engine_module.sample
        victim = {seq.request.request_id: seq for seq in engine._seqs.values()}[request_id]

        def flaky_sample(logits, rows, generator):
            if any(failing(request_id) for row in rows if row.params is victim.sampling):
                raise error
            return real(logits, rows, generator)

        monkeypatch.setattr(engine_module, "sample", flaky_sample)
    else:
        append = engine._append

        def flaky_append(seq, sampled, accepted_drafts=None):
            if failing(seq.request.request_id):
                raise error
            return append(seq, sampled, accepted_drafts)

        engine._append = flaky_append


@pytest.mark.parametrize("stage", ["sample", "commit"])
def test_a_failed_row_aborts_only_its_request(tiny_qwen, make_engine, monkeypatch, stage):
    """A row that fails after the forward pass (its sampling, its commit) aborts its own
    request; the rows beside it in that step commit their tokens, delivered with the error,
    and every other request finishes as if nothing happened."""
    requests = [greedy("bad", random_prompt(1, 40), 12, ignore_eos=True),
                greedy("mate", random_prompt(2, 30), 12, ignore_eos=True),
                greedy("choices", random_prompt(3, 35), 12, ignore_eos=True, n=2)]
    reference = make_engine(tiny_qwen, num_blocks=64).generate(requests)
    engine = make_engine(tiny_qwen, num_blocks=64)
    for request in requests:
        engine.add_request(request)
    fail_row(engine, monkeypatch, "bad", stage)
    chunks, failures = step_through_failures(engine, requests)
    assert [error.request_ids for error in failures] == [["bad"]]
    assert "injected row fault" in str(failures[0])
    assert {chunk.request_id for chunk in failures[0].chunks} == {"mate", "choices"}
    assert len(output_ids(chunks["bad"])) == 2  # its two tokens before the fault
    for rid in ("mate", "choices"):
        for index in {chunk.index for chunk in reference[rid]}:
            assert output_ids(c for c in chunks[rid] if c.index == index) == output_ids(
                c for c in reference[rid] if c.index == index)
    assert engine.sequence("bad") is None
    assert_pool_at_rest(engine)


async def collect(engine: AsyncEngine, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(request)]


async def test_a_failed_step_fails_only_its_streams(tiny_qwen, make_engine):
    requests = [greedy("bad", random_prompt(1, 40), 12, ignore_eos=True),
                greedy("mate", random_prompt(2, 30), 12, ignore_eos=True),
                greedy("later", random_prompt(3, 35), 12, ignore_eos=True)]
    reference = make_engine(tiny_qwen, num_blocks=64).generate(requests)
    engine = make_engine(tiny_qwen, num_blocks=64, max_num_seqs=2)
    state = fail_when_batched(engine, "bad")
    async_engine = AsyncEngine(engine)
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(collect(async_engine, r) for r in requests), return_exceptions=True), 60)
        outcome = dict(zip([r.request_id for r in requests], results, strict=True))
        assert state["failed_batch"] == ["bad", "mate"]
        for failed in ("bad", "mate"):
            assert isinstance(outcome[failed], RuntimeError)
            assert "injected kernel fault" in str(outcome[failed])
        assert output_ids(outcome["later"]) == output_ids(reference["later"])
        # still healthy, still serving
        async_engine.check_health()
        again = await asyncio.wait_for(
            collect(async_engine, greedy("again", random_prompt(4, 20), ignore_eos=True)), 60)
        assert output_ids(again) == output_ids(make_engine(tiny_qwen, num_blocks=64).generate(
            [greedy("again", random_prompt(4, 20), ignore_eos=True)])["again"])
        assert_pool_at_rest(engine)
    finally:
        async_engine.shutdown()


@pytest.mark.parametrize("fault", [RuntimeError("injected row fault"),
                                   InvalidRequestError("injected row fault", "tools")])
async def test_a_failed_row_fails_only_its_stream(tiny_qwen, make_engine, monkeypatch, fault,
                                                  caplog):
    """The failed row's stream gets the engine's error, or, where the request's own fault
    was the cause (a constraint's dead end), that fault, which the router answers as a 400,
    logged as a refusal is: without an error and its traceback."""
    caplog.set_level(logging.INFO, logger="workers.async_engine")
    requests = [greedy("bad", random_prompt(1, 40), 12, ignore_eos=True),
                greedy("mate", random_prompt(2, 30), 12, ignore_eos=True)]
    reference = make_engine(tiny_qwen, num_blocks=64).generate(requests)
    engine = make_engine(tiny_qwen, num_blocks=64)
    fail_row(engine, monkeypatch, "bad", "commit", error=fault)
    async_engine = AsyncEngine(engine)
    try:
        bad, mate = await asyncio.wait_for(asyncio.gather(
            *(collect(async_engine, r) for r in requests), return_exceptions=True), 60)
        assert type(bad) is type(fault) and "injected row fault" in str(bad)
        assert (bad is fault) == isinstance(fault, InvalidRequestError)
        logged = [record for record in caplog.records if record.name == "workers.async_engine"]
        assert [r.levelno for r in logged] == (
            [logging.INFO] if isinstance(fault, InvalidRequestError) else [logging.ERROR])
        assert output_ids(mate) == output_ids(reference["mate"])  # its chunk of that step too
        async_engine.check_health()
        assert_pool_at_rest(engine)
    finally:
        async_engine.shutdown()


async def test_an_error_outside_a_step_fails_current_streams_and_the_loop_goes_on(
        tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=64)
    async_engine = AsyncEngine(engine)
    deliver, calls = async_engine._deliver, {"n": 0}

    def broken_once(chunk):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected delivery fault")
        deliver(chunk)

    async_engine._deliver = broken_once
    try:
        with pytest.raises(RuntimeError, match="injected delivery fault"):
            await asyncio.wait_for(
                collect(async_engine, greedy("victim", random_prompt(5, 20), ignore_eos=True)), 60)
        chunks = await asyncio.wait_for(
            collect(async_engine, greedy("next", random_prompt(6, 20), ignore_eos=True)), 60)
        assert chunks[-1].finish_reason == "length" and len(output_ids(chunks)) == 8
        async_engine.check_health()
        assert_pool_at_rest(engine)
    finally:
        async_engine.shutdown()


async def test_a_dead_loop_fails_fast_and_fails_the_health_check(tiny_qwen, make_engine):
    from cluster.worker_deployment import NalarWorker

    engine = make_engine(tiny_qwen, num_blocks=64)
    entered, release = threading.Event(), threading.Event()

    def park_engine_thread(events) -> None:  # the first step's "stored" event parks the loop
        entered.set()
        release.wait(timeout=30)

    async_engine = AsyncEngine(engine, on_events=park_engine_thread)
    worker = SimpleNamespace(async_engine=async_engine)
    NalarWorker.check_health(worker)  # healthy
    pending = async_engine.generate(
        greedy("pending", random_prompt(7, 20), max_tokens=100, ignore_eos=True))
    first = asyncio.ensure_future(pending.__anext__())
    assert await asyncio.to_thread(entered.wait, 30)

    def broken():
        raise RuntimeError("injected loop fault")

    engine.has_work = broken  # every turn of the loop now fails outside a step
    release.set()
    assert (await asyncio.wait_for(first, 30)).finish_reason is None


    async def rest() -> None:
        async for _ in pending:  # chunks already queued, then the error
            pass

    with pytest.raises(RuntimeError, match="injected loop fault"):
        await asyncio.wait_for(rest(), 30)  # failed, not hung
    await asyncio.wait_for(asyncio.to_thread(async_engine._thread.join, 30), 35)
    assert not async_engine._thread.is_alive()
    with pytest.raises(EngineDeadError, match="injected loop fault"):
        await asyncio.wait_for(
            collect(async_engine, greedy("new", random_prompt(8, 20), ignore_eos=True)), 5)
    with pytest.raises(EngineDeadError):
        NalarWorker.check_health(worker)
    assert engine.pool.num_in_use == 0  # the pending request was aborted, its blocks freed


async def test_shutdown_fails_new_requests_at_once(tiny_qwen, make_engine):
    async_engine = AsyncEngine(make_engine(tiny_qwen, num_blocks=16))
    async_engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(
            collect(async_engine, greedy("late", random_prompt(9, 10), ignore_eos=True)), 5)


async def test_aborting_unknown_or_finished_requests_is_harmless(tiny_qwen, make_engine):
    engine = make_engine(tiny_qwen, num_blocks=16)
    assert engine.abort("never-seen") is None
    engine.generate([greedy("done", random_prompt(10, 20), max_tokens=3, ignore_eos=True)])
    assert engine.abort("done") is None
    assert engine.abort("done") is None
    async_engine = AsyncEngine(engine)
    try:
        async_engine._inbox.put(("abort", "never-seen", None))
        async_engine._inbox.put(("abort", "done", None))
        chunks = await asyncio.wait_for(
            collect(async_engine, greedy("ok", random_prompt(11, 20), ignore_eos=True)), 60)
        assert chunks[-1].finish_reason == "length"
        async_engine.check_health()
        assert_pool_at_rest(engine)
    finally:
        async_engine.shutdown()
