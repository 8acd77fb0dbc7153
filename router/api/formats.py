"""The OpenAI shapes of each endpoint's answers: ``chat.completion`` (and its chunks) and
``text_completion``. A chat answer with tools is split into content and ``tool_calls`` here,
by the request's call parser (:mod:`router.api.tool_formats`)."""

from __future__ import annotations

import json
import uuid
from typing import Protocol

from pydantic import BaseModel

from contract.request import TokenLogprob
from router.api.jobs import Job
from router.api.token_strings import TokenStringsFn
from router.api.tool_formats import CallParser, ParsedCall
from router.api.usage import Tally
from router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
    Usage,
)


class Format(Protocol):
    """The OpenAI shapes of one endpoint's answers."""

    def opening(self) -> list[BaseModel]:
        """Events sent before any text."""
        ...

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
             ) -> list[BaseModel]:
        """Events carrying new text (and its tokens' logprobs) of choice ``index``; none
        while text is held back (a tool call not yet complete)."""
        ...

    def finish(self, index: int, reason: str, stop_reason: int | str | None,
               ) -> list[BaseModel]:
        """The events ending choice ``index``: what was held back, then the finish reason
        (``stop`` becomes ``tool_calls`` when the choice made calls) and vLLM's
        ``stop_reason`` (the stop string or stop token id that ended it, else None)."""
        ...

    def usage(self, usage: Usage) -> BaseModel:
        """The last event when ``include_usage``: no choices, only usage."""
        ...

    def response(self, tally: Tally) -> BaseModel:
        """The whole non-streaming answer."""
        ...


class ChatFormat:
    """``chat.completion`` and ``chat.completion.chunk`` shapes."""

    def __init__(self, job: Job, token_strings: TokenStringsFn):
        self.job = job
        self.token_strings = token_strings
        self._parsers: dict[int, CallParser] = {}  # per choice, with tools
        self._calls_sent: dict[int, int] = {}  # per choice: tool calls streamed so far

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
               ) -> ChatCompletionChunk:
        job = self.job
        return ChatCompletionChunk(id=job.response_id, created=job.created,
                                   model=job.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        """The first delta of each choice announces the assistant's turn: with empty content,
        or none where the answer can only be tool calls (as OpenAI streams them)."""
        use = self.job.tool_use
        content = None if use and use.forced else ""
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                      content=content))])
                for i in range(self.job.request.sampling.n)]

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
             ) -> list[BaseModel]:
        """A content delta, and a delta per tool call completed by ``text``."""
        parser = self._parser(index)
        calls: list[ParsedCall] = []
        if parser is not None:
            text, calls = parser.feed(text)
        events: list[BaseModel] = []
        if text or logprobs:
            events.append(self._chunk([ChatChunkChoice(
                index=index, delta=ChatDelta(content=text or None),
                logprobs=self._logprobs(logprobs))]))
        return events + self._call_events(index, calls)

    def finish(self, index: int, reason: str, stop_reason: int | str | None,
               ) -> list[BaseModel]:
        """What the parser held back, then an empty delta with the finish reason."""
        parser = self._parser(index)
        events: list[BaseModel] = []
        if parser is not None:
            text, calls = parser.close()
            if text:
                events.append(self._chunk([ChatChunkChoice(index=index,
                                                           delta=ChatDelta(content=text))]))
            events += self._call_events(index, calls)
            reason = _with_calls(reason, parser)
        return events + [self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                                      finish_reason=reason,
                                                      stop_reason=stop_reason)])]

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: Tally) -> BaseModel:
        """The ``chat.completion`` object."""
        job = self.job
        choices = [ChatChoice(index=index, logprobs=self._logprobs(c.logprobs),
                              stop_reason=c.stop_reason,
                              **self._message("".join(c.text), c.finish_reason))
                   for index, c in tally.ordered()]
        return ChatCompletionResponse(id=job.response_id, created=job.created,
                                      model=job.model, choices=choices, usage=tally.usage())

    def _message(self, text: str, reason: str) -> dict:
        """A whole choice's message and finish reason: text, or content and tool calls."""
        use = self.job.tool_use
        parser = use.parser() if use else None
        if parser is None:
            return {"message": AssistantMessage(content=text), "finish_reason": reason}
        content, calls = parser.feed(text)
        rest, more = parser.close()
        content, calls = content + rest, calls + more
        message = AssistantMessage(content=content or (None if calls else ""),
                                   tool_calls=[_tool_call(call) for call in calls] or None)
        return {"message": message, "finish_reason": _with_calls(reason, parser)}

    def _parser(self, index: int) -> CallParser | None:
        use = self.job.tool_use
        if use is None:
            return None
        if index not in self._parsers:
            parser = use.parser()
            if parser is None:
                return None
            self._parsers[index] = parser
        return self._parsers[index]

    def _call_events(self, index: int, calls: list[ParsedCall]) -> list[BaseModel]:
        """One delta per call, numbered per choice from 0 (OpenAI's ``index``)."""
        events: list[BaseModel] = []
        for call in calls:
            number = self._calls_sent.get(index, 0)
            self._calls_sent[index] = number + 1
            delta = DeltaToolCall(index=number, **_tool_call(call).model_dump())
            events.append(self._chunk([ChatChunkChoice(
                index=index, delta=ChatDelta(tool_calls=[delta]))]))
        return events

    def _logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if self.job.request.sampling.logprobs is None:
            return None
        return ChatLogprobs(content=[self._entry(e) for e in entries or ()])

    def _entry(self, entry: TokenLogprob) -> ChatTokenLogprob:
        text, raw = self.token_strings(entry.token_id)
        top = [TopLogprob(token=t, logprob=lp, bytes=b)
               for (t, b), lp in ((self.token_strings(i), lp) for i, lp in entry.top)]
        return ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top)


