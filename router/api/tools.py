"""Tool calling for a chat request: what its ``tools``, ``tool_choice`` and
``parallel_tool_calls`` ask, the conversation as the chat template is given it, and the
constraint on output where calls are required.

``tool_choice`` as OpenAI defines it:

* ``none``: the tools are described to the model (so the prompt, and its cached prefix, is the
  same whatever the choice) but the answer is text; nothing is parsed.
* ``auto`` (the default with tools): the model answers freely until it opens a call in its
  format (:mod:`router.api.tool_formats`); from there output is held to calls to the tools,
  arguments following each tool's schema, and the calls are parsed out of the text.
* ``required`` and a named function: output is constrained to calls in the model's own
  format, arguments following each tool's schema, so the model writes what it was tuned to
  write and the next turn renders the same text back (the prefix cache holds it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from contract.request import StructuredOutput
from contract.schema_limits import schema_fault
from router.api.tool_formats import (
    SMOLLM2,
    CallParser,
    ParsedCall,
    ToolCallFormat,
    arguments_schema,
    tool_call_format,
)
from router.errors import invalid_request
from router.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition

_SMOLLM2_TOOLS_PREAMBLE = (
    "You may call functions to answer. These are the functions, with JSON Schemas of their "
    "arguments:\n<tools>{tools}</tools>\n"
    "To call functions, reply with nothing but a JSON list of calls between <tool_call> and "
    "</tool_call>, for example:\n"
    '<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]'
    "</tool_call>\nIf no function fits, reply in plain text.")


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools ask of the server.

    Attributes:
        format: the model's tool-call format.
        tools: the functions the model may call.
        choice: ``none``, ``auto``, ``required`` or ``named``.
        named: the function a ``named`` choice must call.
        parallel: more than one call per answer is allowed (``parallel_tool_calls``).
    """

    format: ToolCallFormat
    tools: tuple[ToolDefinition, ...]
    choice: str
    named: str | None
    parallel: bool

    @property
    def forced(self) -> bool:
        """Whether the answer can only be calls (``required``, or a named function)."""
        return self.choice in ("required", "named")

    def parser(self) -> CallParser | None:
        """A fresh call parser for one choice; None when calls are not parsed (``none``)."""
        return None if self.choice == "none" else self.format.parser(self.tools)

    def constraint(self, answer: StructuredOutput | None) -> StructuredOutput | None:
        """The output constraint: calls only for ``required`` and ``named``; for ``auto``,
        text or text then calls, the calls held to the tools' schemas once opened, or with a
        JSON-schema ``answer`` (``response_format``) a call or that answer.

        Raises:
            APIError: 400 naming ``response_format`` for another constraint alongside calls.
        """
        if self.choice == "none":
            return answer
        if answer is not None and (self.choice != "auto" or answer.kind != "json"):
            raise invalid_request("response_format (or another output constraint) cannot be "
                                  f"combined with tool_choice {self.choice!r}; only a JSON "
                                  "schema with tool_choice 'auto'", answer.param or None)
        tools = [t for t in self.tools if self.named in (None, t.function.name)]
        parallel = self.parallel and self.choice != "named"
        if answer is None:
            grammar = (self.format.text_or_calls(tools, parallel) if self.choice == "auto"
                       else self.format.grammar(tools, parallel))
        else:
            grammar = (f"start: calls | answer\nanswer: %json {answer.spec}\n"
                       + self.format.grammar(tools, parallel, rule="calls"))
        return StructuredOutput("grammar", grammar, "tools")


