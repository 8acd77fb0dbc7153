"""The OpenAI-compatible HTTP layer against a scripted fake backend and the real SmolLM2
tokenizer: request validation, tokenization, routing digests, tenancy, response shapes, SSE,
backend errors and client disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    IDENTITY,
    MAX_MODEL_LEN,
    MODEL,
    SECRET,
    FakeBackend,
    Script,
    assert_error,
    chunk,
    expected_digests,
    hello_world,
    sse_events,
    two_choices,
)

from router.errors import OverloadedError
from router.openai_app import WORKER_HEADER, build_openai_app
from workers.identity import CacheNamespace, tenant_from_api_key
from workers.request import (
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    TokenLogprob,
)

# -- successful answers ------------------------------------------------------------------------


async def test_chat_completion_shape_usage_and_worker_header(client, backend):
    response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
    assert response.status_code == 200, response.text
    assert response.headers[WORKER_HEADER] == "worker-7"
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "Hello world"}}]
    prompt_tokens = len(backend.requests[0].token_ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 2,
                             "total_tokens": prompt_tokens + 2,
                             "prompt_tokens_details": {"cached_tokens": 16}}
    assert backend.requests[0].request_id == body["id"]
    assert backend.closed == [body["id"]]


async def test_chat_tokens_are_the_chat_template_output(client, backend, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, *HELLO,
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Why?"}]
    response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 200, response.text
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert backend.requests[0].token_ids == list(expected["input_ids"])


async def test_text_parts_are_joined_and_developer_is_system(client, backend, tokenizer):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "text", "text": "there"}]}]
    response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 200, response.text
    rendered = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello\nthere"}]
    expected = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    assert backend.requests[0].token_ids == list(expected["input_ids"])


async def test_completion_of_a_string_prompt(client, backend, tokenizer):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon"})
    assert response.status_code == 200, response.text
    assert response.headers[WORKER_HEADER] == "worker-7"
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert backend.requests[0].token_ids == tokenizer.encode("Once upon")


async def test_token_id_prompt_is_passed_as_is(client, backend):
    prompt = [5, 0, 49151, 5]
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert backend.requests[0].token_ids == prompt
    assert backend.requests[0].sampling.max_tokens == 3


async def test_sampling_parameters_reach_the_worker(client, backend):
    body = {"prompt": "Hi", "temperature": 0, "top_p": 0.5, "top_k": 7, "seed": 42,
            "stop": "\n", "stop_token_ids": [2], "ignore_eos": True, "max_tokens": 5,
            "user": "someone", "n": 1, "logprobs": None, "echo": False, "best_of": 1}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    sampling = backend.requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0, 0.5, 7, 42)
    assert (sampling.stop, sampling.stop_token_ids, sampling.ignore_eos) == (["\n"], [2], True)
    assert sampling.max_tokens == 5


async def test_default_max_tokens_fills_the_context(client, backend):
    response = await client.post("/v1/chat/completions", json={"messages": HELLO})
    assert response.status_code == 200, response.text
    request = backend.requests[0]
    assert request.sampling.max_tokens == MAX_MODEL_LEN - len(request.token_ids)


async def test_max_completion_tokens_is_the_chat_limit(client, backend):
    body = {"messages": HELLO, "max_completion_tokens": 4, "max_tokens": 4}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert backend.requests[0].sampling.max_tokens == 4


async def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    body = {"messages": HELLO, "logprobs": False, "n": 1, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "store": False, "modalities": ["text"],
            "top_logprobs": None, "stream": False}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


async def test_json_needs_its_content_type(client, backend):
    """FastAPI's CSRF guard: a browser can send a body without Content-Type preflight-free."""
    body = json.dumps({"prompt": "Hi"}).encode()
    error = assert_error(await client.post(COMPLETIONS, content=body), 400, None, "invalid_type")
    assert "application/json" in error["message"]
    assert backend.requests == []
    response = await client.post(COMPLETIONS, content=body,
                                 headers={"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200, response.text


# -- routing digests and tenancy ---------------------------------------------------------------


async def test_routing_digests_follow_key_and_salt(client, backend):
    async def digests(key: str | None, salt: str | None = None) -> list[bytes]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"messages": HELLO, **({"cache_salt": salt} if salt else {})}
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        request = backend.requests[-1]
        assert request.routing_digests == expected_digests(request.token_ids, key, salt)
        assert request.namespace == CacheNamespace(tenant_from_api_key(key, SECRET), salt)
        assert request.namespace.tenant != key
        return request.routing_digests

    anonymous = await digests(None)
    key_a, key_b = await digests("sk-tenant-a"), await digests("sk-tenant-b")
    salt_1, salt_2 = await digests("sk-tenant-a", "s1"), await digests("sk-tenant-a", "s2")
    assert len(anonymous) == len(backend.requests[0].token_ids) // IDENTITY.block_size >= 2
    assert backend.requests[0].namespace.tenant == "anonymous"
    every = [anonymous, key_a, key_b, salt_1, salt_2]
    for i, first in enumerate(every):
        for second in every[i + 1:]:
            assert not set(first) & set(second)  # no block is shared across scopes
    assert await digests("sk-tenant-a") == key_a  # and one scope is stable


async def test_raw_api_key_is_never_logged(client, backend, caplog):
    caplog.set_level(logging.DEBUG)
    key = "sk-very-secret-key-123"
    headers = {"Authorization": f"Bearer {key}"}
    await client.post("/v1/chat/completions", json={"messages": HELLO}, headers=headers)
    backend.script = lambda request: [RuntimeError("worker crashed")]
    await client.post("/v1/chat/completions", json={"messages": HELLO}, headers=headers)
    await client.post("/v1/chat/completions", json={"messages": HELLO, "bogus": 1},
                      headers=headers)
    assert caplog.records and key not in caplog.text


@pytest.mark.parametrize("authorization", ["Basic abc", "Bearer", "Bearer   ", "sk-no-scheme"])
async def test_malformed_authorization_is_refused(client, backend, authorization):
    response = await client.post("/v1/chat/completions", json={"messages": HELLO},
                                 headers={"Authorization": authorization})
    assert_error(response, 401, None, "invalid_api_key")
    assert backend.requests == []


# -- streaming ---------------------------------------------------------------------------------


async def test_chat_stream_framing(client, backend):
    body = {"messages": HELLO, "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers[WORKER_HEADER] == "worker-7"
    *chunks, done = sse_events(response)
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Hello world"
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert backend.closed == [chunks[0]["id"]]


async def test_stream_include_usage(client, backend):
    body = {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=body)
    *chunks, usage_chunk, done = sse_events(response)
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    prompt_tokens = len(backend.requests[0].token_ids)
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 2,
                                    "total_tokens": prompt_tokens + 2,
                                    "prompt_tokens_details": {"cached_tokens": 16}}


async def test_completion_stream(client):
    body = {"prompt": "Once", "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body)
    assert response.headers[WORKER_HEADER] == "worker-7"
    *chunks, usage_chunk, done = sse_events(response)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2


async def test_length_finish_reason(client, backend):
    backend.script = lambda request: [chunk(request, "Hi", "length", completion=1)]
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert response.json()["choices"][0]["finish_reason"] == "length"


# -- sampling parameters, logprobs, n ---------------------------------------------------------


async def test_new_sampling_parameters_reach_the_worker(client, backend):
    body = {"messages": HELLO, "min_p": 0.1, "repetition_penalty": 1.2,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"42": -100},
            "min_tokens": 3, "max_tokens": 9, "n": 3, "seed": 7, "logprobs": True,
            "top_logprobs": 4}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    sampling = backend.requests[0].sampling
    assert (sampling.min_p, sampling.repetition_penalty, sampling.presence_penalty,
            sampling.frequency_penalty) == (0.1, 1.2, 0.5, -0.5)
    assert sampling.logit_bias == {42: -100}
    assert (sampling.min_tokens, sampling.max_tokens, sampling.n) == (3, 9, 3)
    assert sampling.logprobs == 4
    response = await client.post(COMPLETIONS, json={"prompt": "x", "logprobs": 0})
    assert backend.requests[1].sampling.logprobs == 0
    response = await client.post(CHAT, json={"messages": HELLO, "logprobs": True})
    assert backend.requests[2].sampling.logprobs == 0
    response = await client.post(CHAT, json={"messages": HELLO, "logprobs": False,
                                             "top_logprobs": 0})
    assert response.status_code == 200 and backend.requests[3].sampling.logprobs is None


async def test_message_name_is_accepted_and_passed_to_the_template(client, backend, tokenizer):
    messages = [{"role": "user", "content": "Hello there", "name": "bob"}]
    response = await client.post(CHAT, json={"messages": messages})
    assert response.status_code == 200, response.text
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert backend.requests[0].token_ids == list(expected["input_ids"])


def logprob_script(tokenizer: Any) -> Script:
    """Two tokens with logprobs, the second a partial multi-byte character pair: "Hi🙂"."""
    ids = tokenizer.encode("Hi🙂")
    dot = tokenizer.encode(".")[0]

    def script(request: GenerationRequest) -> list[Any]:
        entries = [TokenLogprob(t, -0.25 * (i + 1), [(t, -0.25 * (i + 1)), (dot, -3.0)])
                   for i, t in enumerate(ids)]
        prompt = len(request.token_ids)
        return [GenerationChunk(request.request_id, ids[:-1], "Hi", None, prompt, 0,
                                len(ids) - 1, "worker-7", logprobs=entries[:-1]),
                GenerationChunk(request.request_id, ids[-1:], "🙂", "stop", prompt, 0, len(ids),
                                "worker-7", logprobs=entries[-1:])]

    return script


async def test_chat_logprobs_shape(client, backend, tokenizer):
    backend.script = logprob_script(tokenizer)
    ids = tokenizer.encode("Hi🙂")
    body = {"messages": HELLO, "logprobs": True, "top_logprobs": 2}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) >= 3  # the emoji is split over byte tokens
    assert content[0]["token"] == "Hi" and content[0]["logprob"] == -0.25
    assert content[0]["bytes"] == list(b"Hi")
    assert b"".join(bytes(c["bytes"]) for c in content) == "Hi🙂".encode()
    assert "\ufffd" in content[1]["token"]  # part of a character: its text is U+FFFD ...
    assert bytes(content[1]["bytes"])[0] == "🙂".encode()[0]  # ... its bytes are exact
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.25, -3.0]
    assert content[0]["top_logprobs"][1] == {"token": ".", "logprob": -3.0, "bytes": [46]}
    # Streaming: the same entries, spread over the content deltas.
    response = await client.post(CHAT, json={**body, "stream": True})
    events = sse_events(response)[:-1]
    streamed = [e for ev in events for e in ((ev["choices"][0].get("logprobs") or {})
                                             .get("content") or [])]
    assert streamed == content


