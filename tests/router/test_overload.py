"""Overload is an answer, never a 500: each error kind keeps its answer through every layer of
the HTTP app (the first-chunk await, the stream wrappers, task groups' exception groups); the
ingress sheds work past its token bound at once with 503 and Retry-After; a drain refuses new
requests and ends the ones in flight cleanly."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from openai_fakes import CHAT, COMPLETIONS, HELLO, FakeBackend, assert_error, chunk, sse_events

import router.api.app
from contract.request import GenerationRequest, InvalidRequestError, SamplingParams
from router.api.admission import Admission, DrainRate, request_work, requested_work
from router.api.app import build_openai_app
from router.errors import OverloadedError
from router.protocol import ChatCompletionRequest, CompletionRequest

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

# -- every error kind, at every point, through the app -----------------------------------------

# (error, HTTP status, OpenAI type, code, param)
KINDS = {
    "invalid": (lambda: InvalidRequestError("top_k is odd", "top_k", "invalid_value"),
                400, "invalid_request_error", "invalid_value", "top_k"),
    "context_length": (lambda: InvalidRequestError("too long", "max_tokens",
                                                   "context_length_exceeded"),
                       400, "invalid_request_error", "context_length_exceeded", "max_tokens"),
    "overloaded_503": (lambda: OverloadedError("queues full", retry_after_s=0.25),
                       503, "server_error", "overloaded", None),
    "overloaded_429": (lambda: OverloadedError("slow down", retry_after_s=2.5, status_code=429),
                       429, "rate_limit_error", "overloaded", None),
    "unknown": (lambda: RuntimeError("boom: internal detail"),
                500, "server_error", "internal_error", None),
}

# Retry-After (whole seconds, at least 1) and retry-after-ms of the overload answers.
RETRY_AFTER = {"overloaded_503": ("1", "250"), "overloaded_429": ("3", "2500")}

# How the backend raises it: as it is, or out of a task group (an exception group).
WRAPPERS = {
    "bare": lambda exc: exc,
    "task_group": lambda exc: ExceptionGroup("unhandled errors in a TaskGroup", [exc]),
    "nested_group": lambda exc: ExceptionGroup(
        "outer", [ExceptionGroup("inner", [exc]), KeyError("a sibling task's failure")]),
}

# Chunks the backend sends before raising: none, the token-less first one, or some text.
POINTS = {
    "before_first_chunk": lambda request: [],
    "after_first_chunk": lambda request: [chunk(request)],
    "after_some_text": lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                        chunk(request, "lo", completion=2)],
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind", KINDS)
async def test_each_error_kind_keeps_its_answer(client, backend, kind, wrapper, point, stream):
    make, status, error_type, code, param = KINDS[kind]
    backend.script = lambda request: [*POINTS[point](request), WRAPPERS[wrapper](make())]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": stream})
    if stream and point != "before_first_chunk":
        # The headers went out with the first chunk: the error is the last event.
        assert response.status_code == 200
        events = sse_events(response)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert (error["type"], error["code"], error["param"]) == (error_type, code, param)
    else:
        error = assert_error(response, status, param, code, error_type)
        if kind in RETRY_AFTER:
            retry_after = (response.headers["retry-after"], response.headers["retry-after-ms"])
            assert retry_after == RETRY_AFTER[kind]
    assert "internal detail" not in error["message"]
    assert backend.closed == [backend.requests[0].request_id]


async def test_a_group_of_unknown_errors_is_a_500(client, backend):
    backend.script = lambda request: [ExceptionGroup("g", [KeyError("k"), ValueError("v")])]
    response = await client.post(COMPLETIONS, json={"prompt": "x"})
    assert_error(response, 500, None, "internal_error", "server_error")


async def test_the_first_known_leaf_decides(client, backend):
    backend.script = lambda request: [ExceptionGroup("g", [
        KeyError("k"), OverloadedError("full"), InvalidRequestError("bad", "n")])]
    response = await client.post(COMPLETIONS, json={"prompt": "x"})
    assert_error(response, 503, None, "overloaded", "server_error")


# -- load shedding -----------------------------------------------------------------------------

PROMPT = [11, 12, 13, 14]
MAX_TOKENS = 12
WORK = len(PROMPT) + MAX_TOKENS  # tokens of work of one request of the burst
ADMITTED = 10
BOUND = ADMITTED * WORK


def app_client(backend: FakeBackend, admission: Admission) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_openai_app(backend, admission))
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)


def gated(gate: asyncio.Event) -> Callable[[GenerationRequest], list[Any]]:
    """A slow backend: each request waits for ``gate`` (as in a worker's queue), then is
    answered; its work stays whole until then."""
    return lambda request: [gate, chunk(request), chunk(request, "ok", "stop", completion=1)]


async def until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def timed_post(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = await client.post(COMPLETIONS, json=body)
    return response, time.perf_counter() - started


@pytest.mark.parametrize("bound", ["tokens", "requests"])
async def test_a_burst_past_the_bound_gets_200s_and_fast_503s(backend, bound):
    gate = asyncio.Event()
    backend.script = gated(gate)
    # ADMITTED requests fit either bound: their work in tokens, or their number
    admission = Admission(BOUND) if bound == "tokens" else Admission(max_requests=ADMITTED)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
    async with app_client(backend, admission) as client:
        burst = [asyncio.create_task(timed_post(client, body)) for _ in range(200)]
        await until(lambda: sum(task.done() for task in burst) == 200 - ADMITTED)
        await asyncio.sleep(1.0)  # nothing else gets in while the admitted ones hold the room
        assert sum(task.done() for task in burst) == 200 - ADMITTED
        assert (admission.in_flight, admission.pending_tokens) == (ADMITTED, BOUND)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*burst), 10)
    statuses = [response.status_code for response, _ in results]
    assert statuses.count(200) == ADMITTED and statuses.count(503) == 200 - ADMITTED
    for response, _ in results:
        if response.status_code == 503:
            error = assert_error(response, 503, None, "overloaded", "server_error")
            assert f"bound {BOUND if bound == 'tokens' else ADMITTED})" in error["message"]
            assert response.headers["retry-after"] == "1"
            assert response.headers["retry-after-ms"] == "1000"
        else:
            assert response.json()["choices"][0]["text"] == "ok"
    # Answered at once, never queued behind the admitted requests (held until the gate
    # opened): 95% within 100 ms, and even a garbage collection or a busy CPU keeps every
    # one far from the held requests' wait.
    refused = sorted(seconds for response, seconds in results if response.status_code == 503)
    assert refused[int(0.95 * len(refused))] < 0.1 and refused[-1] < 1.0, refused
    assert len(backend.requests) == ADMITTED  # a refused request never reached the backend
    assert (admission.pending_tokens, admission.in_flight) == (0, 0)
    assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests)


async def test_a_full_server_refuses_before_tokenizing(backend, monkeypatch):
    gate = asyncio.Event()
    backend.script = gated(gate)
    admission = Admission(WORK)
    async with app_client(backend, admission) as client:
        held = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": PROMPT,
                                                                   "max_tokens": MAX_TOKENS}))
        await until(lambda: admission.in_flight == 1)

        def tokenize(*args):
            raise AssertionError("a full server tokenized a request")
        monkeypatch.setattr(backend.tokenizer, "encode", tokenize)
        response = await client.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 1})
        assert_error(response, 503, None, "overloaded", "server_error")
        gate.set()
        assert (await held).status_code == 200


async def test_a_text_prompt_counts_its_exact_work_once_tokenized(backend):
    gate = asyncio.Event()
    backend.script = gated(gate)
    admission = Admission(1000)
    async with app_client(backend, admission) as client:
        held = asyncio.create_task(client.post(CHAT, json={"messages": HELLO, "max_tokens": 5}))
        await until(lambda: len(backend.requests) == 1)
        prompt_tokens = len(backend.requests[0].token_ids)
        assert prompt_tokens > 5
        assert admission.pending_tokens == prompt_tokens + 5
        gate.set()
        assert (await held).status_code == 200
    assert (admission.pending_tokens, admission.in_flight) == (0, 0)


async def test_one_request_larger_than_the_bound_runs_alone(backend):
    admission = Admission(4)
    async with app_client(backend, admission) as client:
        response = await client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 8})
    assert response.status_code == 200
    assert (admission.pending_tokens, admission.in_flight) == (0, 0)


def request_of(prompt_len: int, max_tokens: int, n: int = 1) -> GenerationRequest:
    return GenerationRequest("r1", list(range(1, prompt_len + 1)),
                             SamplingParams(max_tokens=max_tokens, n=n))


def test_work_is_the_prompt_and_every_output_token_of_every_choice():
    assert request_work(request_of(5, 10)) == 15
    assert request_work(request_of(5, 10, n=3)) == 35


@pytest.mark.parametrize(("body", "work"), [
    (CompletionRequest(prompt=[1, 2, 3], max_tokens=10), 13),
    (CompletionRequest(prompt=[1, 2, 3], max_tokens=10, n=2), 23),
    (CompletionRequest(prompt="a text prompt", max_tokens=10), 10),  # counted once tokenized
    (CompletionRequest(prompt="no limit"), 128),  # the context length
    (CompletionRequest(prompt="x", max_tokens=10_000), 128),  # a 400 later, not a 503 now
    (ChatCompletionRequest(messages=HELLO, max_completion_tokens=7, n=3), 21),
    (ChatCompletionRequest(messages=HELLO, max_tokens=9), 9),
])
def test_requested_work_is_read_from_the_body(body, work):
    assert requested_work(body, max_model_len=128) == work


async def test_work_is_given_back_as_it_is_done_and_the_rest_on_close(backend):
    request = request_of(5, 10)
    backend.script = lambda r: [chunk(r), chunk(r, "a", completion=1), chunk(r, "b", completion=2)]
    admission = Admission(100)
    stream = admission.admit(12)  # asked for before tokenizing
    assert (admission.pending_tokens, admission.in_flight) == (12, 1)
    stream.start(request, backend.generate)
    assert (admission.pending_tokens, admission.in_flight) == (15, 1)
    await anext(stream)  # the token-less first chunk: accepted, maybe only queued there
    assert admission.pending_tokens == 15
    await anext(stream)  # the first token: the prompt is prefilled
    assert admission.pending_tokens == 9
    await anext(stream)
    assert admission.pending_tokens == 8
    await stream.aclose()
    await stream.aclose()  # idempotent
    assert (admission.pending_tokens, admission.in_flight) == (0, 0)
    assert backend.closed == ["r1"]


# -- the time bound: work in flight ÷ the measured drain rate ---------------------------------


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_drain_rate_counts_busy_time_only_over_its_window():
    clock = Clock()
    rate = DrainRate(window_s=10, min_observed_s=2, clock=clock)
    rate.set_busy(True)
    rate.record(100)
    clock.now += 1
    assert rate.tokens_per_s() is None  # 1 busy second < 2 observed
    clock.now += 1
    assert rate.tokens_per_s() == pytest.approx(50.0)  # 100 tokens in 2 busy seconds
    rate.set_busy(False)
    clock.now += 1000  # a quiet spell does not dilute the rate
    assert rate.tokens_per_s() == pytest.approx(50.0)
    rate.set_busy(True)
    clock.now += 8
    rate.record(300)
    assert rate.busy_seconds() == pytest.approx(10.0)
    assert rate.tokens_per_s() == pytest.approx(40.0)  # 400 tokens over the 10 s window
    clock.now += 5  # the first 100 tokens (busy second 0) leave the window
    assert rate.tokens_per_s() == pytest.approx(30.0)  # 300 tokens over the last 10 s


def timed_admission(clock: Clock, bound_s: float) -> Admission:
    """An admission with a time bound whose rate is 10 tokens/s already (20 tokens done in 2
    busy seconds), and no token bound."""
    admission = Admission(None, bound_s, DrainRate(window_s=10, min_observed_s=1, clock=clock))
    warm = admission.admit(20)
    clock.now += 2
    admission.give_back(20, done=True)
    admission.release(warm)
    assert admission.drain_rate.tokens_per_s() == pytest.approx(10.0)
    return admission


def test_the_time_bound_refuses_work_that_would_wait_too_long():
    clock = Clock()
    admission = timed_admission(clock, bound_s=5)
    admission.admit(40)  # nothing in flight: always admitted
    admission.admit(50)  # 40 tokens ahead: 4 s at the rate, within 5 s
    assert admission.pending_tokens == 90
    with pytest.raises(OverloadedError, match="about 9 s at 10 tokens/s, bound 5 s") as refused:
        admission.admit(1)
    assert refused.value.retry_after_s == 4  # until 4 s of the 9 have drained
    admission.give_back(70, done=True)  # 20 tokens left, at a rate that has risen
    admission.admit(1)


async def test_a_finished_request_drains_its_unused_limit_and_a_cancelled_one_does_not(backend):
    clock = Clock()
    admission = timed_admission(clock, bound_s=60)
    # Asked for 5 prompt + 10 output tokens; finished after 1: all 15 left the queue.
    backend.script = lambda r: [chunk(r), chunk(r, "a", "stop", completion=1)]
    finished = admission.admit(15)
    finished.start(request_of(5, 10), backend.generate)
    assert (await anext(finished)).finish_reason is None
    assert (await anext(finished)).is_last
    await finished.aclose()
    assert admission.drain_rate.tokens_per_s() == pytest.approx((20 + 15) / 2)
    cancelled = admission.admit(50)  # closed before its first chunk: no evidence of speed
    await cancelled.aclose()
    assert admission.drain_rate.tokens_per_s() == pytest.approx((20 + 15) / 2)
    # Accepted by a worker (its token-less first chunk) and cancelled while queued there: its
    # 40 prompt tokens were never prefilled, so they are not evidence of speed either.
    queued = admission.admit(50)
    queued.start(request_of(40, 10), backend.generate)
    assert (await anext(queued)).token_ids == []
    assert admission.pending_tokens == 50
    await queued.aclose()
    assert admission.drain_rate.tokens_per_s() == pytest.approx((20 + 15) / 2)
    assert admission.pending_tokens == 0


async def test_a_request_past_the_time_bound_gets_a_503_through_the_app(backend):
    gate = asyncio.Event()
    backend.script = gated(gate)
    clock = Clock()
    admission = timed_admission(clock, bound_s=1)
    async with app_client(backend, admission) as client:
        held = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": PROMPT,
                                                                   "max_tokens": MAX_TOKENS}))
        await until(lambda: admission.in_flight == 1)  # 16 tokens ahead: 1.6 s > 1 s
        refused = await client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 1})
        assert_error(refused, 503, None, "overloaded", "server_error")
        assert refused.headers["retry-after"] == "1"
        gate.set()
        assert (await held).status_code == 200
    assert len(backend.requests) == 1


# -- drain -------------------------------------------------------------------------------------


async def stream_events(client: httpx.AsyncClient, body: dict) -> list[Any]:
    response = await client.post(COMPLETIONS, json={**body, "stream": True})
    return sse_events(response)


async def test_drain_lets_a_stream_finish_and_refuses_new_requests(backend):
    gate = asyncio.Event()
    backend.script = gated(gate)
    admission = Admission()
    async with app_client(backend, admission) as client:
        running = asyncio.create_task(stream_events(client, {"prompt": PROMPT}))
        await until(lambda: admission.in_flight == 1)
        drain = asyncio.create_task(admission.drain(timeout_s=10))
        await asyncio.sleep(0.05)
        refused = await client.post(CHAT, json={"messages": HELLO})
        assert_error(refused, 503, None, "shutting_down", "server_error")
        assert refused.headers["retry-after"] == "1"
        health = await client.get("/health")
        assert_error(health, 503, None, "shutting_down", "server_error")
        gate.set()
        events = await running
        report = await drain
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert (report.finished, report.cut, report.left) == (1, 0, 0)
    assert len(backend.requests) == 1


async def test_drain_deadline_ends_streams_with_an_error_event(backend):
    never = asyncio.Event()
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1), never]
    admission = Admission()
    async with app_client(backend, admission) as client:
        streaming = asyncio.create_task(stream_events(client, {"prompt": PROMPT}))
        waiting = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": PROMPT}))
        await until(lambda: admission.in_flight == 2)
        started = time.perf_counter()
        report = await admission.drain(timeout_s=0.3)
        assert 0.3 <= time.perf_counter() - started < 2
        events = await streaming
        answer = await waiting
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down"
    assert events[-3]["choices"][0]["text"] == "Hel"
    assert_error(answer, 503, None, "shutting_down", "server_error")
    assert (report.finished, report.cut, report.left) == (0, 2, 0)
    assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests)
    assert (admission.pending_tokens, admission.in_flight) == (0, 0)


async def test_drain_of_an_idle_server_returns_at_once():
    admission = Admission()
    report = await asyncio.wait_for(admission.drain(timeout_s=30), 1)
    assert (report.finished, report.cut, report.left) == (0, 0, 0)
    assert admission.draining


async def test_health_is_ok_while_workers_stream_though_their_check_would_fail(backend,
                                                                               monkeypatch):
    """Chunks reaching admitted requests prove the workers serve, with no call to make (a
    backend's check may be slow under a full load: the cluster's first, a call to a worker,
    waited behind the requests). Once none has come for the check's timeout, the check
    decides again."""
    monkeypatch.setattr(router.api.app, "HEALTH_TIMEOUT_S", 0.5)
    gate = asyncio.Event()
    backend.script = lambda request: [chunk(request), gate,
                                      chunk(request, "ok", "stop", completion=1)]
    backend.ready = False  # as a check stuck behind the queue ends: timed out
    admission = Admission()
    async with app_client(backend, admission) as client:
        held = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": PROMPT,
                                                                   "max_tokens": MAX_TOKENS}))
        await until(lambda: admission.answered_within(0.5))
        assert (await client.get("/health")).status_code == 200
        await asyncio.sleep(0.6)  # the request waits, and nothing reaches it
        assert_error(await client.get("/health"), 503, None, "not_ready", "server_error")
        gate.set()
        assert (await held).status_code == 200
        assert (await client.get("/health")).status_code == 200  # its last chunk just came