class CompletionFormat:
    """``text_completion`` shapes (the same object streams, chunk by chunk)."""

    def __init__(self, job: Job, token_strings: TokenStringsFn):
        self.job = job
        self.token_strings = token_strings
        self._offsets: dict[int, int] = {}  # per choice: text offset of its next token

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None,
               ) -> CompletionResponse:
        job = self.job
        return CompletionResponse(id=job.response_id, created=job.created,
                                  model=job.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        """Text completions open with text directly."""
        return []

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
             ) -> list[BaseModel]:
        """A text chunk."""
        return [self._chunk([CompletionChoice(index=index, text=text,
                                              logprobs=self._logprobs(index, logprobs))])]

    def finish(self, index: int, reason: str, stop_reason: int | str | None,
               ) -> list[BaseModel]:
        """An empty text chunk with the finish reason."""
        return [self._chunk([CompletionChoice(index=index, text="", finish_reason=reason,
                                              stop_reason=stop_reason)])]

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: Tally) -> BaseModel:
        """The ``text_completion`` object."""
        choices = [CompletionChoice(index=index, text="".join(c.text),
                                    logprobs=self._logprobs(index, c.logprobs),
                                    finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason)
                   for index, c in tally.ordered()]
        return self._chunk(choices, tally.usage())

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None,
                  ) -> CompletionLogprobs | None:
        """The legacy parallel-list shape; ``top_logprobs`` also holds the sampled token (as
        vLLM's do), and ``text_offset`` counts the token texts before each token."""
        if self.job.request.sampling.logprobs is None:
            return None
        result = CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        for entry in entries or ():
            text = self.token_strings(entry.token_id)[0]
            top = {self.token_strings(i)[0]: lp for i, lp in entry.top}
            top.setdefault(text, entry.logprob)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return result


def _tool_call(call: ParsedCall) -> ToolCall:
    """A parsed call as OpenAI returns it: a fresh id, the arguments as JSON text."""
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=call.name, arguments=json.dumps(
                        call.arguments, ensure_ascii=False)))


def _with_calls(reason: str, parser: CallParser) -> str:
    """``stop`` becomes ``tool_calls`` when the choice made calls (OpenAI's meaning); a
    ``length`` stays: the answer was cut, whatever it held."""
    return "tool_calls" if reason == "stop" and parser.calls_made else reason
