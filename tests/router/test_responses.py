"""OpenAI's Responses API (``POST /v1/responses``) through the real app with the scripted fake
backend: the worker gets exactly the chat request's tokens and constraints, answers parse with
the official ``openai`` SDK (whole and streamed, whose events it types), and what cannot be
served is a 400 naming its field."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from openai_fakes import CHAT, WEATHER, FakeBackend, assert_error, scripted

from router.api.app import build_openai_app

RESPONSES = "/v1/responses"
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses spelling of WEATHER
CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'


@pytest.fixture
async def sdk(backend: FakeBackend):
    backend.max_model_len = 2048  # room for tools in the prompt
    transport = httpx.ASGITransport(app=build_openai_app(backend))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-a", http_client=http)


async def events_of(sdk, **body: Any) -> list[Any]:
    return [event async for event in await sdk.responses.create(stream=True, **body)]


async def test_a_text_answer_is_the_chat_turn_it_stands_for(sdk, backend, client):
    answer = await sdk.responses.create(input="Hello there", instructions="Be brief",
                                        max_output_tokens=20, temperature=0.5)
    assert (answer.status, answer.output_text) == ("completed", "Hello world")
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens == len(backend.requests[0].token_ids)
    assert (answer.usage.output_tokens, answer.usage.input_tokens_details.cached_tokens) == (2, 16)
    assert answer.instructions == "Be brief" and answer.max_output_tokens == 20
    chat = await client.post(CHAT, json={
        "messages": [{"role": "system", "content": "Be brief"},
                     {"role": "user", "content": "Hello there"}],
        "max_completion_tokens": 20, "temperature": 0.5})
    assert chat.status_code == 200, chat.text
    ours, theirs = backend.requests
    assert (ours.token_ids, ours.sampling) == (theirs.token_ids, theirs.sampling)
    assert ours.request_id.startswith("resp-") and answer.id.startswith("resp-")


async def test_the_stream_is_the_responses_events_adding_up_to_the_answer(sdk):
    events = await events_of(sdk, input="Hello there")
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "Hello world")
    final = events[-1].response
    whole = await sdk.responses.create(input="Hello there")
    assert final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.model_dump() == whole.usage.model_dump()
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert whole.completed_at >= whole.created_at


async def test_an_answer_cut_at_max_output_tokens_is_incomplete(sdk, backend):
    backend.script = scripted("Hello", " wor", finish="length")
    answer = await sdk.responses.create(input="Hello there", max_output_tokens=2)
    assert (answer.status, answer.incomplete_details.reason) == ("incomplete",
                                                                 "max_output_tokens")
    assert [item.status for item in answer.output] == ["incomplete"]
    assert answer.completed_at is None
    events = await events_of(sdk, input="Hello there", max_output_tokens=2)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == "Hello wor"
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"]


async def test_a_call_is_a_function_call_item_and_its_output_goes_back_as_a_tool_turn(
        sdk, backend, client):
    backend.script = scripted("<tool_", CALL[6:])
    answer = await sdk.responses.create(input="Weather in Paris?", tools=[TOOL])
    (call,) = answer.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_")
    events = await events_of(sdk, input="Weather in Paris?", tools=[TOOL])
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Paris"}]
    assert "response.output_text.delta" not in [e.type for e in events]
    # The next turn: the call as the answer gave it, then its output.
    backend.script = scripted("It is 18 C.")
    follow = await sdk.responses.create(input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        tools=[TOOL])
    assert follow.output_text == "It is 18 C."
    chat = await client.post(CHAT, json={"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}]})
    assert chat.status_code == 200, chat.text
    assert backend.requests[-2].token_ids == backend.requests[-1].token_ids


async def test_an_earlier_answers_items_come_back_as_the_sdk_dumps_them(sdk, backend):
    """``model_dump()`` of an answer's items holds the fields of the SDK's version (``phase``,
    ``namespace`` ...): they are accepted, and the turn is the chat turn of their content."""
    backend.script = scripted("<tool_", CALL[6:])
    first = await sdk.responses.create(input="Weather in Paris?", tools=[TOOL])
    items = [{**item.model_dump(), "phase": None, "namespace": None} for item in first.output]
    backend.script = scripted("It is 18 C.")
    follow = await sdk.responses.create(tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"}, *items,
        {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "18"}])
    assert follow.output_text == "It is 18 C."


async def test_text_then_a_call_are_two_items_in_the_order_written(sdk, backend):
    backend.script = scripted("Let me check. ", CALL)
    answer = await sdk.responses.create(input="Weather in Paris?", tools=[TOOL])
    assert [item.type for item in answer.output] == ["message", "function_call"]
    assert answer.output[0].content[0].text == "Let me check. "
    events = await events_of(sdk, input="Weather in Paris?", tools=[TOOL])
    assert [(e.type, e.output_index) for e in events if e.type.startswith(
        "response.output_item")] == [("response.output_item.added", 0),
                                    ("response.output_item.done", 0),
                                    ("response.output_item.added", 1),
                                    ("response.output_item.done", 1)]


async def test_text_format_and_tool_choice_reach_the_worker_as_chats_do(sdk, backend, client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await sdk.responses.create(input="Hi", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    await client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "thing", "schema": schema, "strict": True}}})
    await sdk.responses.create(input="Hi", tools=[TOOL],
                               tool_choice={"type": "function", "name": "get_weather"})
    await client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}],
                                  "tools": [WEATHER], "tool_choice": {
                                      "type": "function", "function": {"name": "get_weather"}}})
    first, first_chat, second, second_chat = backend.requests
    # The same constraint, named for the worker's refusals by the field that set it.
    assert first.sampling.structured.param == "text.format"
    assert first.sampling.structured == replace(first_chat.sampling.structured,
                                                param="text.format")
    assert (second.token_ids, second.sampling) == (second_chat.token_ids, second_chat.sampling)


async def test_truncation_auto_keeps_the_last_tokens_that_fit(client, backend):
    response = await client.post(RESPONSES, json={"input": "word " * 400, "truncation": "auto",
                                                  "max_output_tokens": 28})
    assert response.status_code == 200, response.text
    assert len(backend.requests[0].token_ids) == 128 - 28


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "unsupported_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "missing_required_parameter"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                 "arguments": "not json"}]}, "input", "invalid_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "word " * 400}, "input", "context_length_exceeded"),
    ({"max_output_tokens": 500}, "max_output_tokens", "context_length_exceeded"),
    ({"tokens": 5}, "tokens", "unknown_parameter"),
    ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]},
     "input", "invalid_value"),
    ({"tools": [TOOL, {**TOOL, "name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]}}]},
     "tools[1].parameters", "invalid_value"),
])
async def test_what_cannot_be_served_is_a_400_naming_it(client, backend, body, param, code):
    response = await client.post(RESPONSES, json={"input": "Hi", **body})
    error = assert_error(response, 400, param, code)
    assert not any(chat in error["message"] for chat in (
        "messages", "max_completion_tokens", "function.", '"function": {'))
    assert backend.requests == []
