"""How a model family writes tool calls: the text a call is, the grammar that holds output to
calls, and the streaming parser that reads calls back out of generated text.

A format is picked from the model's chat template (:func:`tool_call_format`):

* ``hermes``: the template renders ``tools`` and writes each call as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; Qwen2, Qwen2.5, Qwen3 and
  the Hermes fine-tunes (vLLM's ``hermes`` parser).
* ``llama3_json``: the template renders ``tools`` and a call is the bare JSON object
  ``{"name": ..., "parameters": {...}}``, several joined by ``; ``; Llama 3.1 to 3.3
  (vLLM's ``llama3_json``).
* ``smollm2``: the template has no tools at all (SmolLM2's, and any other such), so the
  server writes them into the system message (:mod:`router.api.tool_messages`) in the format
  SmolLM2-Instruct was tuned on: ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>``,
  one JSON list of calls.

Parsers accept a call only when it is well-formed JSON naming one of the request's tools;
anything else stays content, so a model that writes a malformed call returns text rather
than a call the client cannot run.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contract.schema_limits import DATA_KEYWORDS
from router.protocol import ToolDefinition

_NAMES_TOOLS = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ParsedCall:
    """A tool call read from the output: the function's name and its arguments."""

    name: str
    arguments: dict[str, Any]


