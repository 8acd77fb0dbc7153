"""Tool calling in the HTTP layer: the call parsers of each format (streamed a character at a
time), the grammars that constrain output to calls (checked with llguidance on the real
tokenizer), the conversation as the chat template gets it, and the OpenAI shapes of calls,
streamed and not, through the app with a scripted backend."""

from __future__ import annotations

import copy
import json
from typing import Any

import llguidance
import llguidance.hf
import pytest
from openai_fakes import (
    CHAT,
    HELLO,
    WEATHER,
    FakeBackend,
    assert_error,
    scripted,
    sse_events,
)

from router.api.tool_formats import (
    HERMES,
    LLAMA3_JSON,
    SMOLLM2,
    ParsedCall,
    ToolCallFormat,
    tool_call_format,
)
from router.protocol import ToolDefinition

ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [ToolDefinition.model_validate(WEATHER), ToolDefinition.model_validate(ADD)]
PARIS = ParsedCall("get_weather", {"city": "Paris"})
SUM = ParsedCall("add", {"a": 2, "b": 3})

# What each format writes for the calls [PARIS, SUM].
WRITTEN = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
              "</tool_call>",
    "smollm2": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "add", "parameters": {"a": 2, "b": 3}}',
}
FORMATS = [HERMES, SMOLLM2, LLAMA3_JSON]


def parse_streamed(fmt: ToolCallFormat, text: str, step: int = 1,
                   ) -> tuple[list[str], list[ParsedCall]]:
    """Feeds ``text`` ``step`` characters at a time; returns the content pieces and calls."""
    parser = fmt.parser(TOOLS)
    pieces, calls = [], []
    for at in range(0, len(text), step):
        content, done = parser.feed(text[at:at + step])
        pieces += [content] if content else []
        calls += done
    content, done = parser.close()
    return pieces + ([content] if content else []), calls + done


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_each_format_parses_its_own_calls_however_the_text_is_cut(fmt, step):
    pieces, calls = parse_streamed(fmt, WRITTEN[fmt.name], step)
    assert calls == [PARIS, SUM]
    assert pieces == []


@pytest.mark.parametrize("fmt", [HERMES, SMOLLM2], ids=lambda f: f.name)
def test_text_around_tagged_calls_is_content_and_a_partial_tag_is_held_back(fmt):
    parser = fmt.parser(TOOLS)
    assert parser.feed("Let me check. <tool") == ("Let me check. ", [])
    assert parser.feed("s are fun") == ("<tools are fun", [])
    content, calls = parser.feed(
        ' <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n')
    assert (content, calls) == (" ", [SUM])
    assert parser.close() == ("", [])  # whitespace after the last call is dropped


@pytest.mark.parametrize("body, why", [
    ('{"name": "add", "arguments": {"a": 2, "b": 3}', "broken JSON"),
    ('{"name": "rm_rf", "arguments": {}}', "a function not among the tools"),
    ('{"name": "add", "arguments": [1, 2]}', "arguments that are not an object"),
    ("[]", "no call"),
    ('[{"name": ["add"], "arguments": {}}]', "a name that is no string"),
    ("[" * 5000 + "]" * 5000, "JSON nested too deep to parse"),
])
def test_a_malformed_tagged_call_stays_content(body, why):
    text = f"<tool_call>{body}</tool_call>"
    pieces, calls = parse_streamed(SMOLLM2, text)
    assert calls == [], why
    assert "".join(pieces) == text


def test_an_unterminated_call_is_a_call_when_its_json_is_whole_and_content_when_not():
    assert parse_streamed(HERMES, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}')[1] \
        == [SUM]
    pieces, calls = parse_streamed(HERMES, '<tool_call>{"name": "add", "argu')
    assert (calls, "".join(pieces)) == ([], '<tool_call>{"name": "add", "argu')


@pytest.mark.parametrize("fmt", [HERMES, SMOLLM2], ids=lambda f: f.name)
@pytest.mark.parametrize("step", [1, 1000])
def test_an_end_tag_inside_an_argument_is_text_of_the_call(fmt, step):
    """The end tag ends a call only outside its JSON strings: an argument may hold markup."""
    call = ParsedCall("get_weather", {"city": 'a</tool_call>"b\\</tool_call>'})
    written = WRITTEN[fmt.name].replace('"Paris"', json.dumps(call.arguments["city"]), 1)
    pieces, calls = parse_streamed(fmt, written + " done", step)
    assert calls == [call, SUM]
    assert "".join(pieces) == " done"


