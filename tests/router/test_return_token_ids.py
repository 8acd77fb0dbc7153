"""vLLM's ``return_token_ids`` (docs/api.md, "Request extensions"): the prompt's ids and each
choice's output ids in the answer, streamed or not, through the real app with the scripted fake
backend of ``openai_fakes`` (whose ``hello_world`` answers "Hello" as id 101 and " world" as
id 102)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    MODEL,
    FakeBackend,
    assert_error,
    chunk,
    sse_events,
)

from contract.request import GenerationChunk, GenerationRequest, TokenLogprob
from router.api.app import build_openai_app

ASK = {"return_token_ids": True}


def held_back(request: GenerationRequest) -> list[Any]:
    """Id 7 arrives with no text (held back, as a stop-string check does), then " world"."""
    return [chunk(request),
            GenerationChunk(request.request_id, [7], "", None, len(request.token_ids), 16, 1,
                            "worker-7"),
            chunk(request, " world", "stop", completion=2)]


async def test_chat_answer_carries_the_prompt_and_output_ids(client, backend):
    plain = (await client.post(CHAT, json={"messages": HELLO})).json()
    answer = (await client.post(CHAT, json={"messages": HELLO, **ASK})).json()
    prompt = backend.requests[1].token_ids
    assert answer["prompt_token_ids"] == prompt and len(prompt) > 2
    assert answer["choices"][0]["token_ids"] == [101, 102]
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert {k: v for k, v in answer.items() if k not in ("prompt_token_ids", "id", "created")} \
        == {**{k: v for k, v in plain.items() if k not in ("id", "created")},
            "choices": [{**plain["choices"][0], "token_ids": [101, 102]}]}


async def test_chat_stream_carries_the_ids_event_by_event(client, backend):
    backend.script = held_back
    response = await client.post(CHAT, json={"messages": HELLO, "stream": True, **ASK})
    events = [e for e in sse_events(response) if e != "[DONE]"]
    assert events[0]["prompt_token_ids"] == backend.requests[0].token_ids
    assert all("prompt_token_ids" not in e for e in events[1:])
    by_event = [(e["choices"][0]["delta"], e["choices"][0].get("token_ids")) for e in events]
    assert by_event == [({"role": "assistant", "content": ""}, None), ({}, [7]),
                        ({"content": " world"}, [102]), ({}, None)]


async def test_completion_choices_carry_their_own_prompt_ids(client, backend):
    answer = (await client.post(COMPLETIONS, json={"prompt": [[5, 6, 7], [8, 9]], **ASK}))
    first, second = answer.json()["choices"]
    assert first["prompt_token_ids"] == [5, 6, 7]
    assert second["prompt_token_ids"] == [8, 9]
    assert first["token_ids"] == second["token_ids"] == [101, 102]
    plain = (await client.post(COMPLETIONS, json={"prompt": "Hi"})).json()["choices"][0]
    assert "prompt_token_ids" not in plain and "token_ids" not in plain


async def test_completion_stream_puts_the_prompt_ids_on_the_first_event(client, backend):
    backend.script = held_back
    response = await client.post(COMPLETIONS, json={"prompt": [5, 6, 7], "stream": True,
                                                    **ASK})
    choices = [e["choices"][0] for e in sse_events(response) if e != "[DONE]"]
    assert [(c["text"], c.get("prompt_token_ids"), c.get("token_ids")) for c in choices] == [
        ("", [5, 6, 7], [7]), (" world", None, [102]), ("", None, None)]


async def test_a_choice_ending_on_its_first_token_still_gets_its_prompt_ids(client, backend):
    def eos_only(request: GenerationRequest) -> list[Any]:
        return [chunk(request), GenerationChunk(request.request_id, [2], "", "stop",
                                                len(request.token_ids), 16, 1, "worker-7")]

    backend.script = eos_only
    response = await client.post(COMPLETIONS, json={"prompt": [5, 6], "stream": True, **ASK})
    choices = [e["choices"][0] for e in sse_events(response) if e != "[DONE]"]
    assert [(c.get("prompt_token_ids"), c.get("token_ids"), c["finish_reason"])
            for c in choices] == [([5, 6], [2], None), (None, None, "stop")]
    plain = await client.post(COMPLETIONS, json={"prompt": [5, 6], "stream": True})
    assert len([e for e in sse_events(plain) if e != "[DONE]"]) == 1  # the finish alone


async def test_return_token_ids_must_be_a_boolean(client):
    response = await client.post(CHAT, json={"messages": HELLO, "return_token_ids": "yes"})
    assert_error(response, 400, "return_token_ids", "invalid_type")


async def test_the_openai_sdk_reads_them_as_extra_fields(tokenizer):
    backend = FakeBackend(tokenizer)
    transport = httpx.ASGITransport(app=build_openai_app(backend))
    async with httpx.AsyncClient(transport=transport) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-a", http_client=http)
        answer = await sdk.chat.completions.create(model=MODEL, messages=HELLO,
                                                   extra_body=ASK)
    assert answer.model_extra["prompt_token_ids"] == backend.requests[0].token_ids
    assert answer.choices[0].model_extra["token_ids"] == [101, 102]


# -- return_tokens_as_token_ids -----------------------------------------------------------------


def with_logprobs(request: GenerationRequest) -> list[Any]:
    """" Blue" (id 10062) with its logprob and one alternative, "." (id 30)."""
    return [chunk(request), GenerationChunk(
        request.request_id, [10062], " Blue", "stop", len(request.token_ids), 16, 1,
        "worker-7", logprobs=[TokenLogprob(10062, -0.75, [(10062, -0.75), (30, -1.5)])])]


async def test_logprobs_name_tokens_by_id_when_asked(client, backend):
    backend.script = with_logprobs
    chat = (await client.post(CHAT, json={"messages": HELLO, "logprobs": True,
                                          "top_logprobs": 2,
                                          "return_tokens_as_token_ids": True})).json()
    [entry] = chat["choices"][0]["logprobs"]["content"]
    assert (entry["token"], entry["bytes"]) == ("token_id:10062", list(b" Blue"))
    assert [t["token"] for t in entry["top_logprobs"]] == ["token_id:10062", "token_id:30"]
    assert chat["choices"][0]["message"]["content"] == " Blue"  # the text stays text
    completion = (await client.post(COMPLETIONS, json={
        "prompt": [5, 6], "logprobs": 1, "echo": True, "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True})).json()["choices"][0]
    assert completion["logprobs"]["tokens"] == ["token_id:5", "token_id:6", "token_id:10062"]
    assert completion["logprobs"]["top_logprobs"][2] == {"token_id:10062": -0.75,
                                                        "token_id:30": -1.5}
    assert completion["prompt_logprobs"][1]["6"]["decoded_token"] == "token_id:6"
    plain = (await client.post(CHAT, json={"messages": HELLO, "logprobs": True})).json()
    assert plain["choices"][0]["logprobs"]["content"][0]["token"] == " Blue"


async def test_return_tokens_as_token_ids_must_be_a_boolean(client):
    response = await client.post(COMPLETIONS, json={"prompt": "Hi",
                                                    "return_tokens_as_token_ids": 1})
    assert_error(response, 400, "return_tokens_as_token_ids", "invalid_type")