async def test_completion_logprobs_shape(client, backend, tokenizer):
    backend.script = logprob_script(tokenizer)
    ids = tokenizer.encode("Hi🙂")
    response = await client.post(COMPLETIONS, json={"prompt": "x", "logprobs": 1})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"][0] == "Hi" and len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"] == [-0.25 * (i + 1) for i in range(len(ids))]
    assert logprobs["top_logprobs"][0] == {"Hi": -0.25, ".": -3.0}
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(ids))]
    response = await client.post(COMPLETIONS, json={"prompt": "x", "logprobs": 1,
                                                    "stream": True})
    events = sse_events(response)[:-1]
    offsets = [o for ev in events for o in ((ev["choices"][0]["logprobs"] or {})
                                            .get("text_offset") or [])]
    assert offsets == logprobs["text_offset"]


async def test_n_choices_answer_and_usage(client, backend):
    backend.script = two_choices
    response = await client.post(CHAT, json={"messages": HELLO, "n": 2})
    body = response.json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in body["choices"]] == [(0, "ABC", "stop"), (1, "xy", "length")]
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    body = {"prompt": "x", "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post(COMPLETIONS, json=body)
    *events, usage, done = sse_events(response)
    texts = {0: "", 1: ""}
    finishes = {}
    for event in events:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "ABC", 1: "xy"} and finishes == {0: "stop", 1: "length"}
    assert usage["usage"]["completion_tokens"] == 5