def test_llama3_json_takes_only_a_whole_json_answer_as_calls():
    assert "".join(parse_streamed(LLAMA3_JSON, "The answer is {5}.")[0]) == "The answer is {5}."
    pieces, calls = parse_streamed(LLAMA3_JSON, '{"name": "add", "parameters": {"a": 1}} and so')
    assert (calls, "".join(pieces)) == ([], '{"name": "add", "parameters": {"a": 1}} and so')
    assert parse_streamed(LLAMA3_JSON, ' {"name": "add", "arguments": "{\\"a\\": 1}"}')[1] == \
        [ParsedCall("add", {"a": 1})]


def test_the_format_is_read_from_the_chat_template(tokenizer):
    assert tool_call_format(tokenizer.chat_template) is SMOLLM2
    assert tool_call_format(HERMES_TEMPLATE) is HERMES
    assert tool_call_format("{% for t in tools %}{{ '\"parameters\": ' }}{% endfor %}") \
        is LLAMA3_JSON
    assert tool_call_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}") is None


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer)


def accepted(llg_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes ``text``, token by token, and may end after it."""
    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert not llguidance.LLMatcher.validate_grammar(lark, llg_tokenizer)
    matcher = llguidance.LLMatcher(llg_tokenizer, lark)
    ids = tokenizer.encode(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and \
        matcher.is_accepting()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_call_grammar_takes_well_formed_calls_only(fmt, tokenizer, llg_tokenizer):
    parallel, single = fmt.grammar(TOOLS, True), fmt.grammar(TOOLS, False)
    written = WRITTEN[fmt.name]
    assert accepted(llg_tokenizer, tokenizer, parallel, written)
    assert not accepted(llg_tokenizer, tokenizer, single, written)
    assert not accepted(llg_tokenizer, tokenizer, parallel, written.replace("Paris", "1", 1)
                        .replace('"city": "1"', '"city": 1'))
    assert not accepted(llg_tokenizer, tokenizer, parallel, written.replace('"a": 2', '"a": "2"'))
    assert not accepted(llg_tokenizer, tokenizer, parallel, written.replace("add", "sub"))
    # Only json.dumps's spacing, the way a call is rendered back into the next turn.
    assert not accepted(llg_tokenizer, tokenizer, parallel, written.replace('": ', '" : ', 1))
    assert not accepted(llg_tokenizer, tokenizer, parallel, written.replace(", ", ",", 1))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_auto_takes_any_text_but_holds_a_call_once_opened(fmt, tokenizer, llg_tokenizer):
    grammar, single = fmt.text_or_calls(TOOLS, True), fmt.text_or_calls(TOOLS, False)
    written = WRITTEN[fmt.name]
    lead = "Let me check.\n" if fmt is not LLAMA3_JSON else "  "  # Llama's calls open it
    for text in ("No tools needed.", "", "A { brace, <b>tags</b>.", written, lead + written):
        assert accepted(llg_tokenizer, tokenizer, grammar, text), text
    assert not accepted(llg_tokenizer, tokenizer, single, written)
    for wrong in (written.replace("add", "sub"), written.replace('"a": 2', '"a": "2"'),
                  written.replace('"}}', '"', 1)):
        assert not accepted(llg_tokenizer, tokenizer, grammar, lead + wrong), wrong


NESTED = {"type": "function", "function": {"name": "place", "parameters": {
    "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                       "required": ["name"], "additionalProperties": False}},
    "type": "object", "properties": {
        "city": {"$ref": "#/$defs/City"}, "near": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        "note": {"const": {"$ref": "#"}}},
    "required": ["city", "near", "note"]}}}
"""A tool whose parameters refer to themselves, as the SDK writes nested Pydantic models: a
``$defs`` entry, the root (``#``), and a ``$ref`` in data that is no reference."""


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("tools", [[NESTED], [NESTED, ADD]], ids=["alone", "among-others"])
def test_a_tools_own_references_point_into_its_own_parameters(fmt, tools, tokenizer,
                                                               llg_tokenizer):
    definitions = [ToolDefinition.model_validate(tool) for tool in tools]
    key = "parameters" if fmt is LLAMA3_JSON else "arguments"
    near = {"city": {"name": "Lyon"}, "near": None, "note": {"$ref": "#"}}
    arguments = {"city": {"name": "Paris"}, "near": near, "note": {"$ref": "#"}}

    def written(args: dict[str, Any]) -> str:
        call = json.dumps({"name": "place", key: args})
        return {"hermes": f"<tool_call>\n{call}\n</tool_call>",
                "smollm2": f"<tool_call>[{call}]</tool_call>", "llama3_json": call}[fmt.name]

    grammar = fmt.grammar(definitions, False)
    assert accepted(llg_tokenizer, tokenizer, grammar, written(arguments))
    # The nested one follows the tool's own schema, not the call's ({"name", "arguments"}).
    wrong = {**arguments, "near": {"name": "place", key: near}}
    assert not accepted(llg_tokenizer, tokenizer, grammar, written(wrong))
    assert not accepted(llg_tokenizer, tokenizer, grammar,
                        written({**arguments, "city": {"name": 1}}))


@pytest.mark.parametrize("parameters", [None, {}, {"type": "object", "properties": {}}])
def test_a_function_without_parameters_is_called_with_no_arguments(
        parameters, tokenizer, llg_tokenizer):
    function = {"name": "ping"} if parameters is None else {"name": "ping",
                                                             "parameters": parameters}
    grammar = SMOLLM2.grammar([ToolDefinition.model_validate(
        {"type": "function", "function": function})], False)
    assert accepted(llg_tokenizer, tokenizer, grammar,
                    '<tool_call>[{"name": "ping", "arguments": {}}]</tool_call>')
    assert not accepted(llg_tokenizer, tokenizer, grammar,
                        '<tool_call>[{"name": "ping", "arguments": {"x": 1}}]</tool_call>')


# -- through the app -----------------------------------------------------------------------------

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.name }}: {{ m.content }}</tool_response>"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TURN_2 = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": None, "tool_calls": [{
              "id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


@pytest.fixture
def long_backend(backend: FakeBackend) -> FakeBackend:
    backend.max_model_len = 2048  # room for the tools in the prompt
    return backend


def prompt_text(backend: FakeBackend, tokenizer) -> str:
    return tokenizer.decode(backend.requests[-1].token_ids)


async def test_an_auto_answer_with_a_call_is_tool_calls_in_json(client, long_backend):
    long_backend.script = scripted("<tool_", 'call>[{"name": "get_weather", "arguments": ',
                                   '{"city": "Paris"}}]</tool_call>')
    response = await client.post(CHAT, json={"messages": HELLO, "tools": [WEATHER, ADD]})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    structured = long_backend.requests[-1].sampling.structured
    assert (structured.kind, structured.param) == ("grammar", "tools")
    assert structured.spec == SMOLLM2.text_or_calls(
        [ToolDefinition.model_validate(t) for t in (WEATHER, ADD)], True)


async def test_a_streamed_call_is_one_tool_calls_delta_after_the_content(client, long_backend):
    long_backend.script = scripted("Sure", ". <tool_call>[", '{"name": "add", "arguments": ',
                                   '{"a": 2, "b": 3}}]</tool_call>')
    response = await client.post(CHAT, json={"messages": HELLO, "tools": [WEATHER, ADD],
                                             "stream": True})
    events = [e for e in sse_events(response) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Sure. "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in calls] == [
        (0, {"name": "add", "arguments": '{"a": 2, "b": 3}'})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice, reason", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "add"}}, "stop")])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_function_forced_by_name_finishes_with_stop(client, long_backend, choice, reason,
                                                           stream):
    """As OpenAI and vLLM answer it: ``tool_calls`` only where the model chose to call."""
    long_backend.script = scripted('<tool_call>[{"name": "add", "arguments": ',
                                   '{"a": 2, "b": 3}}]</tool_call>')
    response = await client.post(CHAT, json={"messages": HELLO, "tools": [WEATHER, ADD],
                                             "tool_choice": choice, "stream": stream})
    if stream:
        events = [e for e in sse_events(response) if e != "[DONE]"]
        calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        answer = response.json()["choices"][0]
        calls, finish = answer["message"]["tool_calls"], answer["finish_reason"]
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert finish == reason


async def test_text_without_calls_is_content_and_a_cut_call_stays_length(client, long_backend):
    long_backend.script = scripted("No tools needed.")
    answer = (await client.post(CHAT, json={"messages": HELLO, "tools": [ADD]})).json()
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "No tools needed."}
    assert answer["choices"][0]["finish_reason"] == "stop"
    long_backend.script = scripted('<tool_call>[{"name": "add", "argu', finish="length")
    answer = (await client.post(CHAT, json={"messages": HELLO, "tools": [ADD]})).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["message"]["content"] == '<tool_call>[{"name": "add", "argu'


async def test_tool_choice_none_renders_the_tools_but_parses_nothing(client, long_backend,
                                                                     tokenizer):
    long_backend.script = scripted('<tool_call>[{"name": "add", "arguments": {}}]</tool_call>')
    answer = (await client.post(CHAT, json={"messages": HELLO, "tools": [ADD],
                                            "tool_choice": "none"})).json()
    assert answer["choices"][0]["message"]["content"].startswith("<tool_call>")
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert '<tools>[{"name": "add"' in prompt_text(long_backend, tokenizer)


@pytest.mark.parametrize("choice, parallel, allowed", [
    ("required", None, [[PARIS, SUM], [PARIS], [SUM]]),
    ({"type": "function", "function": {"name": "add"}}, None, [[SUM]]),
    ("required", False, [[PARIS], [SUM]]),
])
async def test_required_and_named_choices_constrain_output_to_calls(
        client, long_backend, tokenizer, llg_tokenizer, choice, parallel, allowed):
    body = {"messages": HELLO, "tools": [WEATHER, ADD], "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    assert (await client.post(CHAT, json=body)).status_code == 200
    structured = long_backend.requests[-1].sampling.structured
    assert (structured.kind, structured.param) == ("grammar", "tools")
    for calls in ([PARIS, SUM], [PARIS], [SUM]):
        assert accepted(llg_tokenizer, tokenizer, structured.spec,
                        SMOLLM2.call_text(calls)) == (calls in allowed)
    assert not accepted(llg_tokenizer, tokenizer, structured.spec, "I cannot call tools.")


@pytest.mark.parametrize("choice, stop", [
    ("required", []), ({"type": "function", "function": {"name": "add"}}, []),
    ("auto", ['"', "Paris"]), ("none", ['"', "Paris"])])
async def test_stop_strings_do_not_apply_to_forced_calls(client, long_backend, choice, stop):
    """A forced answer is calls only, ended by the grammar; a stop string (here one that every
    call's JSON holds) could only cut a call in two, leaving its markup as text."""
    body = {"messages": HELLO, "tools": [WEATHER, ADD], "tool_choice": choice,
            "stop": ['"', "Paris"]}
    assert (await client.post(CHAT, json=body)).status_code == 200
    assert long_backend.requests[-1].sampling.stop == stop


async def test_auto_with_a_json_schema_answer_allows_a_call_or_that_answer(
        client, long_backend, tokenizer, llg_tokenizer):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    await client.post(CHAT, json={"messages": HELLO, "tools": [ADD], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    grammar = long_backend.requests[-1].sampling.structured.spec
    assert accepted(llg_tokenizer, tokenizer, grammar, '{"answer": 5}')
    assert accepted(llg_tokenizer, tokenizer, grammar, SMOLLM2.call_text([SUM]))
    assert not accepted(llg_tokenizer, tokenizer, grammar, "5")


async def test_a_tool_turn_is_written_into_a_template_without_tools(client, long_backend,
                                                                    tokenizer):
    await client.post(CHAT, json={"messages": TURN_2, "tools": [WEATHER]})
    prompt = prompt_text(long_backend, tokenizer)
    functions = json.dumps([WEATHER["function"]])
    assert prompt.startswith(f"<|im_start|>system\nYou may call functions to answer. These are "
                             f"the functions, with JSON Schemas of their arguments:\n<tools>"
                             f"{functions}</tools>\n")
    assert prompt.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}]</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>18 C</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


async def test_a_template_that_renders_tools_gets_them_in_openai_shape(long_backend,
                                                                       tokenizer, client):
    hermes = copy.copy(tokenizer)
    hermes.chat_template = HERMES_TEMPLATE
    long_backend.tokenizer = hermes
    long_backend.script = scripted('<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Oslo"}}\n</tool_call>')
    answer = (await client.post(CHAT, json={"messages": TURN_2, "tools": [WEATHER]})).json()
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Oslo"}'
    prompt = prompt_text(long_backend, tokenizer)
    assert prompt.startswith("<|im_start|>system\n# Tools\n<tools>" + json.dumps(WEATHER))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert "<tool_response>get_weather: 18 C</tool_response>" in prompt


async def test_messages_as_the_sdk_sends_them_back_are_accepted(client, long_backend):
    """``parse()`` adds ``parsed`` and ``parsed_arguments``; calls accumulated from a stream
    keep their ``index``."""
    assistant = {**TURN_2[1], "parsed": None, "refusal": None, "tool_calls": [{
        **TURN_2[1]["tool_calls"][0], "index": 0, "function": {
            **TURN_2[1]["tool_calls"][0]["function"], "parsed_arguments": {"city": "Paris"}}}]}
    response = await client.post(CHAT, json={"messages": [TURN_2[0], assistant, TURN_2[2]],
                                             "tools": [WEATHER]})
    assert response.status_code == 200, response.text


async def test_a_stream_that_can_only_be_calls_opens_without_content(client, long_backend):
    long_backend.script = scripted('<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]'
                                   "</tool_call>")
    response = await client.post(CHAT, json={"messages": HELLO, "tools": [ADD], "stream": True,
                                             "tool_choice": "required"})
    assert sse_events(response)[0]["choices"][0]["delta"] == {"role": "assistant"}


def with_tools(**fields: Any) -> dict[str, Any]:
    return {"messages": HELLO, "tools": [WEATHER], **fields}


def with_parameters(properties: dict[str, Any]) -> dict[str, Any]:
    return with_tools(tools=[WEATHER, {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": properties,
                                    "required": list(properties)}}}])