class CallParser(ABC):
    """Splits one choice's streamed text into content and tool calls.

    :meth:`feed` returns what can be said now; text that may still turn out to be part of a
    call is held back until it is decided, and :meth:`close` settles the rest at the end.
    """

    def __init__(self, tool_names: frozenset[str]):
        self.tool_names = tool_names
        self.calls_made = 0

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content decided so far and calls completed so far, from ``text`` on."""

    @abstractmethod
    def close(self) -> tuple[str, list[ParsedCall]]:
        """The held-back rest: content, and a call left open (e.g. by EOS before its end tag)
        if it parses."""

    def _calls(self, text: str, arguments_key: str) -> list[ParsedCall] | None:
        """The calls ``text`` holds (one object or a list of them), or None if it holds
        anything else."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None
        items = value if isinstance(value, list) else [value]
        calls = [self._call(item, arguments_key) for item in items]
        return None if not calls or None in calls else calls

    def _call(self, item: Any, arguments_key: str) -> ParsedCall | None:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or item["name"] not in self.tool_names:
            return None
        arguments = item.get(arguments_key, item.get("arguments", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        return ParsedCall(item["name"], arguments) if isinstance(arguments, dict) else None


class TaggedCallParser(CallParser):
    """Calls between a start and an end tag; text outside the tags is content."""

    def __init__(self, tool_names: frozenset[str], start: str, end: str):
        super().__init__(tool_names)
        self.start, self.end = start, end
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(self.start)
                if at < 0:
                    content.append(self._content(self._decided_content()))
                    break
                content.append(self._content(self._buffer[:at]))
                self._buffer = self._buffer[at + len(self.start):]
                self._in_call = True
            else:
                at = _end_tag(self._buffer, self.end)
                if at < 0:
                    break
                body, self._buffer = self._buffer[:at], self._buffer[at + len(self.end):]
                self._in_call = False
                parsed = self._calls(body, "arguments")
                if parsed is None:
                    content.append(self.start + body + self.end)
                else:
                    calls.extend(parsed)
                    self.calls_made += len(parsed)
        return "".join(content), calls

    def close(self) -> tuple[str, list[ParsedCall]]:
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            parsed = self._calls(rest, "arguments")
            if parsed is not None:
                self.calls_made += len(parsed)
                return "", parsed
            rest = self.start + rest
        return self._content(rest), []

    def _decided_content(self) -> str:
        """The buffer's text that cannot be the start of a tag, taken out of the buffer."""
        keep = _partial_tag(self._buffer, self.start)
        if self.calls_made and not self._buffer.strip():
            keep = len(self._buffer)  # whitespace between calls: dropped unless text follows
        decided = self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(decided):]
        return decided

    def _content(self, text: str) -> str:
        """``text``, unless it is only whitespace after a call (between or after calls)."""
        return "" if self.calls_made and not text.strip() else text


class JsonCallParser(CallParser):
    """Calls as bare JSON objects (``{"name": ..., "parameters": ...}``, several joined by
    ``;``): an answer whose first non-blank character is ``{`` is held to its end and parsed;
    any other answer is content."""

    def __init__(self, tool_names: frozenset[str]):
        super().__init__(tool_names)
        self._buffer = ""
        self._decided: bool | None = None  # None until the first non-blank character

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._decided is False:
            return text, []
        self._buffer += text
        stripped = self._buffer.lstrip()
        if not stripped:
            return "", []
        if self._decided is None:
            self._decided = stripped.startswith("{")
        if self._decided:
            return "", []
        text, self._buffer = self._buffer, ""
        return text, []

    def close(self) -> tuple[str, list[ParsedCall]]:
        rest, self._buffer = self._buffer, ""
        if not self._decided:
            return rest, []
        parsed = [self._calls(part, "parameters") for part in _json_objects(rest)]
        if not parsed or None in parsed:
            return rest, []
        calls = [call for part in parsed for call in part]
        self.calls_made += len(calls)
        return "", calls


class ToolCallFormat(ABC):
    """One family's tool-call format."""

    name: str
    renders_tools_itself: bool
    """Whether the model's chat template renders ``tools`` (else the server writes them)."""

    @abstractmethod
    def parser(self, tools: Sequence[ToolDefinition]) -> CallParser:
        """A fresh parser for one choice, accepting calls to ``tools`` only."""

    @abstractmethod
    def grammar(self, tools: Sequence[ToolDefinition], parallel: bool,
                rule: str = "start") -> str:
        """A Lark grammar (llguidance's dialect) whose rule ``rule`` (the start rule unless
        the grammar is embedded in a larger one) matches calls to ``tools`` in this format,
        their arguments following each tool's schema: one call, or one or more when
        ``parallel``."""

    @abstractmethod
    def text_or_calls(self, tools: Sequence[ToolDefinition], parallel: bool) -> str:
        """A Lark grammar for ``tool_choice`` ``auto``: any text, or text that opens calls in
        this format and then holds them to :meth:`grammar`'s (llguidance's lazy lexemes: free
        until the opening is written, as llama.cpp's lazy tool-call grammars are), so a call
        the model starts always parses and names one of ``tools`` with valid arguments."""


class TaggedFormat(ToolCallFormat):
    """Calls between ``<tool_call>`` and ``</tool_call>`` tags, text allowed before them."""

    start, end = "<tool_call>", "</tool_call>"

    def parser(self, tools: Sequence[ToolDefinition]) -> CallParser:
        return TaggedCallParser(_names(tools), self.start, self.end)

    def grammar(self, tools: Sequence[ToolDefinition], parallel: bool,
                rule: str = "start") -> str:
        return self._calls_grammar(tools, parallel, rule, f'opening: "{self.start}"')

    def text_or_calls(self, tools: Sequence[ToolDefinition], parallel: bool) -> str:
        return f"start: TEXT | calls\n{_TEXT}\n" + self._calls_grammar(
            tools, parallel, "calls", f'opening[lazy]: TEXT "{self.start}"')

    @abstractmethod
    def _calls_grammar(self, tools: Sequence[ToolDefinition], parallel: bool, rule: str,
                       opening: str) -> str:
        """:meth:`grammar`'s calls, reached through the rule that the Lark line ``opening``
        defines: the opening tag alone, or (lazily) any text and then the tag."""


class HermesFormat(TaggedFormat):
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, one tag per call."""

    name = "hermes"
    renders_tools_itself = True

    def _calls_grammar(self, tools: Sequence[ToolDefinition], parallel: bool, rule: str,
                       opening: str) -> str:
        more = f' ("\\n{self.start}" body)*' if parallel else ""
        return (f"{rule}: opening body{more}\n{opening}\n"
                f'body: "\\n" call "\\n{self.end}"\n'
                f"call: %json {_call_schema(tools, 'arguments')}\n")


class SmolLM2Format(TaggedFormat):
    """``<tool_call>[{"name": ..., "arguments": ...}, ...]</tool_call>``, written into the
    system message by the server."""

    name = "smollm2"
    renders_tools_itself = False

    def _calls_grammar(self, tools: Sequence[ToolDefinition], parallel: bool, rule: str,
                       opening: str) -> str:
        more = ' (", " call)*' if parallel else ""
        return (f'{rule}: opening "[" call{more} "]{self.end}"\n{opening}\n'
                f"call: %json {_call_schema(tools, 'arguments')}\n")

    def call_text(self, calls: Sequence[ParsedCall]) -> str:
        """How an assistant's earlier calls are written back into the conversation: as the
        model writes them."""
        listed = [{"name": call.name, "arguments": call.arguments} for call in calls]
        return f"{self.start}{json.dumps(listed, ensure_ascii=False)}{self.end}"


class Llama3JsonFormat(ToolCallFormat):
    """``{"name": ..., "parameters": ...}``, several joined by ``; ``."""

    name = "llama3_json"
    renders_tools_itself = True

    def parser(self, tools: Sequence[ToolDefinition]) -> CallParser:
        return JsonCallParser(_names(tools))

    def grammar(self, tools: Sequence[ToolDefinition], parallel: bool,
                rule: str = "start") -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"{rule}: call{more}\ncall: %json {_call_schema(tools, 'parameters')}\n"

    def text_or_calls(self, tools: Sequence[ToolDefinition], parallel: bool) -> str:
        """Calls open the answer (after blanks, as the parser reads them): text is any answer
        whose first non-blank character is not ``{``."""
        return ("start: PLAIN | BLANKS calls\nBLANKS: /\\s*/\n"
                "PLAIN: /\\s*([^{\\s](.|\\n)*)?/\n" + self.grammar(tools, parallel, "calls"))


HERMES, LLAMA3_JSON, SMOLLM2 = HermesFormat(), Llama3JsonFormat(), SmolLM2Format()


def tool_call_format(chat_template: str) -> ToolCallFormat | None:
    """The tool-call format of a model, from its chat template's source; None when the
    template renders tools in a format no parser here reads (tools are then refused)."""
    if not _NAMES_TOOLS.search(chat_template):
        return SMOLLM2
    if "<tool_call>" in chat_template:
        return HERMES
    if "<|python_tag|>" in chat_template or '"parameters": ' in chat_template:
        return LLAMA3_JSON
    return None


_TEXT = "TEXT: /(.|\\n)*/"
"""Free text, in the grammars that let the model write text before its calls."""


def _names(tools: Sequence[ToolDefinition]) -> frozenset[str]:
    return frozenset(tool.function.name for tool in tools)


_STANDARD_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON layout for calls: ``json.dumps``'s, which is how a call is rendered back
into the next turn, so the prefix cache holds the text the model wrote."""


def _call_schema(tools: Sequence[ToolDefinition], arguments_key: str) -> str:
    """The JSON Schema of one call to any of ``tools``, ``name`` first, in standard spacing.

    Each tool's arguments schema is placed inside it, so its local references (``#``,
    ``#/$defs/...``, as the SDK writes nested Pydantic models) are rebased to where it is
    placed: they would otherwise point into the call's schema."""
    def option(tool: ToolDefinition, at: str) -> dict[str, Any]:
        arguments = _rebased(arguments_schema(tool.function.parameters),
                             f"{at}/properties/{arguments_key}")
        return {"type": "object",
                "properties": {"name": {"const": tool.function.name}, arguments_key: arguments},
                "required": ["name", arguments_key], "additionalProperties": False}

    if len(tools) == 1:
        schema = option(tools[0], "#")
    else:
        schema = {"anyOf": [option(tool, f"#/anyOf/{i}") for i, tool in enumerate(tools)]}
    return json.dumps({**schema, "x-guidance": _STANDARD_SPACING})


def _rebased(schema: Any, pointer: str) -> Any:
    """``schema`` with each local reference (a ``$ref`` of ``#`` or ``#/...``, which points
    into ``schema`` itself) made to point to the same place under ``pointer``."""
    if isinstance(schema, list):
        return [_rebased(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: (pointer + value[1:] if key == "$ref" and _is_local_pointer(value)
                  else value if key in DATA_KEYWORDS else _rebased(value, pointer))
            for key, value in schema.items()}


def _is_local_pointer(ref: Any) -> bool:
    """Whether ``ref`` is a JSON pointer into its own document (``#`` or ``#/...``); a named
    anchor (``#name``) is left as it is."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments: only the named ones unless the schema says otherwise
    (``additionalProperties``), so a function without parameters gets ``{}``; JSON Schema's
    own default would let the model invent arguments no function takes."""
    schema = {"type": "object", **(parameters or {})}
    schema.setdefault("additionalProperties", False)
    return schema


def _end_tag(text: str, tag: str) -> int:
    """Where the first ``tag`` of ``text`` outside a JSON string starts, or -1: a call's
    arguments may hold the end tag as text (``{"html": "</tool_call>"}``)."""
    at = text.find(tag)
    while at >= 0 and _in_json_string(text, at):
        at = text.find(tag, at + 1)
    return at


def _in_json_string(text: str, end: int) -> bool:
    """Whether ``text[end]`` lies inside a JSON string, reading ``text`` from its start."""
    inside = escaped = False
    for char in text[:end]:
        if escaped:
            escaped = False
        elif char == "\\" and inside:
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _json_objects(text: str) -> list[str]:
    """The JSON texts of ``text`` split at top-level ``;`` (Llama's separator); a text that
    does not split cleanly is returned whole (its parse then fails)."""
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(text):
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            break
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[at:end])
        at = end
    return parts
