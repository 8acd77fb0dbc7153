"""``stream_options.continuous_usage_stats`` (vLLM's extension, sent by GuideLLM): cumulative
``usage`` on every streamed event, through the real app with the scripted fake backend of
``openai_fakes``."""

from __future__ import annotations

from typing import Any

from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    MODEL,
    sse_events,
    two_choices,
)

BOTH = {"include_usage": True, "continuous_usage_stats": True}


def usage(prompt: int, completion: int, cached: int = 16) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


async def test_guidellm_chat_request_gets_usage_on_every_chunk(client, backend):
    """The body GuideLLM 0.8 sends for a chat benchmark (a 400 before this was implemented)."""
    body = {"model": MODEL, "stream": True, "stream_options": BOTH,
            "max_completion_tokens": 2, "stop": None, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You are a benchmark."},
                         {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    *chunks, done = sse_events(response)
    assert done == "[DONE]"
    prompt = len(backend.requests[0].token_ids)
    assert [c["usage"] for c in chunks] == [usage(prompt, 0), usage(prompt, 1), usage(prompt, 2),
                                            usage(prompt, 2), usage(prompt, 2)]
    role, hello, world, finish, last = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [hello["choices"][0]["delta"], world["choices"][0]["delta"]] == [
        {"content": "Hello"}, {"content": " world"}]
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert last["choices"] == []  # the usage-only chunk of include_usage stays last
    assert backend.requests[0].sampling.ignore_eos and backend.requests[0].sampling.max_tokens == 2


async def test_guidellm_completion_request_gets_usage_on_every_chunk(client, backend):
    body = {"model": MODEL, "stream": True, "stream_options": BOTH, "max_tokens": 2,
            "stop": None, "ignore_eos": True, "prompt": "Once upon a time"}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    *chunks, _ = sse_events(response)
    prompt = len(backend.requests[0].token_ids)
    assert [(c["choices"][0]["text"] if c["choices"] else None, c["usage"]) for c in chunks] == [
        ("Hello", usage(prompt, 1)), (" world", usage(prompt, 2)), ("", usage(prompt, 2)),
        (None, usage(prompt, 2))]


async def test_continuous_usage_sums_the_choices_streamed_so_far(client, backend):
    backend.script = two_choices  # choice 0: A B C (cached 16), choice 1: x y (cached 32)
    body = {"messages": HELLO, "n": 2, "stream": True, "stream_options": BOTH}
    *chunks, _ = sse_events(await client.post(CHAT, json=body))
    prompt = len(backend.requests[0].token_ids)
    seen = []
    for chunk in chunks:
        choice = chunk["choices"][0] if chunk["choices"] else {}
        content = choice.get("delta", {}).get("content")
        label = choice.get("finish_reason") if content is None else content
        seen.append((choice.get("index"), label,
                     chunk["usage"]["completion_tokens"]))
        assert chunk["usage"] == usage(prompt, seen[-1][2])
    assert seen == [(0, "", 0), (1, "", 0), (0, "A", 1), (1, "x", 2), (1, "y", 3),
                    (1, "length", 3), (0, "B", 4), (0, "C", 5), (0, "stop", 5), (None, None, 5)]


async def test_continuous_usage_alone_implies_include_usage_as_in_vllm(client, backend):
    body = {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    *chunks, _ = sse_events(await client.post(COMPLETIONS, json=body))
    prompt = len(backend.requests[0].token_ids)
    assert [c["usage"] for c in chunks] == [usage(prompt, 1), usage(prompt, 2),
                                            usage(prompt, 2), usage(prompt, 2)]
    assert chunks[-1]["choices"] == []


async def test_include_usage_false_turns_continuous_usage_off(client):
    options = {"include_usage": False, "continuous_usage_stats": True}
    body = {"prompt": "x", "stream": True, "stream_options": options}
    *chunks, _ = sse_events(await client.post(COMPLETIONS, json=body))
    assert len(chunks) == 3 and all("usage" not in c for c in chunks)


async def test_include_usage_alone_keeps_usage_null_until_the_last_chunk(client):
    body = {"prompt": "x", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    *chunks, last, _ = sse_events(await client.post(COMPLETIONS, json=body))
    assert [c["usage"] for c in chunks] == [None, None, None]
    assert last["usage"]["completion_tokens"] == 2
