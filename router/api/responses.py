"""OpenAI's Responses API (``POST /v1/responses``), served over the chat path, as vLLM serves it.

A Responses request is a chat turn in other words: ``instructions`` is a system message,
``input`` the conversation (messages, the model's function calls and their outputs),
``text.format`` the response format, function ``tools`` the chat's tools. It is translated
into a :class:`~router.protocol.ChatCompletionRequest` (:func:`chat_request`) and run as a
chat job: tokenized through the chat template, routed by its prefix, its tool calls parsed out
of its text. The answer is a ``response`` object, or the Responses stream of named events
(``response.created`` ... ``response.completed``).

Responses are not stored (``store`` is accepted and changes nothing): a request cannot name a
``previous_response_id``; a client sends the whole conversation in ``input``, as it does with
``store: false`` against OpenAI.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from contract.request import GenerationChunk
from router.api.disconnect import close_stream
from router.api.formats import tool_call
from router.api.jobs import Job
from router.api.stream import finish_reason, next_chunk
from router.api.tool_formats import ParsedCall
from router.api.usage import Tally
from router.errors import APIError, from_backend_exception, from_validation_errors, invalid_request
from router.protocol import ChatCompletionRequest, Usage, refuse_unless_neutral


class _Item(BaseModel):
    """Base of ``input`` items. Fields it does not know are ignored: an earlier response's
    items come back as the SDK dumps them, with fields of its version (``phase``,
    ``namespace``, ``caller`` ...) that name nothing the output depends on."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    status: str | None = None


