"""The OpenAI-compatible HTTP layer against a scripted fake backend and the real SmolLM2
tokenizer: tokenization, routing digests, tenancy, response shapes, SSE, sampling parameters,
logprobs, choices, models and health. Validation, failures and disconnects, extensions and
streamed usage have their own files."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
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
    sse_events,
    two_choices,
)

from contract.identity import CacheNamespace, tenant_from_api_key
from contract.request import (
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    TokenLogprob,
)
from router.api.app import build_openai_app
from router.api.backend import WORKER_HEADER

# -- successful answers ------------------------------------------------------------------------


async def test_chat_completion_shape_usage_and_worker_header(client, backend):
    response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
    assert response.status_code == 200, response.text
    assert response.headers[WORKER_HEADER] == "worker-7"
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                "stop_reason": None,
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
                                "finish_reason": "stop", "stop_reason": None}]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert backend.requests[0].token_ids == tokenizer.encode("Once upon")


def by_prompt_length(request):
    """A reply naming the prompt's length, so a batch's choices tell their prompts apart."""
    if len(request.token_ids) == 4:
        raise InvalidRequestError("this prompt is refused", "prompt")
    return [chunk(request), chunk(request, f"len{len(request.token_ids)}", "stop", completion=1)]


async def test_a_batch_prompt_is_a_request_per_prompt_answered_together(client, backend):
    backend.script = by_prompt_length
    body = {"prompt": [[5, 6], [7, 8, 9], [1]], "max_tokens": 3}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [
        (0, "len2"), (1, "len3"), (2, "len1")]
    assert answer["usage"]["prompt_tokens"] == 6 and answer["usage"]["completion_tokens"] == 3
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert sorted(r.token_ids for r in backend.requests) == [[1], [5, 6], [7, 8, 9]]
    assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests)
    assert response.headers[WORKER_HEADER] == "worker-7"


async def test_a_batch_prompt_with_n_numbers_each_prompts_choices_after_the_last(client,
                                                                                backend):
    backend.script = two_choices
    response = await client.post("/v1/completions", json={"prompt": [[5, 6], [7]], "n": 2})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "ABC", "stop"), (1, "xy", "length"), (2, "ABC", "stop"), (3, "xy", "length")]
    assert answer["usage"]["prompt_tokens"] == 3 and answer["usage"]["completion_tokens"] == 10


async def test_one_refused_prompt_refuses_the_batch_and_frees_the_others(client, backend):
    backend.script = by_prompt_length
    response = await client.post("/v1/completions",
                                 json={"prompt": [[5, 6], [1, 2, 3, 4]], "max_tokens": 3})
    error = assert_error(response, 400, "prompt", "invalid_value")
    assert error["message"] == "prompt 1 of the batch: this prompt is refused"
    assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests)


async def test_a_streamed_batch_prompt_numbers_each_prompts_choices_and_sums_usage(client,
                                                                                  backend):
    backend.script = two_choices
    body = {"prompt": [[5, 6], [7]], "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    *chunks, usage_chunk, done = sse_events(response)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in chunks:
        [choice] = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "ABC", 1: "xy", 2: "ABC", 3: "xy"}
    assert finishes == {0: "stop", 1: "length", 2: "stop", 3: "length"}
    assert len({event["id"] for event in chunks}) == 1
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 32}}
    assert done == "[DONE]" and response.headers[WORKER_HEADER] == "worker-7"
    assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests)


async def test_a_batch_prompt_longer_than_its_read_ahead_arrives_whole(client, backend):
    """Each prompt's stream is read at most a few chunks ahead of the merged stream's reader
    (a bounded queue): 3 prompts of 40 chunks each still arrive whole, streamed or not."""
    def forty(request):
        tag = str(len(request.token_ids))
        return [chunk(request), *(chunk(request, tag, completion=i) for i in range(1, 40)),
                chunk(request, tag, "stop", completion=40)]

    backend.script = forty
    body = {"prompt": [[5], [6, 7], [8, 9, 10]], "max_tokens": 40}
    answer = (await client.post("/v1/completions", json=body)).json()
    assert [c["text"] for c in answer["choices"]] == ["1" * 40, "2" * 40, "3" * 40]
    streamed = await client.post("/v1/completions", json={**body, "stream": True})
    texts = ["", "", ""]
    for event in sse_events(streamed)[:-1]:
        [choice] = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == ["1" * 40, "2" * 40, "3" * 40]


async def test_a_streamed_batch_refused_before_its_first_token_is_one_error(client, backend):
    backend.script = by_prompt_length
    response = await client.post("/v1/completions", json={
        "prompt": [[5, 6], [1, 2, 3, 4]], "max_tokens": 3, "stream": True})
    assert_error(response, 400, "prompt", "invalid_value")
    assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests)


async def test_a_streamed_batch_prompt_failing_mid_stream_ends_with_an_error_event(client,
                                                                                 backend):
    held = asyncio.Event()  # the healthy prompt waits here until the stream has ended

    def one_fails(request):
        if len(request.token_ids) == 1:
            return [chunk(request), chunk(request, "a", completion=1),
                    RuntimeError("the worker died")]
        return [chunk(request), chunk(request, "b", completion=1), held,
                chunk(request, "c", "stop", completion=2)]

    backend.script = one_fails
    response = await client.post("/v1/completions", json={
        "prompt": [[5, 6], [7]], "max_tokens": 3, "stream": True})
    *events, error, done = sse_events(response)
    assert error["error"]["type"] == "server_error", error
    assert sorted(backend.closed) == sorted(r.request_id for r in backend.requests)
    assert len(backend.requests) == 2 and not held.is_set()


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


async def test_the_ingress_hashes_a_prompt_once(client, backend, monkeypatch):
    """One root digest and one digest per full block of the prompt, each computed once; the
    request carries them with the model key they chain under."""
    import contract.identity

    counts = {"fields": 0, "blocks": 0}
    hash_fields, block_digest = contract.identity._hash_fields, contract.identity.block_digest

    def counted_fields(fields):
        counts["fields"] += 1
        return hash_fields(fields)

    def counted_block(parent, tokens):
        counts["blocks"] += 1
        return block_digest(parent, tokens)

    assert IDENTITY.model_key  # computed once per identity, not per request
    monkeypatch.setattr(contract.identity, "_hash_fields", counted_fields)
    monkeypatch.setattr(contract.identity, "block_digest", counted_block)
    prompt = list(range(100, 100 + 3 * 16 + 5))
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert counts == {"fields": 1, "blocks": 3}
    digests = backend.requests[-1].prompt_digests
    assert digests.model_key == IDENTITY.model_key
    assert digests.digests == expected_digests(prompt, None)


async def test_routing_digests_follow_key_and_salt(client, backend):
    """Case R8 (salted digests): the same token ids under two tenants or two salts get
    disjoint block digests. The workers publish digests chained from the same namespaced
    identity (``test_identity.py::test_tenant_and_salt_cannot_imitate_each_other``), so what
    reaches the index differs too."""

    async def digests(key: str | None, salt: str | None = None) -> list[bytes]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"messages": HELLO, **({"cache_salt": salt} if salt else {})}
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        request = backend.requests[-1]
        assert request.prompt_digests.digests == expected_digests(request.token_ids, key, salt)
        assert request.namespace == CacheNamespace(tenant_from_api_key(key, SECRET), salt)
        assert request.namespace.tenant != key
        return request.prompt_digests.digests

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
                                        "finish_reason": "stop", "stop_reason": None}
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


NAMED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}"
                  "{% if m.get('name') %} ({{ m['name'] }}){% endif %}: {{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")
"""A chat template that renders ``name`` (SmolLM2's ignores it, so it cannot show it arrives)."""


async def test_message_name_is_accepted_and_passed_to_the_template(client, backend, tokenizer,
                                                                   monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", NAMED_TEMPLATE)
    messages = [{"role": "user", "content": "Hello there", "name": "bob"}]
    response = await client.post(CHAT, json={"messages": messages})
    assert response.status_code == 200, response.text
    named = tokenizer.decode(backend.requests[0].token_ids)
    assert named == "<|im_start|>user (bob): Hello there<|im_end|>\n<|im_start|>assistant\n"
    response = await client.post(CHAT, json={"messages": [{"role": "user",
                                                           "content": "Hello there"}]})
    assert "(bob)" not in tokenizer.decode(backend.requests[1].token_ids)


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
    head = await client.head("/health")  # load balancers' checks send HEAD
    assert (head.status_code, head.content) == (status, b"")
    # vLLM's /ping, by GET and POST
    assert [(await ping("/ping")).status_code for ping in (client.get, client.post)] == [
        status, status]


async def test_version_is_the_package_version(client):
    assert (await client.get("/version")).json() == {
        "version": importlib.metadata.version("nalar-serve")}


async def test_unknown_route_is_openai_shaped(client):
    assert_error(await client.get("/v1/nothing"), 404, None, "not_found")
    assert_error(await client.get(CHAT), 405, None, "method_not_allowed")


# -- odds and ends -----------------------------------------------------------------------------


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
