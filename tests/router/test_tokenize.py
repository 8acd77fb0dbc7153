"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the ids are exactly those the completion
routes send the worker, and the refusals name their field."""

from __future__ import annotations

import pytest
from openai_fakes import CHAT, COMPLETIONS, HELLO, MODEL, WEATHER, assert_error

from router.api.auth import ApiKeys


@pytest.fixture
def backend(backend):
    backend.max_model_len = 4096  # room for the tools' system prompt
    return backend


async def test_a_prompt_is_tokenized_as_completions_tokenize_it(client, backend, tokenizer):
    response = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                    "return_token_strs": True})
    assert response.status_code == 200, response.text
    await client.post(COMPLETIONS, json={"prompt": "Hello world", "max_tokens": 1})
    sent = backend.requests[-1].token_ids
    assert response.json() == {"count": len(sent), "max_model_len": 4096, "tokens": sent,
                               "token_strs": tokenizer.convert_ids_to_tokens(sent)}
    assert sent == [19556, 905]


@pytest.mark.parametrize("extra", [
    {}, {"tools": [WEATHER]}, {"add_generation_prompt": False, "continue_final_message": True},
])
async def test_messages_are_tokenized_as_chat_completions_render_them(client, backend, extra):
    body = {"messages": HELLO, **extra}
    response = await client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    assert (await client.post(CHAT, json={**body, "max_tokens": 1})).status_code == 200
    sent = backend.requests[-1].token_ids
    assert response.json() == {"count": len(sent), "max_model_len": 4096, "tokens": sent,
                               "token_strs": None}


async def test_detokenize_inverts_tokenize_special_tokens_included(client, tokenizer):
    tokens = (await client.post("/tokenize", json={"messages": HELLO})).json()["tokens"]
    response = await client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert response.status_code == 200, response.text
    text = response.json()["prompt"]
    assert text == tokenizer.decode(tokens)
    assert text.endswith("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("path, body, param, code", [
    ("/tokenize", {}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "Hi", "messages": HELLO}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "Hi", "tools": [WEATHER]}, "tools", "invalid_value"),
    ("/tokenize", {"prompt": "Hi", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs",
     "invalid_value"),
    # refused as /v1/completions and /v1/chat/completions refuse them
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": False}, "add_special_tokens",
     "unsupported_parameter"),
    ("/tokenize", {"messages": HELLO, "add_special_tokens": True}, "add_special_tokens",
     "unsupported_parameter"),
    ("/tokenize", {"messages": []}, "messages", "invalid_value"),
    ("/tokenize", {"prompt": "word " * 100_000}, "prompt", "context_length_exceeded"),
    ("/tokenize", {"prompt": "Hi", "suffix": "!"}, "suffix", "unknown_parameter"),
    ("/detokenize", {"tokens": [0, 49152]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]", "invalid_type"),
])
async def test_bad_bodies_are_400s_naming_the_field(client, path, body, param, code):
    assert_error(await client.post(path, json=body), 400, param, code)


async def test_an_unpaired_surrogate_is_a_400(client):
    response = await client.post("/tokenize", content='{"prompt": "a\\ud800"}',
                                 headers={"content-type": "application/json"})
    assert_error(response, 400, "prompt", "invalid_value")


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_another_model_is_a_404(client, path):
    body = {"model": "gpt-4o", "prompt": "Hi"} if path == "/tokenize" else {
        "model": "gpt-4o", "tokens": [1]}
    assert_error(await client.post(path, json=body), 404, "model", "model_not_found")


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "Hi"}),
                                        ("/detokenize", {"tokens": [1]})])
async def test_a_key_is_needed_where_keys_are_required(client, backend, path, body):
    backend.api_keys = ApiKeys(["sk-tokenize-01"])
    assert_error(await client.post(path, json=body), 401, None, "invalid_api_key")
    response = await client.post(path, json=body,
                                 headers={"Authorization": "Bearer sk-tokenize-01"})
    assert response.status_code == 200, response.text