@pytest.mark.parametrize(("body", "reason"), [
    (with_parameters({"code": {"type": "string", "minLength": 5, "maxLength": 2}}),
     "Unsatisfiable schema: required property 'code' is unsatisfiable"),
    (with_parameters({"code": {"type": "string", "pattern": "(["}}),
     "regex parse error:\n    ([\n     ^\nerror: unclosed character class"),
    (with_parameters({"code": {"type": "string", "if": {}}}), 'Unimplemented keys: ["if"]'),
    # llguidance crashes on this range (SIGSEGV): never handed to it.
    (with_parameters({"i": {"type": "integer", "minimum": -9223372036854775807,
                            "maximum": -9223372036854775800}}),
     "/properties/i: maximum -9223372036854775800 is below -9223372036854774784, the lowest "
     "integer maximum served"),
    (with_parameters({"i": {"anyOf": [{"type": "integer"}], "minimum": 10**20}}),
     "/properties/i: minimum 100000000000000000000 is outside the 64-bit integer range"),
])
async def test_a_tools_arguments_schema_no_call_could_follow_is_refused_naming_it(
        client, long_backend, body, reason):
    """The tool and llguidance's whole reason, where the worker could only name the call's
    own ``arguments`` or cut the reason at its first line; unless tool_choice is none, which
    constrains nothing."""
    error = assert_error(await client.post(CHAT, json=body), 400,
                         "tools[1].function.parameters", "invalid_value")
    assert error["message"] == f"tools[1].function.parameters: {reason}"
    assert long_backend.requests == []
    none = await client.post(CHAT, json={**body, "tool_choice": "none"})
    assert none.status_code == 200, none.text