class TextPart(BaseModel):
    """A text part of a message's ``content``: the user's ``input_text``, or an earlier
    answer's ``output_text`` (its ``annotations`` and ``logprobs`` ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Item):
    """A message of the conversation (``type`` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_is_one_part(cls, content: Any) -> Any:
        return [{"type": "input_text", "text": content}] if isinstance(content, str) else content

    def text(self) -> str:
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    """A call the model made in an earlier turn (``arguments``: the JSON text of an object)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


def _item_type(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type, custom_error_type="unsupported_value",
                  custom_error_message="an input item must be a message, a function_call or "
                                       "a function_call_output"),
]


class FunctionTool(BaseModel):
    """A function the model may call: ``{"type": "function", "name", "parameters", ...}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON following ``schema``."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


# Fields refused unless neutral: the values that ask for nothing, and why.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), "responses are not stored; send the whole conversation in "
                                 "input"),
    "conversation": ((), "conversations are not stored; send the whole conversation in input"),
    "prompt": ((), "stored prompt templates are not served"),
    "reasoning": ((), "the served models have no reasoning controls"),
    "background": ((False,), "responses are answered in the request"),
    "include": (([],), "no output beyond the response's own is served"),
    "top_logprobs": ((0,), "log-probabilities are served by /v1/chat/completions"),
    "max_tool_calls": ((), "the calls of one answer are not capped"),
    "stream_options": ((), "the Responses stream has no options here"),
}


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``.

    Accepted and ignored, as they never change the output: ``store`` (nothing is stored),
    ``metadata`` (returned as sent), ``user``, ``safety_identifier``, ``prompt_cache_key``,
    ``service_tier``. ``truncation: "auto"`` keeps the conversation's last tokens that fit
    beside ``max_output_tokens`` (vLLM's ``truncate_prompt_tokens: -1``). Refused: what
    needs a stored response, reasoning controls, background runs, log-probabilities and
    every tool but functions.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    background: Any = None
    include: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    stream_options: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral, why = _UNSUPPORTED[info.field_name]
        return refuse_unless_neutral(value, info.field_name, neutral, why)


_ITEM_TAGS = ("message", "function_call", "function_call_output")


def parse_request(raw: dict[str, Any]) -> ResponsesRequest:
    """``raw`` (the JSON body) validated.

    Raises:
        APIError: 400 naming the first field at fault, as ``input[2].content[0].type``.
    """
    try:
        return ResponsesRequest.model_validate(raw)
    except ValidationError as exc:
        errors = [{**error, "loc": _without_item_tag(tuple(error["loc"]))}
                  for error in exc.errors()]
        raise from_validation_errors(errors) from None


def _without_item_tag(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """An input item's error path without the item's type, which pydantic puts after its
    index: ``("input", 0, "message", "content")`` is ``input[0].content``."""
    if loc[:1] == ("input",) and len(loc) > 2 and loc[2] in _ITEM_TAGS:
        return loc[:2] + loc[3:]
    return loc


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks what ``body`` asks.

    Raises:
        APIError: 400 where the conversation, the tools or the format is one chat refuses
            (named by its Responses parameter: ``input``, ``tools``, ``text.format``,
            ``tool_choice``).
    """
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body),
                            "max_completion_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p,
                            "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools is not None:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in body.tools]
    if isinstance(body.tool_choice, str) and body.tool_choice not in ("none", "auto", "required"):
        raise invalid_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "name": <string>}', "tool_choice")
    if isinstance(body.tool_choice, dict):
        if set(body.tool_choice) != {"type", "name"} or body.tool_choice["type"] != "function":
            raise invalid_request('tool_choice must be "none", "auto", "required" or '
                                  '{"type": "function", "name": <string>}', "tool_choice")
        chat["tool_choice"] = {"type": "function",
                               "function": {"name": body.tool_choice["name"]}}
    else:
        chat["tool_choice"] = body.tool_choice
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        chat["response_format"] = _response_format(text_format)
    if body.truncation == "auto":
        chat["truncate_prompt_tokens"] = -1
    try:
        return ChatCompletionRequest.model_validate(
            {key: value for key, value in chat.items() if value is not None})
    except ValidationError as exc:
        raise in_responses_terms(from_validation_errors(exc.errors())) from None


async def responses_job(job: Awaitable[Job]) -> Job:
    """The chat job, its 400s naming the Responses parameters (:func:`in_responses_terms`),
    and its output constraint too, where ``text.format`` set it (the worker names it in a
    refusal)."""
    try:
        job = await job
    except APIError as exc:
        raise in_responses_terms(exc) from None
    structured = job.request.sampling.structured
    if structured is None or structured.param not in (None, "response_format"):
        return job
    sampling = replace(job.request.sampling, structured=replace(structured, param="text.format"))
    return replace(job, request=replace(job.request, sampling=sampling))


# Chat's names of what a Responses request set, and the Responses names: a conversation's
# message is somewhere in ``input`` (items and messages do not map one to one).
_RENAMES = ((re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"messages(\[\d+\])?(\.[\w\[\].]*\w)?"), "input"),
            (re.compile(r"response_format"), "text.format"),
            (re.compile(r"max_completion_tokens|max_tokens"), "max_output_tokens"))


def in_responses_terms(error: APIError) -> APIError:
    """``error`` naming, in its ``param`` and its message, the Responses parameters that set
    the chat parameters it names."""
    for pattern, name in _RENAMES:
        error.message = pattern.sub(name, error.message)
        if error.param:
            error.param = pattern.sub(name, error.param)
    return error


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat conversation: the instructions as a system message, then each input item; a
    run of the model's function calls joins the assistant message before it."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    for item in body.input:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    return messages


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.json_schema is None:
        raise invalid_request("text.format of type json_schema needs a schema", "text.format",
                              "missing_required_parameter")
    schema = {"name": text_format.name or "response", "schema": text_format.json_schema,
              "description": text_format.description, "strict": text_format.strict}
    return {"type": "json_schema",
            "json_schema": {key: value for key, value in schema.items() if value is not None}}


class ResponsesFormat:
    """A chat job's output as Responses output items, streamed as events or whole.

    The output is split into items as it comes: text goes to a message item (opened at its
    first text), each tool call the parser completes to a ``function_call`` item (closing the
    message before it, so that items stay in the order the model wrote them). A non-streamed
    answer runs the same steps over the whole text, so both give the same items.
    """

    def __init__(self, job: Job, body: ResponsesRequest):
        self.job = job
        self.body = body
        self._calls = job.tool_use.parser() if job.tool_use is not None else None
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event: its name, then its data with ``type`` and ``sequence_number``."""
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def opening_events(self) -> list[str]:
        response = self.snapshot("in_progress")
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def text_events(self, text: str) -> list[str]:
        """The events of a piece of the output's text (calls completed by it included)."""
        calls = []
        if self._calls is not None:
            text, calls = self._calls.feed(text)
        return self._text(text) + [event for call in calls for event in self._call(call)]

    def finish_events(self, status: str) -> list[str]:
        """What the parser held back, then the open message closed (an empty one where the
        output made no item at all) with the response's ``status``: ``incomplete`` where
        the output was cut."""
        events: list[str] = []
        if self._calls is not None:
            text, calls = self._calls.close()
            events += self._text(text) + [event for call in calls
                                         for event in self._call(call)]
        if not self.items:
            events += self._open_message()
        return events + self._close_message(status)

    def snapshot(self, status: str, tally: Tally | None = None) -> dict[str, Any]:
        """The ``response`` object: as it stands (``in_progress``), or finished from the
        tally's usage (``completed``, or ``incomplete`` when cut at ``max_output_tokens``)."""
        body = self.body
        text_format = body.text.format if body.text is not None else None
        return {
            "id": self.job.response_id, "object": "response", "created_at": self.job.created,
            "status": status, "model": self.job.model, "output": self.items,
            "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "error": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "text": {"format": (text_format.model_dump(by_alias=True, exclude_none=True)
                                if text_format is not None else {"type": "text"})},
            "truncation": body.truncation or "disabled", "store": False,
            "previous_response_id": None, "reasoning": None,
            "usage": _usage(tally.usage()) if tally is not None else None,
        }

    def response(self, tally: Tally) -> ResponseObject:
        """The whole answer (``stream: false``)."""
        choice = tally.choices.get(0)
        status = _status(choice.finish_reason if choice else "stop")
        self.text_events("".join(choice.text) if choice else "")
        self.finish_events(status)
        return ResponseObject(**self.snapshot(status, tally))

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        events = self._open_message() if self._message is None else []
        self._message["content"][0]["text"] += text
        return events + [self.event("response.output_text.delta", delta=text, logprobs=[],
                                    **self._where())]

    def _open_message(self) -> list[str]:
        self._message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                         "status": "in_progress", "role": "assistant", "content": [
                             {"type": "output_text", "text": "", "annotations": [],
                              "logprobs": []}]}
        self.items.append(self._message)
        empty = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item={**self._message, "content": []}),
                self.event("response.content_part.added", part=empty, **self._where())]

    def _close_message(self, status: str = "completed") -> list[str]:
        message = self._message
        if message is None:
            return []
        part = message["content"][0]
        events = [self.event("response.output_text.done", text=part["text"], logprobs=[],
                             **self._where()),
                  self.event("response.content_part.done", part=part, **self._where())]
        message["status"] = status
        self._message = None
        return events + [self.event("response.output_item.done",
                                    output_index=self.items.index(message), item=message)]

    def _call(self, call: ParsedCall) -> list[str]:
        """A completed call as a ``function_call`` item: added, its arguments, done."""
        events = self._close_message()
        parsed = tool_call(call)
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                "call_id": parsed.id, "name": parsed.function.name,
                "arguments": parsed.function.arguments}
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return events + [
            self.event("response.output_item.added", output_index=where["output_index"],
                       item={**item, "status": "in_progress", "arguments": ""}),
            self.event("response.function_call_arguments.delta", delta=item["arguments"],
                       **where),
            self.event("response.function_call_arguments.done", arguments=item["arguments"],
                       name=item["name"], **where),
            self.event("response.output_item.done", item=item, output_index=where["output_index"]),
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._message["id"], "output_index": self.items.index(self._message),
                "content_index": 0}


