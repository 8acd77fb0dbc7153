"""Tool calling through the whole cluster, driven by the official ``openai`` SDK, unmodified:
a tool round trip (call, result, answer) streamed and not, ``parse`` with a pydantic tool,
``auto`` leaving a text answer as it is,
the prefix cache across tool turns (fp32 output equal to cold), and bad tool requests
answered with 400s while the cluster keeps serving."""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": WEATHER_SCHEMA}}
QUESTION = [{"role": "system", "content": "You are a weather assistant. Use the tools."},
            {"role": "user", "content": "What is the weather in Paris?"}]


class GetWeather(BaseModel):
    """The weather now in a city."""

    city: str = Field(max_length=20)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def answer_to(call, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call.id, "content": content}


def test_a_tool_round_trip_reuses_the_first_turn_and_equals_cold(client):
    salt = uuid.uuid4().hex  # a namespace no earlier test has warmed
    first = client.chat.completions.create(
        model=model_name(client), messages=QUESTION, tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=60, extra_body={"cache_salt": salt})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    conversation = [*QUESTION, choice.message, answer_to(call, "18 degrees, sunny")]

    def final(cache_salt: str):
        return client.chat.completions.create(
            model=model_name(client), messages=conversation, tools=[WEATHER],
            tool_choice="none", temperature=0, max_tokens=24,
            extra_body={"cache_salt": cache_salt})
    warm = final(salt)
    cold = final(uuid.uuid4().hex)
    assert warm.choices[0].finish_reason in ("stop", "length")
    assert warm.choices[0].message.content
    # The second turn's prompt starts with the first's: at least its full blocks were reused.
    block = 16
    assert warm.usage.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens // block * block
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_a_streamed_tool_call_accumulates_with_the_sdk_helper(client):
    with client.chat.completions.stream(
            model=model_name(client), messages=QUESTION, temperature=0, max_tokens=60,
            tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
    ) as stream:
        completion = stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert choice.message.content is None
    # The helper's message goes back as it is (its calls keep their stream index).
    final = client.chat.completions.create(
        model=model_name(client), messages=[*QUESTION, choice.message, answer_to(call, "18 C")],
        tools=[openai.pydantic_function_tool(GetWeather)], temperature=0, max_tokens=8)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_parse_with_a_pydantic_tool_then_send_its_message_back(client):
    tools = [openai.pydantic_function_tool(GetWeather)]
    completion = client.chat.completions.parse(
        model=model_name(client), messages=QUESTION, temperature=1, seed=5, max_tokens=60,
        tools=tools, tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    message = completion.choices[0].message
    [call] = message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)
    # The parsed message goes back as it is, parsed_arguments included.
    final = client.chat.completions.create(
        model=model_name(client), messages=[*QUESTION, message, answer_to(call, "18 C")],
        tools=tools, temperature=0, max_tokens=8)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_holds_only_calls_so_a_text_answer_is_the_unconstrained_one(client):
    """``auto`` constrains output only once a call opens (the router's tests hold the calls to
    the schema): SmolLM2-135M answers this in text, and greedily it is token for token the
    answer of ``none``, which renders the same prompt with no constraint at all."""
    def answer(choice: str):
        return client.chat.completions.create(
            model=model_name(client), messages=QUESTION, tools=[WEATHER], tool_choice=choice,
            temperature=0, max_tokens=48).choices[0]
    auto, free = answer("auto"), answer("none")
    assert auto.finish_reason == free.finish_reason == "stop"
    assert auto.message.tool_calls is None
    assert auto.message.content == free.message.content


def test_bad_tool_requests_are_400s_and_the_cluster_keeps_serving(client):
    bad = [
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "x": {"type": "string", "format": "no-such-format"}}}}}],
         "tool_choice": "required"},
        {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
    ]
    for fields in bad:
        body = {"messages": QUESTION, "max_tokens": 4, **fields}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model_name(client), **body)
        assert refused.value.body["param"] in ("tool_choice", "tools[0].function.parameters",
                                               "messages[2].tool_call_id")
    again = client.chat.completions.create(model=model_name(client), messages=QUESTION,
                                           max_tokens=2)
    assert again.choices[0].finish_reason == "length"


def test_the_responses_api_is_the_chat_turn_it_stands_for(client):
    """A tool round trip through ``client.responses``: the call and the final answer are the
    chat path's, greedy, for the same conversation."""
    model, tool = model_name(client), {"type": "function", **WEATHER["function"]}
    asked = {"model": model, "instructions": QUESTION[0]["content"], "tools": [tool],
             "temperature": 0}
    first = client.responses.create(input=QUESTION[1]["content"], tool_choice="required",
                                    max_output_tokens=60, **asked)
    [call] = first.output
    assert (call.type, call.name, first.status) == ("function_call", "get_weather", "completed")
    chat = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER],
                                          tool_choice="required", temperature=0, max_tokens=60)
    assert json.loads(call.arguments) == json.loads(
        chat.choices[0].message.tool_calls[0].function.arguments)
    second = client.responses.create(input=[
        {"role": "user", "content": QUESTION[1]["content"]}, call,
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}],
        max_output_tokens=40, **asked)
    answer = client.chat.completions.create(model=model, tools=[WEATHER], temperature=0,
                                            max_tokens=40, messages=[*QUESTION, {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"}])
    assert second.output_text == answer.choices[0].message.content
    assert second.usage.input_tokens == answer.usage.prompt_tokens
