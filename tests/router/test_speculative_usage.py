"""Speculative decoding in ``usage``: OpenAI's ``completion_tokens_details`` (accepted and
rejected prediction tokens) and the ``speculative`` extension, summed over a request's
choices, in JSON and streamed answers; absent when nothing speculated. Uses the scripted fake
backend of ``openai_fakes``."""

from __future__ import annotations

import pytest
from openai_fakes import (
    CHAT,
    COMPLETIONS,
    HELLO,
    FakeBackend,
    sse_events,
)

from contract.request import GenerationChunk, GenerationRequest, SpecUsage
from router.api.usage import sum_spec_usage


@pytest.fixture
def backend(tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer, one_choice)


def spec_a() -> SpecUsage:
    """Three verification steps of k=2: positions accepted 3/3 then 1/3; k=0 once."""
    return SpecUsage(proposed_tokens=6, accepted_tokens=4, verification_steps=3,
                     accepted_by_position=[3, 1], proposed_by_position=[3, 3],
                     k_decisions={2: 3, 0: 1}, draft_s=0.01, verify_s=0.2)


def spec_b() -> SpecUsage:
    """One step of k=3 with all three accepted."""
    return SpecUsage(proposed_tokens=3, accepted_tokens=3, verification_steps=1,
                     accepted_by_position=[1, 1, 1], proposed_by_position=[1, 1, 1],
                     k_decisions={3: 1}, draft_s=0.005, verify_s=0.1)


def part(request: GenerationRequest, index: int, text: str, finish: str | None,
         completion: int, left: int, spec: SpecUsage | None = None) -> GenerationChunk:
    return GenerationChunk(request.request_id, [100], text, finish, len(request.token_ids), 16,
                           completion, "worker-7", index=index, choices_left=left, spec=spec)


def one_choice(request: GenerationRequest) -> list[GenerationChunk]:
    return [part(request, 0, "Hello", None, 5, 1),
            part(request, 0, " world", "stop", 7, 0, spec_a())]


def two_choices(request: GenerationRequest) -> list[GenerationChunk]:
    return [part(request, 0, "A", None, 1, 2), part(request, 1, "x", "length", 4, 1, spec_b()),
            part(request, 0, "B", "stop", 7, 0, spec_a())]


EXPECTED_A = {
    "proposed_tokens": 6, "accepted_tokens": 4, "rejected_tokens": 2,
    "acceptance_rate": pytest.approx(4 / 6), "verification_steps": 3,
    "mean_accepted_length": pytest.approx(4 / 3), "acceptance_by_position": [1.0, 1 / 3],
    "k_decisions": {"0": 1, "2": 3}, "draft_s": pytest.approx(0.01),
    "verify_s": pytest.approx(0.2),
}

EXPECTED_A_PLUS_B = {
    "proposed_tokens": 9, "accepted_tokens": 7, "rejected_tokens": 2,
    "acceptance_rate": pytest.approx(7 / 9), "verification_steps": 4,
    "mean_accepted_length": pytest.approx(7 / 4),
    "acceptance_by_position": pytest.approx([1.0, 0.5, 1.0]),
    "k_decisions": {"0": 1, "2": 3, "3": 1}, "draft_s": pytest.approx(0.015),
    "verify_s": pytest.approx(0.3),
}


async def test_chat_usage_carries_speculation(client):
    response = await client.post(CHAT, json={"messages": HELLO})
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 4,
                                                  "rejected_prediction_tokens": 2}
    assert usage["speculative"] == EXPECTED_A


async def test_streamed_usage_carries_speculation(client):
    body = {"prompt": "Once", "stream": True, "stream_options": {"include_usage": True}}
    *events, usage_event, done = sse_events(await client.post(COMPLETIONS, json=body))
    assert all(event["usage"] is None for event in events)
    assert usage_event["usage"]["speculative"] == EXPECTED_A
    assert usage_event["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 4


async def test_streamed_without_usage_shows_none(client):
    body = {"messages": HELLO, "stream": True}
    *events, done = sse_events(await client.post(CHAT, json=body))
    assert all("usage" not in event for event in events)


@pytest.mark.parametrize("stream", [False, True])
async def test_choices_are_summed(client, backend, stream):
    backend.script = two_choices
    body = {"prompt": "x", "n": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = await client.post(COMPLETIONS, json=body)
    usage = sse_events(response)[-2]["usage"] if stream else response.json()["usage"]
    assert usage["completion_tokens"] == 11
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 7,
                                                  "rejected_prediction_tokens": 2}
    assert usage["speculative"] == EXPECTED_A_PLUS_B


@pytest.mark.parametrize("stream", [False, True])
async def test_absent_when_nothing_speculated(client, backend, stream):
    backend.script = lambda request: [part(request, 0, "Hi", "stop", 1, 0)]
    body = {"messages": HELLO, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = await client.post(CHAT, json=body)
    usage = sse_events(response)[-2]["usage"] if stream else response.json()["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens",
                          "prompt_tokens_details"}


def test_sum_pads_positions_and_adds_decisions():
    total = sum_spec_usage([spec_b(), spec_a()])
    assert total.accepted_by_position == [4, 2, 1]
    assert total.proposed_by_position == [4, 4, 1]
    assert total.k_decisions == {3: 1, 2: 3, 0: 1}
    assert (total.proposed_tokens, total.accepted_tokens, total.rejected_tokens) == (9, 7, 2)
