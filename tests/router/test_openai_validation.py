"""Request validation of the OpenAI-compatible HTTP layer: every refusal is an OpenAI-shaped
error naming the parameter the client sent, and reaches no worker."""

from __future__ import annotations

import gzip

import pytest
from helpers import count_calls
from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    MAX_MODEL_LEN,
    assert_error,
)

from contract.request import SamplingParams

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
    (CHAT, {"messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role",
     "unsupported_value"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]",
     "invalid_value"),
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
    (CHAT, {"messages": HELLO, "allowed_token_ids": [7, 49152]}, 400, "allowed_token_ids",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "allowed_token_ids": []}, 400, "allowed_token_ids",
     "invalid_value"),
    (CHAT, {"messages": HELLO, "allowed_token_ids": "7"}, 400, "allowed_token_ids",
     "invalid_type"),
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
    (CHAT, {"messages": HELLO, "functions": [{"name": "f"}]}, 400, "functions",
     "unsupported_parameter"),
    (CHAT, {"messages": HELLO, "tool_choice": "auto"}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "xml"}}, 400,
     "response_format", "invalid_value"),
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
    (COMPLETIONS, {"prompt": ["a", [1, 2]]}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": [[1, 2], "a"]}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": [["a"]]}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": [1, [2]]}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": ["a"] * 129}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": [1, True]}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": [1, 49152]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": [-1, 5]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": 7}, 400, "prompt", "invalid_type"),
    (COMPLETIONS, {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": [1] * 100, "max_tokens": 29}, 400, "max_tokens",
     "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "x", "echo": "yes"}, 400, "echo", "invalid_type"),
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


async def test_a_context_refusal_names_the_limit_the_client_sent(client):
    response = await client.post(CHAT, json={"messages": HELLO, "max_completion_tokens": 1000})
    assert_error(response, 400, "max_completion_tokens", "context_length_exceeded")
    assert "max_completion_tokens asks for 1000 more" in response.json()["error"]["message"]


@pytest.mark.parametrize("limit", [{"max_tokens": 5}, {}])
async def test_a_request_is_validated_once_at_the_ingress(client, backend, monkeypatch, limit):
    """The sampling ranges and the context are each checked once, whether the output limit
    is the client's or defaults to the rest of the context."""
    calls = count_calls(monkeypatch, SamplingParams, ["validate", "check_context"])
    response = await client.post(CHAT, json={"messages": HELLO, **limit})
    assert response.status_code == 200, response.text
    assert calls == {"validate": 1, "check_context": 1}
    assert len(backend.requests) == 1


@pytest.mark.parametrize(("path", "field", "param", "where"), [
    (COMPLETIONS, '"prompt": "\\udc00 x"', "prompt", "prompt holds an unpaired UTF-16 "
     "surrogate (\\udc00 at character 0)"),
    ("/v1/chat/completions",
     '"messages": [{"role": "user", "content": [{"type": "text", "text": "a \\ud83d\\ude00 '
     '\\ud800 lone"}]}]', "messages", "messages[0].content holds an unpaired UTF-16 "
     "surrogate (\\ud800 at character 4)"),
    ("/v1/chat/completions",
     '"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     '"function": {"name": "f", "description": "x\\udbff", "parameters": {}}}]', "tools",
     "tools[0].function.description holds an unpaired UTF-16 surrogate (\\udbff at "
     "character 1)"),
])
async def test_text_the_tokenizer_rejects_is_a_400(client, backend, path, field, param, where):
    # Case R6: a lone UTF-16 surrogate is valid JSON but no tokenizer can encode it; a pair
    # (the emoji) decodes to one character and is fine. The message names the string's place.
    response = await client.post(path, content=("{" + field + ', "max_tokens": 2}').encode(),
                                 headers={"content-type": "application/json"})
    error = assert_error(response, 400, param, "invalid_value")
    assert error["message"].startswith(where), error
    assert backend.requests == []
    ok = await client.post(COMPLETIONS, json={"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, lambda text: {"prompt": text}, "prompt"),
    ("/v1/chat/completions",
     lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
])
async def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(
        client, backend, monkeypatch, path, body, param):
    """More characters than the context's tokens of the longest token's text can hold: a
    400 at once, the tokenizer never called (a 20 MB prompt took 26 s to tokenize, holding
    back every other request's tokenizing); with truncate_prompt_tokens it is tokenized and
    served."""
    from router.api.prompts import longest_token_characters

    longest = longest_token_characters(backend.tokenizer)
    text = "ab " * (MAX_MODEL_LEN * longest // 3 + 1) + "ab"  # no whitespace at its ends
    called = []
    monkeypatch.setattr(backend.tokenizer, "encode", lambda *a, **k: called.append(1))
    monkeypatch.setattr(backend.tokenizer, "apply_chat_template",
                        lambda *a, **k: called.append(1))
    error = assert_error(await client.post(path, json=body(text)), 400, param,
                         "context_length_exceeded")
    assert f"make at least {-(-len(text) // longest)} tokens" in error["message"], error
    assert called == [] and backend.requests == []
    monkeypatch.undo()
    truncated = await client.post(path, json={**body(text), "truncate_prompt_tokens": 8})
    assert truncated.status_code == 200, truncated.text
    assert len(backend.requests[0].token_ids) == 8


async def test_a_large_texts_tokenizing_holds_no_other_request_back(client, backend,
                                                                    monkeypatch):
    """A text of more than LARGE_TEXT_CHARACTERS (here cut by truncate_prompt_tokens, which
    only its tokens can cut) is tokenized on a copy of the tokenizer of its own: while its
    tokenizing is held, a small request is tokenized and answered."""
    import asyncio
    import threading

    from router.api import jobs

    release, started = threading.Event(), threading.Event()
    large = jobs.JobBuilder._large_text_tokenizer

    def held(builder):
        tokenizer = large(builder)

        class Held:
            def encode(self, text):
                started.set()
                release.wait(30)
                return tokenizer.encode(text)
        return Held()

    monkeypatch.setattr(jobs.JobBuilder, "_large_text_tokenizer", held)
    text = "ab " * (jobs.LARGE_TEXT_CHARACTERS // 3 + 1)
    big = asyncio.create_task(client.post(COMPLETIONS, json={
        "prompt": text, "truncate_prompt_tokens": 8, "max_tokens": 2}))
    await asyncio.to_thread(started.wait, 30)
    small = await asyncio.wait_for(client.post(COMPLETIONS, json={"prompt": "Hi"}), 10)
    assert small.status_code == 200 and not big.done()
    release.set()
    assert (await big).status_code == 200
    assert [len(r.token_ids) for r in backend.requests] == [1, 8]


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


@pytest.mark.parametrize(("content", "encoding", "says"), [
    (gzip.compress(b'{"prompt": "x"}'), "gzip", "Content-Encoding 'gzip' is not supported"),
    (b'{"prompt": "\xff\xfe"}', None, "not UTF-8 text, or it nests too deeply"),
    (b"[" * 100_000 + b"]" * 100_000, None, "not UTF-8 text, or it nests too deeply"),
])
async def test_a_body_fastapi_cannot_decode_says_why(client, backend, content, encoding, says):
    """FastAPI answers these with "There was an error parsing the body" and no code."""
    headers = {"content-type": "application/json"}
    if encoding:
        headers["content-encoding"] = encoding
    error = assert_error(await client.post(COMPLETIONS, content=content, headers=headers), 400,
                         None, "invalid_json")
    assert says in error["message"], error
    assert backend.requests == []