def tool_use(body: ChatCompletionRequest, chat_template: str) -> ToolUse | None:
    """The request's tool use; None without tools.

    Raises:
        APIError: 400 naming ``tool_choice`` for a choice without tools or a function that is
            not among them, ``tools`` for duplicate names or a model whose tool-call format
            is not supported.
    """
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid_request("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) < len(names):
        raise invalid_request("tools: each function needs its own name", "tools")
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    if named is not None and named not in names:
        raise invalid_request(f"tool_choice names the function {named!r}, which is not among "
                              "tools", "tool_choice")
    fmt = tool_call_format(chat_template)
    kind = "named" if named else (choice or "auto")
    if fmt is None and kind != "none":
        raise invalid_request("this model's chat template writes tool calls in a format the "
                              "server does not parse; tool_choice 'none' only", "tools")
    if kind != "none":  # the calls' grammar holds each tool's arguments to its schema
        _refuse_bad_parameters(tools)
    return ToolUse(fmt or SMOLLM2, tools, kind, named, body.parallel_tool_calls is not False)


def _refuse_bad_parameters(tools: Sequence[ToolDefinition]) -> None:
    """Refuses a tool whose arguments' schema the calls' grammar cannot hold them to, naming
    the tool and llguidance's reason (the worker, checking the whole grammar, could only name
    the call's own ``arguments``, or cut the reason short), or bounds llguidance must never
    see (:mod:`contract.schema_limits`: it would crash this process).

    Raises:
        APIError: 400 naming ``tools[i].function.parameters``.
    """
    for index, tool in enumerate(tools):
        schema = arguments_schema(tool.function.parameters)
        error = schema_fault(schema) or _schema_error(json.dumps(schema))
        if error:
            param = f"tools[{index}].function.parameters"
            raise invalid_request(f"{param}: {error}", param)


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str) -> str:
    """llguidance's objection to a JSON schema (its text), checked without a tokenizer; ""
    for none. Cached: a client sends the same tools turn after turn."""
    return llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_json_schema(schema))


def template_conversation(body: ChatCompletionRequest, use: ToolUse | None,
                          chat_template: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages, and the ``tools`` keyword, to give ``apply_chat_template``.

    A template that renders tools gets them as it expects: ``tools`` in OpenAI's shape, an
    assistant's ``tool_calls`` with their arguments as objects, ``tool`` messages with their
    call's id and name. For one that does not (SmolLM2's), the server writes the tools into the
    system message and earlier calls and results into plain turns, in the SmolLM2 format.

    Raises:
        APIError: 400 naming ``messages[i].tool_call_id`` for a result of no earlier call.
    """
    names = _call_names(body.messages)
    fmt = use.format if use else (tool_call_format(chat_template) or SMOLLM2)
    if fmt.renders_tools_itself:
        messages = [_template_message(m, names) for m in body.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in use.tools] if use else None
        return messages, ({"tools": tools} if tools else {})
    messages = _written_out(body.messages)
    if use:
        messages = _with_tools_described(messages, use.tools)
    return messages, {}


def _call_names(messages: Sequence[ChatMessage]) -> dict[str, str]:
    """Each earlier call's id → its function's name; refuses results of unknown calls."""
    names: dict[str, str] = {}
    for index, message in enumerate(messages):
        for call in message.tool_calls or ():
            names[call.id] = call.function.name
        if message.role == "tool" and message.tool_call_id not in names:
            raise invalid_request(
                f"messages[{index}]: a tool message must answer a call of an earlier "
                f"assistant message; no call has id {message.tool_call_id!r}",
                f"messages[{index}].tool_call_id")
    return names


def _template_message(message: ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id,
                "name": names[message.tool_call_id], "content": message.content or ""}
    rendered: dict[str, Any] = message.template_dict()
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name,
                          "arguments": json.loads(call.function.arguments)}}
            for call in message.tool_calls]
    return rendered


def _written_out(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for a template without tools: calls appended to the assistant's text, and
    each run of tool results as one user turn of ``<tool_response>`` blocks (templates that
    want alternating roles accept it)."""
    written: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>{message.content or ''}</tool_response>"
            if written and written[-1].get("tool_results"):
                written[-1]["content"] += "\n" + response
            else:
                written.append({"role": "user", "content": response, "tool_results": True})
            continue
        rendered: dict[str, Any] = message.template_dict()
        if message.tool_calls:
            calls = [ParsedCall(c.function.name, json.loads(c.function.arguments))
                     for c in message.tool_calls]
            text = SMOLLM2.call_text(calls)
            rendered["content"] = f"{rendered['content']}\n{text}" if rendered["content"] \
                else text
        written.append(rendered)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in written]


def _with_tools_described(messages: list[dict[str, Any]],
                          tools: Sequence[ToolDefinition]) -> list[dict[str, Any]]:
    functions = [tool.function.model_dump(exclude_none=True, exclude={"strict"})
                 for tool in tools]
    preamble = _SMOLLM2_TOOLS_PREAMBLE.format(tools=json.dumps(functions, ensure_ascii=False))
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]
