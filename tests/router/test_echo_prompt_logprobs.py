"""Completions' ``echo`` and vLLM's ``prompt_logprobs`` (docs/api.md, "Request extensions"),
through the real app with the scripted fake backend of ``openai_fakes``, whose prompt
logprobs are made up from the prompt (:func:`openai_fakes.fake_prompt_logprobs`: position
``i`` at ``-0.5 * i`` with rank ``i + 1``; alternatives "A" at -0.25, "B" at -0.5, "C" at
-0.75 ...).

Prompts used: "The sky is" is the tokens ``[504, 6376, 314]`` ("The", " sky", " is"),
"Hello there" is ``[19556, 665]``, and ids 49, 50, 56, 85 are "A", "B", "H", "e"."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest
from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    MODEL,
    FakeBackend,
    assert_error,
    chunk,
    fake_prompt_logprobs,
    sse_events,
    two_choices,
)

from contract.request import GenerationChunk, GenerationRequest, TokenLogprob
from router.api.app import build_openai_app

SKY = [504, 6376, 314]  # "The sky is"
BLUE, BANG, DOT = 10062, 17, 30  # " Blue", "!", "."


def blue_bang(request: GenerationRequest) -> list[Any]:
    """A token-less first chunk, then " Blue" and "!" (stop; cut by ``max_tokens: 1`` to
    " Blue", length), with output logprobs as the worker gives them: ``sampling.logprobs``
    alternatives each (" Blue" at -0.75, itself the most likely; "!" at -1.0, "." at -0.5 the
    most likely)."""
    count = request.sampling.logprobs
    outputs = [(BLUE, " Blue", -0.75, [(BLUE, -0.75), (DOT, -1.5)]),
               (BANG, "!", -1.0, [(DOT, -0.5), (BANG, -1.0)])]
    outputs = outputs[:request.sampling.max_tokens]
    chunks = [chunk(request, cached=0)]
    for n, (token_id, text, logprob, top) in enumerate(outputs, start=1):
        finish = None if n < len(outputs) else "stop" if n == 2 else "length"
        logprobs = None if count is None else [TokenLogprob(token_id, logprob, top[:count])]
        chunks.append(GenerationChunk(request.request_id, [token_id], text, finish,
                                      len(request.token_ids), 0, n, "worker-7",
                                      logprobs=logprobs))
    return chunks


SKY_LOGPROBS = {
    "tokens": ["The", " sky", " is", " Blue", "!"],
    "token_logprobs": [None, -0.5, -1.0, -0.75, -1.0],
    "top_logprobs": [None, {"A": -0.25, " sky": -0.5}, {"A": -0.25, " is": -1.0},
                     {" Blue": -0.75}, {".": -0.5, "!": -1.0}],
    "text_offset": [0, 3, 7, 10, 15],
}
"""``choices[0].logprobs`` of "The sky is" echoed with ``logprobs: 1``, answered by
:func:`blue_bang`."""


# -- echo: text ------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["The sky is", SKY], ids=["text", "token-ids"])
async def test_echo_begins_the_text_with_the_prompt(client, backend, prompt):
    plain = await client.post(COMPLETIONS, json={"prompt": prompt})
    response = await client.post(COMPLETIONS, json={"prompt": prompt, "echo": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"] == [{"index": 0, "text": "The sky isHello world", "logprobs": None,
                                "finish_reason": "stop", "stop_reason": None}]
    assert body["usage"] == plain.json()["usage"]  # echo counts nothing more
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2
    assert backend.requests[1].token_ids == SKY
    assert backend.requests[1].sampling == backend.requests[0].sampling  # no prompt logprobs


async def test_echo_of_a_truncated_prompt_is_the_tokens_the_worker_got(client, backend):
    body = {"prompt": "The sky is", "echo": True, "truncate_prompt_tokens": 2}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert backend.requests[0].token_ids == SKY[1:]
    assert response.json()["choices"][0]["text"] == " sky isHello world"


async def test_echo_of_a_batch_gives_each_choice_its_own_prompt(client, backend):
    backend.script = two_choices  # choice 0 says "ABC", choice 1 "xy"
    body = {"prompt": ["The sky is", "Hi"], "n": 2, "echo": True}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    texts = [(c["index"], c["text"]) for c in response.json()["choices"]]
    assert texts == [(0, "The sky isABC"), (1, "The sky isxy"), (2, "HiABC"), (3, "Hixy")]
    events = sse_events(await client.post(COMPLETIONS, json={**body, "stream": True}))[:-1]
    streamed = {i: "".join(e["choices"][0]["text"] for e in events
                           if e["choices"][0]["index"] == i) for i in range(4)}
    assert sorted(streamed.items()) == texts


async def test_a_streamed_echo_comes_in_each_choices_first_text_event(client, backend):
    backend.script = two_choices
    body = {"prompt": "The sky is", "n": 2, "echo": True, "stream": True}
    events = sse_events(await client.post(COMPLETIONS, json=body))[:-1]
    texts = [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events]
    assert texts == [(0, "The sky isA"), (1, "The sky isx"), (1, "y"), (1, ""), (0, "B"),
                     (0, "C"), (0, "")]


async def test_a_streamed_echo_whose_choice_wrote_no_text_still_sends_the_prompt(client,
                                                                              backend):
    """A choice whose only token is the end of sequence (no text): the prompt comes before
    its finish."""
    backend.script = lambda request: [
        chunk(request), GenerationChunk(request.request_id, [0], "", "stop", 3, 0, 1, "w")]
    body = {"prompt": "The sky is", "echo": True, "stream": True}
    events = sse_events(await client.post(COMPLETIONS, json=body))[:-1]
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events] == [
        ("The sky is", None), ("", "stop")]
    response = await client.post(COMPLETIONS, json={**body, "stream": False})
    assert response.json()["choices"][0]["text"] == "The sky is"


# -- chat echo --------------------------------------------------------------------------------

CONTINUED = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I"}]
CONTINUE = {"messages": CONTINUED, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True}


async def test_chat_echo_begins_each_choice_with_the_continued_message(client, backend):
    backend.script = two_choices  # choice 0 says "ABC", choice 1 "xy"
    response = await client.post(CHAT, json={**CONTINUE, "n": 2})
    assert response.status_code == 200, response.text
    assert [c["message"]["content"] for c in response.json()["choices"]] == [
        "Hi, IABC", "Hi, Ixy"]
    streamed = sse_events(await client.post(CHAT, json={**CONTINUE, "n": 2, "stream": True}))
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in streamed[:-1]]
    # Each choice's role, then its echo, as vLLM streams them, then the output.
    assert deltas[:4] == [(0, {"role": "assistant", "content": ""}),
                          (1, {"role": "assistant", "content": ""}),
                          (0, {"content": "Hi, I"}), (1, {"content": "Hi, I"})]
    assert ["".join(d.get("content") or "" for i, d in deltas if i == index)
            for index in (0, 1)] == ["Hi, IABC", "Hi, Ixy"]


async def test_chat_echo_adds_nothing_after_a_users_message(client, backend):
    response = await client.post(CHAT, json={"messages": HELLO, "echo": True})
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"
    events = sse_events(await client.post(CHAT, json={"messages": HELLO, "echo": True,
                                                     "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if e["choices"]) == "Hello world"


# -- echo with logprobs ----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["The sky is", SKY], ids=["text", "token-ids"])
async def test_echo_with_logprobs_lists_the_prompt_tokens_first(client, backend, prompt):
    backend.script = blue_bang
    response = await client.post(COMPLETIONS, json={"prompt": prompt, "echo": True,
                                                    "logprobs": 1, "max_tokens": 2})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice == {"index": 0, "text": "The sky is Blue!", "logprobs": SKY_LOGPROBS,
                      "finish_reason": "stop", "stop_reason": None}
    assert backend.requests[0].sampling.prompt_logprobs == 1
    assert response.json()["usage"]["completion_tokens"] == 2


async def test_streamed_echo_with_logprobs_adds_up_to_the_answer(client, backend):
    backend.script = blue_bang
    body = {"prompt": "The sky is", "echo": True, "logprobs": 1, "max_tokens": 2,
            "stream": True}
    events = sse_events(await client.post(COMPLETIONS, json=body))[:-1]
    choices = [e["choices"][0] for e in events]
    assert choices[0]["text"] == "The sky is Blue"  # the prompt, then the first output
    assert choices[0]["logprobs"]["tokens"] == ["The", " sky", " is", " Blue"]
    assert "".join(c["text"] for c in choices) == "The sky is Blue!"
    for key, values in SKY_LOGPROBS.items():
        # The finish event has no logprobs (null).
        assert [v for c in choices for v in (c["logprobs"] or {}).get(key, [])] == values, key


async def test_echo_with_logprobs_of_a_batch_scores_each_prompt(client, backend):
    backend.script = blue_bang
    body = {"prompt": [[56, 50], [56, 85, 50]], "echo": True, "logprobs": 0, "max_tokens": 2}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    first, second = (c["logprobs"] for c in response.json()["choices"])
    assert (first["tokens"], first["token_logprobs"], first["top_logprobs"][:2]) == (
        ["H", "B", " Blue", "!"], [None, -0.5, -0.75, -1.0], [None, {"B": -0.5}])
    assert (second["tokens"], second["token_logprobs"], second["top_logprobs"][:3]) == (
        ["H", "e", "B", " Blue", "!"], [None, -0.5, -1.0, -0.75, -1.0],
        [None, {"e": -0.5}, {"B": -1.0}])
    assert second["text_offset"] == [0, 1, 2, 3, 8]


async def test_the_worker_gets_the_larger_of_echo_logprobs_and_prompt_logprobs(client,
                                                                             backend):
    backend.script = blue_bang
    asked = [({"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 3),
             ({"echo": True, "logprobs": 1, "prompt_logprobs": 3}, 3),
             ({"echo": True, "logprobs": 2}, 2),
             ({"logprobs": 2, "prompt_logprobs": 1}, 1),
             ({"echo": True, "prompt_logprobs": 0}, 0),
             ({"echo": True}, None)]
    answers = [await client.post(COMPLETIONS, json={"prompt": [56, 50], **fields})
               for fields, _ in asked]
    assert [a.status_code for a in answers] == [200] * len(asked)
    assert [r.sampling.prompt_logprobs for r in backend.requests] == [n for _, n in asked]
    # Each list keeps what its own parameter asked, however many the worker computed.
    (wide_echo,) = answers[0].json()["choices"]
    assert wide_echo["logprobs"]["top_logprobs"][1] == {"A": -0.25, "B": -0.5, "C": -0.75}
    assert wide_echo["prompt_logprobs"][1] == {
        "50": {"logprob": -0.5, "rank": 2, "decoded_token": "B"},
        "49": {"logprob": -0.25, "rank": 1, "decoded_token": "A"}}
    (wide_prompt,) = answers[1].json()["choices"]
    assert wide_prompt["logprobs"]["top_logprobs"][1] == {"A": -0.25, "B": -0.5}
    assert len(wide_prompt["prompt_logprobs"][1]) == 3


async def test_a_request_scoring_its_prompt_is_routed_by_load_alone(client, backend):
    """Its worker reuses no cached block, so the router gets no digests to place it by."""
    for fields in ({}, {"echo": True, "logprobs": 0}, {"prompt_logprobs": 0}):
        response = await client.post(COMPLETIONS, json={"prompt": "The sky is " * 20,
                                                        **fields})
        assert response.status_code == 200, response.text
    plain, echoed, scored = backend.requests
    assert len(plain.prompt_digests.digests) == 3  # 60 tokens: 3 full blocks of 16
    assert echoed.prompt_digests is None and scored.prompt_digests is None


# -- prompt_logprobs ---------------------------------------------------------------------------


async def test_completion_prompt_logprobs_are_vllms_lists(client, backend):
    response = await client.post(COMPLETIONS, json={"prompt": [56, 50, 85], "prompt_logprobs": 2,
                                                    "max_tokens": 2})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice == {
        "index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop",
        "stop_reason": None, "prompt_logprobs": [
            None,
            {"50": {"logprob": -0.5, "rank": 2, "decoded_token": "B"},
             "49": {"logprob": -0.25, "rank": 1, "decoded_token": "A"}},
            {"85": {"logprob": -1.0, "rank": 3, "decoded_token": "e"},
             "49": {"logprob": -0.25, "rank": 1, "decoded_token": "A"},
             "50": {"logprob": -0.5, "rank": 2, "decoded_token": "B"}}]}
    assert list(choice["prompt_logprobs"][2]) == ["85", "49", "50"]  # the prompt token first
    assert backend.requests[0].sampling.prompt_logprobs == 2
    assert response.json()["usage"]["completion_tokens"] == 2


async def test_each_choice_of_a_batch_has_its_own_prompts_logprobs(client, backend):
    backend.script = two_choices
    body = {"prompt": [[56, 50], [56, 85, 50]], "n": 2, "prompt_logprobs": 0}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    tokens = [[None if p is None else list(p) for p in c["prompt_logprobs"]]
              for c in response.json()["choices"]]
    assert tokens == [[None, ["50"]]] * 2 + [[None, ["85"], ["50"]]] * 2


SHORT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""A chat template that renders the contents alone: "Hello there" is two tokens."""


