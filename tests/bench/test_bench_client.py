"""bench.client against a stub OpenAI-compatible server on a real socket (not Nalar: the
client must not depend on the server it measures), and against httpx mock transports for the
ways a request fails."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from bench_stub_server import MODEL, running_stub

from bench.client import OpenAIClient, first_model
from bench.records import BenchRequest


@pytest.fixture(scope="module")
def stub():
    with running_stub() as (url, state):
        yield url, state


def _request(words=3, max_tokens=5, api_key=None, label="x"):
    content = " ".join(f"u{i}" for i in range(words))
    return BenchRequest([{"role": "user", "content": content}], max_tokens,
                        estimated_prompt_tokens=words, api_key=api_key, label=label)


async def _send(url, request, endpoint="chat", **kwargs):
    async with httpx.AsyncClient() as http:
        client = OpenAIClient(http, url, MODEL, endpoint, **kwargs)
        return await client.send(request, time.perf_counter())


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_stream_usage_and_worker_header(stub, endpoint):
    url, state = stub
    record = await _send(url + "/v1/", _request(words=3, max_tokens=5, api_key="k-" + endpoint),
                         endpoint)
    assert record.ok, record.error
    assert record.http_status == 200
    assert record.output_text == "w0 w1 w2 w3 w4 "
    assert record.completion_tokens == 5
    assert len(record.itl_s) == 4  # five chunks
    assert record.ttft_s + sum(record.itl_s) <= record.e2e_s
    assert 0 < record.ttft_s <= record.e2e_s
    assert record.worker in ("stub-0", "stub-1")
    assert record.usage_reported
    assert (record.accepted_prediction_tokens, record.rejected_prediction_tokens) == (3, 1)
    body = state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL and body["max_tokens"] == 5
    assert "ignore_eos" not in body  # off unless asked for
    if endpoint == "chat":
        assert record.prompt_tokens == 3
    else:
        assert body["prompt"] == "User: u0 u1 u2\n\nAssistant:"
        assert record.prompt_tokens == 5  # the rendered prompt's words, as the server counts


async def test_cached_tokens_come_from_the_server(stub):
    url, _ = stub
    first = await _send(url, _request(words=6, api_key="cache-test"))
    second = await _send(url, _request(words=8, api_key="cache-test"))
    assert (first.cached_tokens, second.cached_tokens) == (0, 6)
    assert second.prompt_tokens == 8


async def test_model_defaults_to_first_listed(stub):
    url, _ = stub
    async with httpx.AsyncClient() as http:
        assert await first_model(http, url, None) == MODEL


async def test_ignore_eos_and_per_request_key(stub):
    url, state = stub
    record = await _send(url, _request(api_key="tenant-key"), api_key="default-key",
                         ignore_eos=True)
    assert record.ok
    assert state.keys[-1] == "tenant-key"
    assert state.bodies[-1]["ignore_eos"] is True
    await _send(url, _request(), api_key="default-key")
    assert state.keys[-1] == "default-key"


async def test_server_without_worker_header_or_usage():
    with running_stub(worker_header=False) as (url, _):
        record = await _send(url, _request(words=4, max_tokens=3))
    assert record.ok and record.worker is None


@pytest.mark.parametrize(("key", "failure", "message"), [
    ("http-500", "http", "HTTP 500: stub exploded"),
    ("sse-error", "sse_error", "worker died"),
    ("truncate", "incomplete_stream", "the stream ended before [DONE]"),
])
async def test_server_errors_are_failures(stub, key, failure, message):
    url, _ = stub
    record = await _send(url, _request(api_key=key))
    assert not record.ok
    assert record.failure == failure
    assert record.error == message
    assert record.tpot_s is None


def _mock(handler):
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def _send_mock(handler, timeout_s=5.0):
    async with _mock(handler) as http:
        client = OpenAIClient(http, "http://mock", MODEL, timeout_s=timeout_s)
        return await client.send(_request(), time.perf_counter())


async def test_usage_missing_falls_back_to_estimates():
    def handler(request):
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
        text = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    record = await _send_mock(handler)
    assert record.ok and not record.usage_reported
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (3, 2, None)


@pytest.mark.parametrize(("body", "failure"), [
    ("data: not json\n\n", "malformed_event"),
    ("data: [DONE]\n\n", "no_output"),
    ('event: error\ndata: {"message": "overloaded"}\n\n', "sse_error"),
])
async def test_malformed_streams_are_failures(body, failure):
    record = await _send_mock(lambda request: httpx.Response(200, text=body))
    assert record.failure == failure


async def test_broken_connection_and_timeout_are_failures():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    assert (await _send_mock(refuse)).failure == "broken_stream"

    async def slow_stream():
        yield b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
        await asyncio.sleep(5)
        yield b"data: [DONE]\n\n"

    record = await _send_mock(lambda request: httpx.Response(200, content=slow_stream()),
                              timeout_s=0.3)
    assert record.failure == "timeout"
    assert record.ttft_s is not None  # the first chunk came
