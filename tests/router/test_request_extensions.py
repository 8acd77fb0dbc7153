"""Request extensions that vLLM-targeted clients send (README, "Request extensions"): the ones
implemented change what they say, the accepted ones change nothing, the refused ones are a 400
naming the field. Through the real app with the scripted fake backend of ``openai_fakes``."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest
from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    MODEL,
    WEATHER,
    FakeBackend,
    assert_error,
    chunk,
    expected_digests,
    sse_events,
)

PROMPT = list(range(1, 41))  # 40 token ids, two full 16-token blocks
BASE = {CHAT: {"messages": HELLO, "max_tokens": 4}, COMPLETIONS: {"prompt": PROMPT,
                                                                  "max_tokens": 4}}

# -- implemented -------------------------------------------------------------------------------


async def test_truncate_prompt_tokens_keeps_the_last_tokens(client, backend):
    response = await client.post(COMPLETIONS, json={"prompt": PROMPT, "truncate_prompt_tokens": 20})
    assert response.status_code == 200, response.text
    request = backend.requests[0]
    assert request.token_ids == PROMPT[-20:]
    assert request.prompt_digests.digests == expected_digests(PROMPT[-20:], None)
    assert len(request.prompt_digests.digests) == 1
    assert response.json()["usage"]["prompt_tokens"] == 20
    response = await client.post(COMPLETIONS, json={"prompt": [1, 2, 3],
                                                    "truncate_prompt_tokens": 10})
    assert backend.requests[1].token_ids == [1, 2, 3]


@pytest.mark.parametrize(("fields", "kept"), [({"max_tokens": 28}, 100), ({}, 127),
                                              ({"max_tokens": 0, "echo": True}, 127)])
async def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_leaves(
        client, backend, fields, kept):
    """vLLM's -1: the prompt's last tokens, as many as the 128-token context holds beside the
    output (beside one token where max_tokens is unset, or 0 for an echo's scoring)."""
    prompt = list(range(1, 301))
    body = {"prompt": prompt, "truncate_prompt_tokens": -1, **fields}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert backend.requests[0].token_ids == prompt[-kept:]
    assert backend.requests[0].sampling.max_tokens == fields.get("max_tokens", 128 - kept)


@pytest.mark.parametrize("max_tokens", [128, 9000])
async def test_truncate_prompt_tokens_minus_one_beside_a_max_tokens_filling_the_context(
        client, backend, max_tokens):
    body = {"prompt": list(range(1, 301)), "truncate_prompt_tokens": -1,
            "max_tokens": max_tokens}
    error = assert_error(await client.post(COMPLETIONS, json=body), 400, "max_tokens",
                         "context_length_exceeded")
    assert error["message"] == (f"max_tokens ({max_tokens}) leaves no room for the prompt in "
                                "the 128-token context")


async def test_truncate_prompt_tokens_applies_to_the_templated_chat(client, backend, tokenizer):
    response = await client.post(CHAT, json={"messages": HELLO, "truncate_prompt_tokens": 5})
    assert response.status_code == 200, response.text
    full = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True)
    assert backend.requests[0].token_ids == list(full["input_ids"])[-5:]


@pytest.mark.parametrize(("path", "prefix"), [(CHAT, "chatcmpl-"), (COMPLETIONS, "cmpl-")])
async def test_request_id_names_the_answer_but_not_the_worker_request(client, backend, path,
                                                                      prefix):
    body = {**BASE[path], "request_id": "bench-0042"}
    answers = await asyncio.gather(client.post(path, json=body), client.post(path, json=body))
    assert [a.json()["id"] for a in answers] == [f"{prefix}bench-0042"] * 2
    internal = [request.request_id for request in backend.requests]
    assert len(set(internal)) == 2 and all(i.startswith(prefix) for i in internal)
    assert f"{prefix}bench-0042" not in internal  # two clients' ids may collide; ours may not
    *chunks, _ = sse_events(await client.post(path, json={**body, "stream": True}))
    assert {chunk["id"] for chunk in chunks} == {f"{prefix}bench-0042"}