@pytest.mark.parametrize("body, param", [
    (with_tools(tool_choice={"type": "function", "function": {"name": "add"}}), "tool_choice"),
    (with_tools(tool_choice="sometimes"), "tool_choice"),
    (with_tools(tool_choice=1), "tool_choice"),
    (with_tools(tool_choice={"type": "function", "name": "get_weather"}), "tool_choice"),
    (with_tools(tool_choice={"type": "function", "function": {"name": 1}}), "tool_choice"),
    (with_tools(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), "tools[0].function.parameters"),
    ({"messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    (with_tools(tools=[WEATHER, WEATHER]), "tools"),
    (with_tools(tools=[{"type": "function", "function": {"name": "get weather"}}]),
     "tools[0].function.name"),
    (with_tools(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (with_tools(tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
    ({"messages": [*TURN_2[:2], {**TURN_2[2], "tool_call_id": "call_9"}]},
     "messages[2].tool_call_id"),
    ({"messages": [TURN_2[0], {**TURN_2[1], "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{city"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [TURN_2[0], {**TURN_2[1], "tool_calls": [{
        "id": "c", "type": "function", "function": {
            "name": "f", "arguments": '{"a": ' + "[" * 5000 + "]" * 5000 + "}"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [TURN_2[0], {"role": "user", "content": "x", "tool_call_id": "c"}]},
     "messages[1]"),
    ({"messages": [TURN_2[0], {"role": "assistant", "content": None}]}, "messages[1]"),
])
async def test_malformed_tool_requests_are_400s_naming_the_field(client, long_backend, body,
                                                                 param):
    response = await client.post(CHAT, json=body)
    error = assert_error(response, 400, param, response.json()["error"]["code"])
    assert error["code"] in ("invalid_value", "missing_required_parameter", "invalid_type")
    assert long_backend.requests == []
    assert (await client.post(CHAT, json={"messages": HELLO})).status_code == 200