async def test_chat_prompt_logprobs_are_at_the_top_level(client, backend, tokenizer,
                                                        monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", SHORT_TEMPLATE)
    backend.script = two_choices  # every choice comes with the prompt logprobs
    response = await client.post(CHAT, json={"messages": HELLO, "prompt_logprobs": 1, "n": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert backend.requests[0].token_ids == [19556, 665]
    assert backend.requests[0].sampling.prompt_logprobs == 1
    assert body["prompt_logprobs"] == [
        None, {"665": {"logprob": -0.5, "rank": 2, "decoded_token": " there"},
               "49": {"logprob": -0.25, "rank": 1, "decoded_token": "A"}}]
    assert all("prompt_logprobs" not in choice for choice in body["choices"])
    assert list(body)[-2:] == ["usage", "prompt_logprobs"]
    unasked = (await client.post(CHAT, json={"messages": HELLO})).json()
    assert list(unasked)[-1] == "usage"


async def test_prompt_logprobs_computed_for_an_echo_alone_are_left_out(client, backend):
    body = {"prompt": "The sky is", "echo": True, "logprobs": 0}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert backend.requests[0].sampling.prompt_logprobs == 0
    assert "prompt_logprobs" not in response.json()["choices"][0]


@pytest.mark.parametrize(("path", "body"), [
    (COMPLETIONS, {"prompt": "The sky is", "prompt_logprobs": 1}),
    (COMPLETIONS, {"prompt": "The sky is", "echo": True, "logprobs": 1}),
    (CHAT, {"messages": HELLO, "prompt_logprobs": 0}),
])
async def test_missing_prompt_logprobs_are_a_server_error_not_a_misaligned_answer(
        client, backend, path, body):
    backend.sends_prompt_logprobs = False
    response = await client.post(path, json=body)
    error = assert_error(response, 500, None, "internal_error", "server_error")
    tokens = len(backend.requests[0].token_ids)
    assert error["message"] == f"the worker returned no prompt logprobs for a prompt of {tokens} " \
        "tokens"


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "code", "message"), [
    ({"prompt_logprobs": 1, "stream": True}, "invalid_value",
     "prompt_logprobs cannot be streamed; send stream: false"),
    ({"prompt_logprobs": 0, "stream": True}, "invalid_value",
     "prompt_logprobs cannot be streamed; send stream: false"),
    ({"prompt_logprobs": 21}, "invalid_value", "prompt_logprobs must be in [0, 20]"),
    ({"prompt_logprobs": -1}, "invalid_value", "prompt_logprobs must be in [0, 20]"),
    ({"prompt_logprobs": "2"}, "invalid_type", None),
    ({"prompt_logprobs": True}, "invalid_type", None),
])
async def test_bad_prompt_logprobs_are_a_400_naming_it(client, backend, path, fields, code,
                                                     message):
    base = {"messages": HELLO} if path == CHAT else {"prompt": "The sky is"}
    response = await client.post(path, json={**base, **fields})
    error = assert_error(response, 400, "prompt_logprobs", code)
    assert message is None or error["message"] == message
    assert backend.requests == []


async def test_a_bad_prompt_logprobs_is_refused_beside_a_larger_echo(client, backend):
    body = {"prompt": "The sky is", "echo": True, "logprobs": 5, "prompt_logprobs": -1}
    error = assert_error(await client.post(COMPLETIONS, json=body), 400, "prompt_logprobs",
                         "invalid_value")
    assert error["message"] == "prompt_logprobs must be in [0, 20]"
    assert backend.requests == []


# -- lm-evaluation-harness ---------------------------------------------------------------------


def loglikelihood(choice: Any, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's ``local-completions`` reads from an echoed choice
    (``parse_logprobs``): the continuation's summed logprob, and whether each of its tokens
    was the most likely."""
    logprobs = choice.logprobs.token_logprobs[ctxlen:-1]
    top = choice.logprobs.top_logprobs[ctxlen:-1]
    return sum(logprobs), all(lp == max(t.values()) for lp, t in zip(logprobs, top, strict=True))


async def test_lm_eval_loglikelihood_through_the_openai_sdk(tokenizer):
    """lm-eval's request (``max_tokens: 1, logprobs: 1, echo: true, temperature: 0``, a batch
    of token-id prompts) through the official SDK: context "The", continuation " sky is"."""
    openai = pytest.importorskip("openai")
    backend = FakeBackend(tokenizer, blue_bang)
    transport = httpx.ASGITransport(app=build_openai_app(backend))
    async with httpx.AsyncClient(transport=transport) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-a", http_client=http)
        answer = await sdk.completions.create(model=MODEL, prompt=[SKY], max_tokens=1,
                                              logprobs=1, echo=True, temperature=0)
    (choice,) = answer.choices
    assert choice.text == "The sky is Blue"
    assert choice.logprobs.token_logprobs == [None, -0.5, -1.0, -0.75]
    assert choice.logprobs.top_logprobs[1] == {"A": -0.25, " sky": -0.5}
    assert loglikelihood(choice, ctxlen=1) == (-1.5, False)  # "A" was more likely each time
    assert answer.usage.prompt_tokens == 3 and answer.usage.completion_tokens == 1
    request = backend.requests[0]
    assert (request.sampling.max_tokens, request.sampling.logprobs,
            request.sampling.prompt_logprobs, request.sampling.temperature) == (1, 1, 1, 0.0)


async def test_tied_tokens_share_a_rank(client, backend):
    """Ties are frequent in bf16: the most likely tokens are all rank 1, the next one ranks
    after all of them (the worker ranks the prompt token the same way)."""
    def tied(request: GenerationRequest) -> list[Any]:
        entries = [None, TokenLogprob(50, -0.5, [(49, -0.5), (50, -0.5), (51, -0.75)], rank=1)]
        return [chunk(request), replace(chunk(request, " Blue", "stop", completion=1),
                                        prompt_logprobs=entries)]

    backend.sends_prompt_logprobs = False
    backend.script = tied
    response = await client.post(COMPLETIONS, json={"prompt": [56, 50], "prompt_logprobs": 3,
                                                    "max_tokens": 1})
    (choice,) = response.json()["choices"]
    assert choice["prompt_logprobs"][1] == {
        "50": {"logprob": -0.5, "rank": 1, "decoded_token": "B"},
        "49": {"logprob": -0.5, "rank": 1, "decoded_token": "A"},
        "51": {"logprob": -0.75, "rank": 3, "decoded_token": "C"}}


def scored_only(request: GenerationRequest) -> list[Any]:
    """What a worker answers ``max_tokens: 0``: the prompt scored, nothing generated."""
    entries = fake_prompt_logprobs(request) if request.sampling.prompt_logprobs is not None \
        else None
    return [chunk(request), GenerationChunk(request.request_id, [], "", "length",
                                            len(request.token_ids), 0, 0, "worker-7",
                                            prompt_logprobs=entries)]


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_of_max_tokens_0_answers_the_prompt_alone(client, backend, stream):
    """As vLLM serves it (and lm-evaluation-harness-like scorers send it): the prompt and its
    logprobs, no output, ``length``."""
    backend.sends_prompt_logprobs = False
    backend.script = scored_only
    body = {"prompt": "The sky is", "echo": True, "logprobs": 1, "max_tokens": 0,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [e for e in sse_events(response) if e != "[DONE]"]
        choices = [c for e in events for c in e["choices"]]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        reason, usage = choices[-1]["finish_reason"], events[-1]["usage"]
    else:
        (choice,) = response.json()["choices"]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
        reason, usage = choice["finish_reason"], response.json()["usage"]
    assert (text, tokens, reason) == ("The sky is", ["The", " sky", " is"], "length")
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 0)
    assert backend.requests[0].sampling.max_tokens == 0
    assert backend.requests[0].sampling.prompt_logprobs == 1


async def test_max_tokens_0_without_echo_or_prompt_logprobs_is_refused(client, backend):
    response = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 0})
    assert_error(response, 400, "max_tokens", "invalid_value")
    echoed = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 0,
                                                  "echo": True})
    assert echoed.status_code == 200  # echo alone scores with no alternatives
    assert backend.requests[0].sampling.prompt_logprobs == 0