async def test_add_generation_prompt_false(client, backend, tokenizer):
    response = await client.post(CHAT, json={"messages": HELLO, "add_generation_prompt": False})
    assert response.status_code == 200, response.text
    expected = tokenizer.apply_chat_template(HELLO, add_generation_prompt=False, tokenize=True)
    assert backend.requests[0].token_ids == list(expected["input_ids"])
    opened = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True)
    assert list(expected["input_ids"]) != list(opened["input_ids"])


async def test_continue_final_message(client, backend, tokenizer):
    messages = [*HELLO, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    expected = tokenizer.apply_chat_template(messages, continue_final_message=True,
                                             add_generation_prompt=False, tokenize=True)
    ids = list(expected["input_ids"])
    assert backend.requests[0].token_ids == ids
    assert tokenizer.decode(ids).endswith("The answer is")
    response = await client.post(CHAT, json={"messages": messages, "continue_final_message": True})
    assert_error(response, 400, "continue_final_message", "invalid_value")


class RecordingTokenizer:
    """The real tokenizer, recording the keyword arguments of each chat-template call."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.template_calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def apply_chat_template(self, conversation: Any, tools: Any = None, documents: Any = None,
                            chat_template: Any = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> Any:
        self.template_calls.append(kwargs)
        return self._tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=tokenize, **kwargs)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stop_reason", ["\n\nThe", 30, None])
async def test_stop_reason_names_the_stop_that_ended_the_choice(client, backend, path,
                                                                stop_reason):
    """vLLM's ``stop_reason`` on the last choice, streamed or not: the worker's stop string or
    stop token id, null for EOS; null on every earlier chunk."""
    backend.script = lambda request: [
        chunk(request), chunk(request, "Paris", completion=1),
        replace(chunk(request, ".", "stop", completion=2), stop_reason=stop_reason)]
    response = await client.post(path, json=BASE[path])
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_reason)
    response = await client.post(path, json={**BASE[path], "stream": True})
    *events, _ = sse_events(response)
    ends = [(c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) for c in events]
    assert ends == [(None, None)] * (len(events) - 1) + [("stop", stop_reason)]


async def test_chat_template_kwargs_reach_the_template(client, backend, tokenizer):
    backend.tokenizer = RecordingTokenizer(tokenizer)
    variables = {"enable_thinking": False, "custom": [1, "two"]}
    response = await client.post(CHAT, json={"messages": HELLO, "chat_template_kwargs": variables})
    assert response.status_code == 200, response.text
    assert backend.tokenizer.template_calls == [variables]
    plain = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True)
    assert backend.requests[0].token_ids == list(plain["input_ids"])  # SmolLM2 uses neither


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "tools", "messages"])
async def test_chat_template_kwargs_cannot_override_arguments(client, backend, key):
    response = await client.post(CHAT, json={"messages": HELLO,
                                             "chat_template_kwargs": {key: False}})
    error = assert_error(response, 400, "chat_template_kwargs", "invalid_value")
    assert f"'{key}'" in error["message"]
    assert backend.requests == []


# -- accepted: no effect on what the worker is asked --------------------------------------------

ACCEPTED = [
    # path, field, value: each sent alone on top of BASE[path]
    (CHAT, "user", "user-17"),
    (CHAT, "safety_identifier", "hash-17"),
    (CHAT, "metadata", {"experiment": "a"}),
    (CHAT, "store", True),
    (CHAT, "service_tier", "flex"),
    (CHAT, "priority", 5),
    (CHAT, "parallel_tool_calls", True),
    (CHAT, "prompt_cache_key", "tenant-a"),
    (CHAT, "spaces_between_special_tokens", False),
    (CHAT, "skip_special_tokens", True),
    (CHAT, "include_stop_str_in_output", False),
    (CHAT, "echo", False),
    (CHAT, "add_special_tokens", False),
    (CHAT, "add_generation_prompt", True),
    (CHAT, "continue_final_message", False),
    (CHAT, "bad_words", []),
    (CHAT, "response_format", {"type": "text"}),
    (CHAT, "tools", []),
    (CHAT, "use_beam_search", False),
    (CHAT, "stream", False),
    (COMPLETIONS, "user", "user-17"),
    (COMPLETIONS, "priority", -1),
    (COMPLETIONS, "metadata", {}),
    (COMPLETIONS, "spaces_between_special_tokens", True),
    (COMPLETIONS, "skip_special_tokens", True),
    (COMPLETIONS, "include_stop_str_in_output", False),
    (COMPLETIONS, "add_special_tokens", True),
    (COMPLETIONS, "return_tokens_as_token_ids", False),
    (COMPLETIONS, "echo", False),
]


@pytest.mark.parametrize(("path", "field", "value"), ACCEPTED,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}" for p, f, _ in ACCEPTED])
async def test_accepted_extension_changes_nothing(client, backend, path, field, value):
    plain = await client.post(path, json=BASE[path])
    extended = await client.post(path, json={**BASE[path], field: value})
    assert extended.status_code == 200, extended.text
    (_, without), (_, with_it) = [(r.request_id, r) for r in backend.requests]
    assert (with_it.token_ids, with_it.sampling, with_it.prompt_digests.digests) == (
        without.token_ids, without.sampling, without.prompt_digests.digests)
    assert extended.json()["choices"] == plain.json()["choices"]


async def test_vllm_sampling_extensions_reach_the_worker(client, backend):
    body = {"messages": HELLO, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "min_tokens": 2, "ignore_eos": True, "max_completion_tokens": 8,
            "stop_token_ids": [2], "seed": 3, "stop": ["\n"], "include_stop_str_in_output": True,
            "allowed_token_ids": [5, 6], "skip_special_tokens": False}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    sampling = backend.requests[0].sampling
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty, sampling.min_tokens,
            sampling.ignore_eos, sampling.max_tokens, sampling.stop_token_ids, sampling.seed,
            sampling.stop, sampling.include_stop_str_in_output, sampling.allowed_token_ids,
            sampling.skip_special_tokens) == (20, 0.05, 1.1, 2, True, 8, [2], 3, ["\n"], True,
                                              [5, 6], False)


# -- output constraints: every spelling reaches the worker as one StructuredOutput ------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CONSTRAINTS = [
    (CHAT, {"response_format": {"type": "json_object"}}, ("json", '{"type": "object"}')),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, ("json", json.dumps(SCHEMA))),
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, ("json", '{"type": "object"}')),
    (CHAT, {"structured_outputs": {"json": SCHEMA}}, ("json", json.dumps(SCHEMA))),
    (CHAT, {"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
    (CHAT, {"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
    (CHAT, {"structured_outputs": {"grammar": "start: \"a\""}}, ("grammar", 'start: "a"')),
    (CHAT, {"guided_json": json.dumps(SCHEMA)}, ("json", json.dumps(SCHEMA))),
    (CHAT, {"guided_regex": "[0-9]+", "guided_decoding_backend": "auto"}, ("regex", "[0-9]+")),
    (COMPLETIONS, {"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
    (CHAT, {"response_format": {"type": "text"}}, None),
]


@pytest.mark.parametrize(("path", "fields", "expected"), CONSTRAINTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _, _)
                              in enumerate(CONSTRAINTS)])
async def test_output_constraints_reach_the_worker(client, backend, path, fields, expected):
    response = await client.post(path, json={**BASE[path], **fields})
    assert response.status_code == 200, response.text
    structured = backend.requests[0].sampling.structured
    assert (None if structured is None else (structured.kind, structured.spec)) == expected


MALFORMED = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize(("fields", "param"), MALFORMED,
                         ids=[f"malformed-{i}" for i in range(len(MALFORMED))])
async def test_a_malformed_constraint_is_a_400_naming_its_field(client, fields, param):
    response = await client.post(CHAT, json={**BASE[CHAT], **fields})
    assert_error(response, 400, param, "invalid_value")


# -- refused: they would change the output -------------------------------------------------------

REFUSED = [
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "structural_tag", "{}"),
    (CHAT, "guided_decoding_backend", "xgrammar"),
    (CHAT, "logits_processors", ["my.Processor"]),
    (CHAT, "use_beam_search", True),
    (CHAT, "add_special_tokens", True),
    (COMPLETIONS, "add_special_tokens", False),
    (CHAT, "chat_template", "{{ messages }}"),
    (CHAT, "documents", [{"title": "t", "text": "x"}]),
    (CHAT, "best_of", 2),
    (CHAT, "mm_processor_kwargs", {"num_crops": 4}),
    (CHAT, "kv_transfer_params", {"do_remote_prefill": True}),
    (CHAT, "vllm_xargs", {"x": 1}),
]


@pytest.mark.parametrize(("path", "field", "value"), REFUSED,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{i}" for i, (p, f, _)
                              in enumerate(REFUSED)])
async def test_refused_extension_is_a_400_naming_it(client, backend, path, field, value):
    response = await client.post(path, json={**BASE[path], field: value})
    error = assert_error(response, 400, field, "unsupported_parameter")
    assert f"{field} is not supported by this server" in error["message"]
    assert backend.requests == []


@pytest.mark.parametrize(("field", "value", "code"), [
    ("truncate_prompt_tokens", 0, "invalid_value"),
    ("truncate_prompt_tokens", -2, "invalid_value"),
    ("request_id", "", "invalid_value"),
    ("request_id", "x" * 257, "invalid_value"),
    ("priority", "high", "invalid_type"),
    ("service_tier", "gold", "invalid_value"),
    ("metadata", {"a": 1}, "invalid_type"),
    ("include_stop_str_in_output", "sometimes", "invalid_type"),
    ("chat_template_kwargs", ["enable_thinking"], "invalid_type"),
])
async def test_malformed_extension_values(client, backend, field, value, code):
    response = await client.post(CHAT, json={"messages": HELLO, field: value})
    param = f"{field}.a" if field == "metadata" else field
    assert_error(response, 400, param, code)


async def test_openai_sdk_extra_body_passes(tokenizer):
    """The official SDK as a user drives it: vLLM fields in ``extra_body`` and GuideLLM's
    ``stream_options``."""
    openai = pytest.importorskip("openai")
    import httpx

    from router.api.app import build_openai_app

    backend = FakeBackend(tokenizer)
    transport = httpx.ASGITransport(app=build_openai_app(backend))
    async with httpx.AsyncClient(transport=transport) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-a", http_client=http)
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=HELLO, max_completion_tokens=2, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"top_k": 5, "ignore_eos": True, "request_id": "sdk-1"})
        chunks = [chunk async for chunk in stream]
    assert {chunk.id for chunk in chunks} == {"chatcmpl-sdk-1"}
    assert [chunk.usage.completion_tokens for chunk in chunks] == [0, 1, 2, 2, 2]
    sampling = backend.requests[0].sampling
    assert (sampling.top_k, sampling.ignore_eos, sampling.max_tokens) == (5, True, 2)


async def test_bad_words_reach_the_worker_tokenized_as_vllm_does(client, backend, tokenizer):
    response = await client.post(CHAT, json={"messages": HELLO,
                                             "bad_words": ["Paris", " hello world", "  "]})
    assert response.status_code == 200, response.text

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # Each word as written and, where it is as many other tokens, after a space; a blank
    # word bans nothing.
    assert ids("Paris") != ids(" Paris") and len(ids("Paris")) == len(ids(" Paris"))
    assert backend.requests[0].sampling.bad_words_token_ids == [
        ids("Paris"), ids(" Paris"), ids("hello world"), ids(" hello world")]


@pytest.mark.parametrize("field", [{"allowed_token_ids": [5, 6]}, {"bad_words": ["Paris"]}])
@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_object"}},
    {"tools": [WEATHER], "tool_choice": "required"}], ids=["json", "tools"])
async def test_token_bans_beside_a_grammar_are_refused(client, backend, field, constraint):
    """The two together could leave no token to draw, which the grammar would reject
    mid-step (failing the step for every request in it)."""
    backend.max_model_len = 1024  # room for the tools' system prompt
    response = await client.post(CHAT, json={"messages": HELLO, **field, **constraint})
    assert_error(response, 400, next(iter(field)), "invalid_value")
    assert backend.requests == []