# -- request validation ------------------------------------------------------------------------

LONG = "word " * 200  # well over MAX_MODEL_LEN tokens

INVALID = [
    # path, body, status, param, code
    (CHAT, {}, 400, "messages", "missing_required_parameter"),
    (CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    (CHAT, {"messages": HELLO, "bogus": 1}, 400, "bogus", "unknown_parameter"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "x": 1}]}, 400, "messages[0].x",
     "unknown_parameter"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content",
     "missing_required_parameter"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages[0].content", "unsupported_content_type"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_type"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role",
     "unsupported_value"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": 5}]}, 400,
     "messages[0].name", "invalid_type"),
    (CHAT, {"messages": HELLO, "model": "gpt-4"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": HELLO, "temperature": 3}, 400, "temperature", "invalid_value"),
    (CHAT, {"messages": HELLO, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    (CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p", "invalid_value"),
    (CHAT, {"messages": HELLO, "top_k": -2}, 400, "top_k", "invalid_value"),
    (CHAT, {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"messages": HELLO, "max_tokens": True}, 400, "max_tokens", "invalid_type"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 5, "max_tokens": 6}, 400, "max_tokens",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "stop": [""]}, 400, "stop", "invalid_value"),
    (CHAT, {"messages": HELLO, "stop_token_ids": [49152]}, 400, "stop_token_ids",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "seed": 2**64}, 400, "seed", "invalid_value"),
    (CHAT, {"messages": HELLO, "cache_salt": ""}, 400, "cache_salt", "invalid_value"),
    (CHAT, {"messages": HELLO, "n": 129}, 400, "n", "invalid_value"),
    (CHAT, {"messages": HELLO, "n": 0}, 400, "n", "invalid_value"),
    (CHAT, {"messages": HELLO, "logprobs": 1}, 400, "logprobs", "invalid_type"),
    (CHAT, {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "min_p": 1.5}, 400, "min_p", "invalid_value"),
    (CHAT, {"messages": HELLO, "repetition_penalty": 0}, 400, "repetition_penalty",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "min_tokens": 5, "max_tokens": 3}, 400, "min_tokens",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "min_tokens": MAX_MODEL_LEN}, 400, "min_tokens",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "unsupported_parameter"),
    (CHAT, {"messages": HELLO, "tool_choice": "auto"}, 400, "tool_choice",
     "unsupported_parameter"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "json_object"}}, 400,
     "response_format", "unsupported_parameter"),
    (CHAT, {"messages": HELLO, "logit_bias": {"one": 5}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": HELLO, "logit_bias": {"49152": 5}}, 400, "logit_bias",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "logit_bias": {"7": 100.5}}, 400, "logit_bias",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "presence_penalty": 2.5}, 400, "presence_penalty",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "frequency_penalty": -3}, 400, "frequency_penalty",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_value"),
    (CHAT, {"messages": HELLO, "stream": True, "stream_options": {"x": True}}, 400,
     "stream_options.x", "unknown_parameter"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": MAX_MODEL_LEN}, 400,
     "max_completion_tokens", "context_length_exceeded"),
    (COMPLETIONS, {}, 400, "prompt", "missing_required_parameter"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, 400, "prompt", "unsupported_value"),
    (COMPLETIONS, {"prompt": [1, True]}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": [1, 49152]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": [-1, 5]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": 7}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": [1] * 100, "max_tokens": 29}, 400, "max_tokens",
     "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "x", "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "x", "suffix": "!"}, 400, "suffix", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, 400, "logprobs", "invalid_type"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"-1": 1}}, 400, "logit_bias",
     "invalid_value"),
    (COMPLETIONS, {"prompt": "x", "messages": HELLO}, 400, "messages", "unknown_parameter"),
    (COMPLETIONS, {"prompt": "x", "model": "other"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), INVALID,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{c}-{pa}" for p, _, _, pa, c in INVALID])
async def test_invalid_requests_are_refused_by_name(client, backend, path, body, status, param,
                                                    code):
    response = await client.post(path, json=body)
    assert_error(response, status, param, code)
    assert backend.requests == []


@pytest.mark.parametrize(("path", "body", "message"), [
    (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21},
     "top_logprobs must be in [0, 20]"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 0},
     "max_completion_tokens must be at least 1"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs must be in [0, 20]"),
])
async def test_a_refusal_message_names_the_field_the_client_sent(client, path, body, message):
    response = await client.post(path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message


@pytest.mark.parametrize(("path", "field", "param"), [
    (COMPLETIONS, '"prompt": "\\udc00 x"', "prompt"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud800 lone"}]',
     "messages"),
])
async def test_text_the_tokenizer_rejects_is_a_400(client, backend, path, field, param):
    # Case R6: a lone UTF-16 surrogate is valid JSON but no tokenizer can encode it.
    response = await client.post(path, content=("{" + field + ', "max_tokens": 2}').encode(),
                                 headers={"content-type": "application/json"})
    assert_error(response, 400, param, "invalid_value")
    assert backend.requests == []
    ok = await client.post(COMPLETIONS, json={"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200


async def test_prompt_exactly_filling_the_context_with_output_is_accepted(client, backend):
    response = await client.post(COMPLETIONS, json={"prompt": [1] * 100, "max_tokens": 28})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("content", "headers"), [
    (b'{"prompt": "x"', {"content-type": "application/json"}),
    (b"", {"content-type": "application/json"}),
    (b"[1, 2]", {"content-type": "application/json"}),
    (b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}),
])
async def test_malformed_bodies(client, backend, content, headers):
    response = await client.post(COMPLETIONS, content=content, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert error["code"] in ("invalid_json", "invalid_type", "missing_required_parameter")
    assert backend.requests == []


async def test_malformed_json_code(client):
    response = await client.post(COMPLETIONS, content=b'{"prompt": ',
                                 headers={"content-type": "application/json"})
    assert_error(response, 400, None, "invalid_json")


# -- backend errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_invalid_request_from_the_backend_is_a_400(client, backend, stream):
    backend.script = lambda request: [InvalidRequestError("adapter unknown", "model", "bad_x")]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": stream})
    assert_error(response, 400, "model", "bad_x")
    assert backend.closed == [backend.requests[0].request_id]


@pytest.mark.parametrize(("status", "error_type"), [(503, "server_error"),
                                                    (429, "rate_limit_error")])
@pytest.mark.parametrize("stream", [False, True])
async def test_overload_is_refused_with_retry_after(client, backend, stream, status, error_type):
    overload = OverloadedError("queues full", retry_after_s=2.5, status_code=status)
    backend.script = lambda request: [overload]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": stream})
    assert_error(response, status, None, "overloaded", error_type)
    assert response.headers["retry-after"] == "3"


@pytest.mark.parametrize("stream", [False, True])
async def test_unexpected_backend_failure_before_output_is_a_500(client, backend, stream):
    backend.script = lambda request: [RuntimeError("boom: internal detail")]
    response = await client.post(COMPLETIONS, json={"prompt": "x", "stream": stream})
    error = assert_error(response, 500, None, "internal_error", "server_error")
    assert "internal detail" not in error["message"]


async def test_failure_mid_stream_is_an_error_event_then_done(client, backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      RuntimeError("worker died")]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert events[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert backend.closed == [backend.requests[0].request_id]


async def test_failure_mid_answer_without_streaming_is_a_500(client, backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      RuntimeError("worker died")]
    response = await client.post(CHAT, json={"messages": HELLO})
    assert_error(response, 500, None, "internal_error", "server_error")
    assert response.headers[WORKER_HEADER] == "worker-7"


async def test_abort_is_a_retryable_error_not_a_finished_answer(client, backend):
    backend.script = lambda request: [chunk(request, "Hel", completion=1),
                                      chunk(request, "", "abort", completion=1)]
    response = await client.post(CHAT, json={"messages": HELLO})
    assert_error(response, 503, None, "request_aborted", "server_error")
    assert "retry-after" in response.headers
    streamed = await client.post(CHAT, json={"messages": HELLO, "stream": True})
    events = sse_events(streamed)
    assert events[-2]["error"]["code"] == "request_aborted"
    assert not any(e["choices"][0].get("finish_reason") for e in events[:-2])


@pytest.mark.parametrize("stream", [False, True])
async def test_stream_ending_without_finish_is_an_error(client, backend, stream):
    backend.script = lambda request: [chunk(request, "Hel", completion=1)]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": stream})
    if stream:
        assert sse_events(response)[-2]["error"]["code"] == "internal_error"
    else:
        assert_error(response, 500, None, "internal_error", "server_error")


# -- models, health, routes --------------------------------------------------------------------


async def test_models(client):
    response = await client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model" and body["data"][0]["owned_by"]
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
    assert_error(await client.get("/v1/models/other"), 404, "model", "model_not_found")


@pytest.mark.parametrize(("ready", "status"), [(True, 200), (False, 503),
                                               (RuntimeError("no replicas"), 503)])
async def test_health(client, backend, ready, status):
    backend.ready = ready
    assert (await client.get("/health")).status_code == status


async def test_unknown_route_is_openai_shaped(client):
    assert_error(await client.get("/v1/nothing"), 404, None, "not_found")
    assert_error(await client.get(CHAT), 405, None, "method_not_allowed")


# -- concurrency and disconnects ---------------------------------------------------------------


async def test_bad_request_beside_a_good_one_does_not_disturb_it(client, backend):
    gate = asyncio.Event()
    backend.script = lambda request: [chunk(request), gate, *hello_world(request)[1:]]
    good = asyncio.create_task(client.post(CHAT, json={"messages": HELLO}))
    await asyncio.wait_for(backend.waiting.wait(), 5)
    bad = await client.post(CHAT, json={"messages": HELLO, "temperature": -1})
    assert_error(bad, 400, "temperature", "invalid_value")
    gate.set()
    response = await asyncio.wait_for(good, 5)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"
    assert len(backend.requests) == 1


async def test_concurrent_requests_each_get_their_own_answer(client, backend):
    backend.script = lambda request: [chunk(request, request.request_id, "stop", completion=1)]
    responses = await asyncio.gather(*(client.post(COMPLETIONS, json={"prompt": f"p{i}"})
                                       for i in range(8)))
    for response in responses:
        body = response.json()
        assert body["choices"][0]["text"] == body["id"]


def asgi_call(app: Any, path: str, body: dict[str, Any],
              disconnect_when: Callable[[list[dict[str, Any]]], bool] = lambda sent: False,
              stall_headers: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    """One call of the ASGI app as a server would make it: the coroutine to run and the list
    of messages the app sends.

    The client is reported gone (``http.disconnect``) once ``disconnect_when(sent)`` holds.
    With ``stall_headers``, sending the response start never completes (a dead connection), so
    the body is never iterated.
    """
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    messages = iter([{"type": "http.request", "body": json.dumps(body).encode(),
                      "more_body": False}])

    async def receive() -> dict[str, Any]:
        message = next(messages, None)
        if message is not None:
            return message
        while not disconnect_when(sent):
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if stall_headers and message["type"] == "http.response.start":
            await asyncio.Event().wait()

    return app(scope, receive, send), sent


async def call_until_disconnect(app: Any, path: str, body: dict[str, Any],
                                disconnect_when: Callable[[list[dict[str, Any]]], bool],
                                stall_headers: bool = False) -> list[dict[str, Any]]:
    """Runs :func:`asgi_call` to its end (which must come soon after the disconnect)."""
    call, sent = asgi_call(app, path, body, disconnect_when, stall_headers)
    await asyncio.wait_for(call, 5)
    return sent


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_waiting_for_the_first_chunk_closes_the_backend(backend, stream):
    backend.script = lambda request: [asyncio.Event()]  # queued forever
    app = build_openai_app(backend)
    waiting = backend.waiting
    await call_until_disconnect(app, CHAT, {"messages": HELLO, "stream": stream},
                                lambda sent: waiting.is_set())
    assert backend.closed == [backend.requests[0].request_id]


async def test_disconnect_mid_answer_closes_the_backend(backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      asyncio.Event()]
    app = build_openai_app(backend)
    waiting = backend.waiting
    await call_until_disconnect(app, CHAT, {"messages": HELLO}, lambda sent: waiting.is_set())
    assert backend.closed == [backend.requests[0].request_id]


async def test_disconnect_mid_stream_closes_the_backend(backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      asyncio.Event()]
    app = build_openai_app(backend)

    def got_text(sent: list[dict[str, Any]]) -> bool:
        return any(b"Hel" in message.get("body", b"") for message in sent)

    sent = await call_until_disconnect(app, CHAT, {"messages": HELLO, "stream": True}, got_text)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (WORKER_HEADER.encode(), b"worker-7") in sent[0]["headers"]
    assert backend.closed == [backend.requests[0].request_id]


async def test_disconnect_while_sending_stream_headers_closes_the_backend(backend):
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1)]
    app = build_openai_app(backend)

    def headers_sent(sent: list[dict[str, Any]]) -> bool:
        return any(message["type"] == "http.response.start" for message in sent)

    await call_until_disconnect(app, CHAT, {"messages": HELLO, "stream": True}, headers_sent,
                                stall_headers=True)
    assert backend.closed == [backend.requests[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
async def test_cancelled_request_task_closes_the_backend(backend, stream):
    """Ray Serve reports a disconnected client by cancelling the replica's request task."""
    backend.script = lambda request: [chunk(request), chunk(request, "Hel", completion=1),
                                      asyncio.Event()]
    call, _ = asgi_call(build_openai_app(backend), CHAT, {"messages": HELLO, "stream": stream})
    task = asyncio.ensure_future(call)
    await asyncio.wait_for(backend.waiting.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert backend.closed == [backend.requests[0].request_id]


async def test_cached_tokens_sent_once_still_reach_usage(client, backend):
    backend.script = lambda request: [chunk(request, cached=32),
                                      chunk(request, "Hi", "stop", completion=1, cached=0)]
    response = await client.post(COMPLETIONS, json={"prompt": "x"})
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


async def test_nulls_mean_not_given(client, backend):
    body = {"prompt": "x", "stream": None, "ignore_eos": None, "temperature": None,
            "stop": None, "n": None, "model": None, "logprobs": None}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert backend.requests[0].sampling.temperature == 1.0


async def test_unexpected_ingress_failure_is_an_openai_shaped_500(backend):
    class BrokenTokenizer:
        def __len__(self) -> int:
            return 49152

        def encode(self, text: str) -> list[int]:
            raise RuntimeError("tokenizer broke")

    backend.tokenizer = BrokenTokenizer()
    transport = httpx.ASGITransport(app=build_openai_app(backend), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post(COMPLETIONS, json={"prompt": "x"})
    assert_error(response, 500, None, "internal_error", "server_error")
    assert backend.requests == []


def test_openapi_schema_builds(backend):
    schema = build_openai_app(backend).openapi()
    assert "/v1/chat/completions" in schema["paths"]


async def test_backend_may_load_its_tokenizer_after_the_app_is_built(tokenizer):
    """The Ray ingress builds the app at import time and loads the tokenizer in ``__init__``."""
    backend = FakeBackend(tokenizer=None)
    app = build_openai_app(backend)
    backend.tokenizer = tokenizer
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post(COMPLETIONS, json={"prompt": [1, 2, 3]})
    assert response.status_code == 200, response.text