class ResponseObject(BaseModel):
    """A finished ``response`` object (its fields: :meth:`ResponsesFormat.snapshot`), a
    model as the app serializes answers."""

    model_config = ConfigDict(extra="allow")


async def response_events(job: Job, fmt: ResponsesFormat, first: GenerationChunk,
                          chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
    """The Responses stream: ``response.created``, the output items' events, then
    ``response.completed`` (or ``response.incomplete``) with the whole response; a failure
    midway is an ``error`` event, after which the stream ends."""
    tally = Tally(prompt_tokens=len(job.request.token_ids))
    tally.admit(first)
    try:
        for event in fmt.opening_events():
            yield event
        chunk = first
        while True:
            tally.add(chunk)
            for event in fmt.text_events(chunk.text):
                yield event
            if chunk.finish_reason is not None and chunk.is_last:
                status = _status(finish_reason(chunk.finish_reason))
                break
            chunk = await next_chunk(chunks)
        for event in fmt.finish_events(status):
            yield event
        yield fmt.event(f"response.{status}", response=fmt.snapshot(status, tally))
    except Exception as exc:
        error = from_backend_exception(exc, job.request.request_id)
        yield fmt.event("error", code=error.code, message=error.message, param=error.param)
    finally:
        await close_stream(chunks)


def _status(reason: str) -> str:
    return "incomplete" if reason == "length" else "completed"


def _usage(usage: Usage) -> dict[str, Any]:
    """Chat's usage in the Responses' names."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": usage.prompt_tokens_details.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}
