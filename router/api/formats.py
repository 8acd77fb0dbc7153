"""The OpenAI shapes of each endpoint's answers: ``chat.completion`` (and its chunks) and
``text_completion``. A chat answer with tools is split into content and ``tool_calls`` here,
by the request's call parser (:mod:`router.api.tool_formats`). A completion's ``echo`` and
vLLM's ``prompt_logprobs`` are rendered here from the worker's prompt logprobs."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from pydantic import BaseModel

from contract.request import GenerationChunk, TokenLogprob
from router.api.jobs import Job
from router.api.token_strings import TokenStringsFn, as_token_ids
from router.api.tool_formats import CallParser, ParsedCall
from router.api.tools import ToolUse
from router.api.usage import ChoiceTally, Tally
from router.errors import APIError
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
    PromptLogprob,
    PromptLogprobs,
    ToolCall,
    TopLogprob,
    Usage,
)

logger = logging.getLogger(__name__)

PromptTokens = Sequence[tuple[int, TokenLogprob | None]]
"""Prompt tokens as ``(token id, its logprobs)``; None for the first, which nothing predicts."""


class Format(Protocol):
    """The OpenAI shapes of one endpoint's answers."""

    def opening(self) -> list[BaseModel]:
        """Events sent before any text."""
        ...

    def text(self, chunk: GenerationChunk) -> list[BaseModel]:
        """Events carrying a worker chunk's new text (and its tokens' logprobs and, when
        asked, ids) of its choice; none while text is held back (a tool call not yet
        complete) unless logprobs or ids must go out. Its ``prompt_logprobs`` come with the
        choice's first output, when the worker was asked for them."""
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
        self.token_strings = _named(job, token_strings)
        self._parsers: dict[int, CallParser] = {}  # per choice, with tools
        self._calls_sent: dict[int, int] = {}  # per choice: tool calls streamed so far

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
               ) -> ChatCompletionChunk:
        job = self.job
        return ChatCompletionChunk(id=job.response_id, created=job.created,
                                   model=job.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        """The first delta of each choice announces the assistant's turn: with empty content,
        or none where the answer can only be tool calls (as OpenAI streams them); with
        ``echo``, a delta of the echoed message follows (as vLLM streams it). The very first
        carries the prompt's token ids when asked (vLLM's ``prompt_token_ids``)."""
        use = self.job.tool_use
        content = None if use and use.forced else ""
        choices = range(self.job.request.sampling.n)
        events = [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                        content=content))])
                  for i in choices]
        events[0].prompt_token_ids = _prompt_ids(self.job)
        if self.job.echo:
            events += [self._chunk([ChatChunkChoice(index=i,
                                                    delta=ChatDelta(content=self.job.echo))])
                       for i in choices]
        return events

    def text(self, chunk: GenerationChunk) -> list[BaseModel]:
        """A content delta (also when its text is held back, for its tokens' logprobs or
        ids), and a delta per tool call completed by the chunk's text (``prompt_logprobs``
        never stream: a streaming request cannot ask for them)."""
        index, text, logprobs = chunk.index, chunk.text, chunk.logprobs
        token_ids = _output_ids(self.job, chunk.token_ids)
        parser = self._parser(index)
        calls: list[ParsedCall] = []
        if parser is not None:
            text, calls = parser.feed(text)
        events: list[BaseModel] = []
        if text or logprobs or token_ids:
            events.append(self._chunk([ChatChunkChoice(
                index=index, delta=ChatDelta(content=text or None),
                logprobs=self._logprobs(logprobs), token_ids=token_ids)]))
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
            reason = _with_calls(reason, parser, self.job.tool_use)
        return events + [self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                                      finish_reason=reason,
                                                      stop_reason=stop_reason)])]

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: Tally) -> BaseModel:
        """The ``chat.completion`` object; vLLM's ``prompt_logprobs``, when asked, are
        those choice 0 came with (every choice has the same prompt)."""
        job = self.job
        choices = [ChatChoice(index=index, logprobs=self._logprobs(c.logprobs),
                              stop_reason=c.stop_reason,
                              token_ids=_output_ids(job, c.token_ids),
                              **self._message("".join(c.text), c.finish_reason))
                   for index, c in tally.ordered()]
        first = tally.choices.get(0)
        prompt_logprobs = vllm_prompt_logprobs(
            job, first.prompt_logprobs if first else None, self.token_strings)
        return ChatCompletionResponse(id=job.response_id, created=job.created,
                                      model=job.model, choices=choices, usage=tally.usage(),
                                      prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=_prompt_ids(job))

    def _message(self, text: str, reason: str) -> dict:
        """A whole choice's message and finish reason: text, or content and tool calls (the
        echoed message first, with ``echo``)."""
        use = self.job.tool_use
        parser = use.parser() if use else None
        echo = self.job.echo or ""
        if parser is None:
            return {"message": AssistantMessage(content=echo + text), "finish_reason": reason}
        content, calls = parser.feed(text)
        rest, more = parser.close()
        content, calls = echo + content + rest, calls + more
        message = AssistantMessage(content=content or (None if calls else ""),
                                   tool_calls=[tool_call(call) for call in calls] or None)
        return {"message": message, "finish_reason": _with_calls(reason, parser, use)}

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
            delta = DeltaToolCall(index=number, **tool_call(call).model_dump())
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
    """``text_completion`` shapes (the same object streams, chunk by chunk).

    ``batch``: a batch prompt's jobs, in order (``job`` is the first), whose prompt ``p``
    owns choices ``p * n`` to ``p * n + n - 1``; by default ``job`` alone.
    """

    def __init__(self, job: Job, token_strings: TokenStringsFn,
                 batch: list[Job] | None = None):
        self.job = job
        self.token_strings = _named(job, token_strings)
        self._jobs = batch or [job]
        self._offsets: dict[int, int] = {}  # per choice: text offset of its next token
        self._echoed: set[int] = set()  # choices whose prompt went out
        self._opened: set[int] = set()  # choices with a text event sent

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None,
               ) -> CompletionResponse:
        job = self.job
        return CompletionResponse(id=job.response_id, created=job.created,
                                  model=job.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        """Text completions open with text directly."""
        return []

    def text(self, chunk: GenerationChunk) -> list[BaseModel]:
        """A text chunk; with echo, the choice's first one begins with the prompt (and its
        tokens' logprobs), as vLLM streams it."""
        return self._text(chunk.index, chunk.text, chunk.logprobs, chunk.prompt_logprobs,
                          chunk.token_ids)

    def finish(self, index: int, reason: str, stop_reason: int | str | None,
               ) -> list[BaseModel]:
        """An empty text chunk with the finish reason; first the echo and the prompt's token
        ids, where no event of the choice carried them yet (its only token was the
        end-of-sequence)."""
        first = self._text(index, "", None, None, [])
        return first + [self._chunk([CompletionChoice(index=index, text="",
                                                      finish_reason=reason,
                                                      stop_reason=stop_reason)])]

    def _text(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
              prompt_logprobs: list[TokenLogprob | None] | None,
              token_ids: list[int]) -> list[BaseModel]:
        """The text event of choice ``index``, if it has anything to carry: the choice's
        first carries the echo and the prompt's token ids (when asked)."""
        echo, prompt = self._echo(index, prompt_logprobs)
        prompt_ids = None if index in self._opened else _prompt_ids(self._prompt_job(index))
        ids = _output_ids(self.job, token_ids)
        if not (echo or text or logprobs or ids or prompt_ids):
            return []
        self._opened.add(index)
        return [self._chunk([CompletionChoice(
            index=index, text=echo + text, logprobs=self._logprobs(index, logprobs, prompt),
            prompt_token_ids=prompt_ids, token_ids=ids)])]

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: Tally) -> BaseModel:
        """The ``text_completion`` object."""
        choices = [self._choice(index, c) for index, c in tally.ordered()]
        return self._chunk(choices, tally.usage())

    def _choice(self, index: int, choice: ChoiceTally) -> CompletionChoice:
        """One whole choice: the echo and the text, their logprobs, and vLLM's
        ``prompt_logprobs`` when asked."""
        echo, prompt = self._echo(index, choice.prompt_logprobs)
        job = self._prompt_job(index)
        return CompletionChoice(
            index=index, text=echo + "".join(choice.text),
            logprobs=self._logprobs(index, choice.logprobs, prompt),
            finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
            prompt_logprobs=vllm_prompt_logprobs(job, choice.prompt_logprobs,
                                                 self.token_strings),
            prompt_token_ids=_prompt_ids(job), token_ids=_output_ids(job, choice.token_ids))

    def _prompt_job(self, index: int) -> Job:
        """The job of the prompt choice ``index`` answers (a batch's prompt ``index // n``)."""
        return self._jobs[index // self.job.request.sampling.n]

    def _echo_pending(self, index: int) -> str | None:
        """The prompt text choice ``index`` has yet to echo; None without echo or once sent."""
        return None if index in self._echoed else self._prompt_job(index).echo

    def _echo(self, index: int, prompt_logprobs: list[TokenLogprob | None] | None,
              ) -> tuple[str, PromptTokens]:
        """What goes before choice ``index``'s first text: with echo, the prompt's text and,
        with logprobs, its tokens and their logprobs; nothing otherwise, or once sent.

        Raises:
            APIError: 500 when logprobs are asked and the worker's prompt logprobs are not
                one per prompt token.
        """
        echo = self._echo_pending(index)
        if echo is None:
            return "", ()
        self._echoed.add(index)
        job = self._prompt_job(index)
        count = job.request.sampling.logprobs
        if count is None:
            return echo, ()
        # The worker computed alternatives for the larger of ``logprobs`` and
        # ``prompt_logprobs``: the echo lists as many as the output tokens have.
        entries = [None if entry is None else replace(entry, top=entry.top[:count])
                   for entry in prompt_entries(job, prompt_logprobs)]
        return echo, list(zip(job.request.token_ids, entries, strict=True))

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None,
                  prompt: PromptTokens = ()) -> CompletionLogprobs | None:
        """The legacy parallel-list shape of the echoed ``prompt``'s tokens, then the
        output's ``entries``; ``text_offset`` goes on from the choice's earlier tokens."""
        if self.job.request.sampling.logprobs is None:
            return None
        result = CompletionLogprobs()
        for token_id, entry in [*prompt, *((e.token_id, e) for e in entries or ())]:
            self._add_token(result, index, token_id, entry)
        return result

    def _add_token(self, result: CompletionLogprobs, index: int, token_id: int,
                   entry: TokenLogprob | None) -> None:
        """Appends one token of choice ``index``, of the prompt or the output alike, to
        ``result``: its text, its offset in the choice's text (in characters: the texts of
        the tokens before it), its logprob and a ``top_logprobs`` dict of its alternatives
        and itself (as vLLM's hold it); the last two null for a prompt's first token, which
        nothing predicts."""
        text = self.token_strings(token_id)[0]
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        result.tokens.append(text)
        result.text_offset.append(offset)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            return
        top = {self.token_strings(i)[0]: lp for i, lp in entry.top}
        top.setdefault(text, entry.logprob)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(top)


def _named(job: Job, token_strings: TokenStringsFn) -> TokenStringsFn:
    """How ``job``'s logprobs name tokens: by their text, or ``token_id:<id>`` when asked."""
    return as_token_ids(token_strings) if job.tokens_as_ids else token_strings


def _prompt_ids(job: Job) -> list[int] | None:
    """``job``'s prompt ids for vLLM's ``prompt_token_ids``; None unless asked."""
    return list(job.request.token_ids) if job.return_token_ids else None


def _output_ids(job: Job, token_ids: list[int]) -> list[int] | None:
    """Output ids for vLLM's ``token_ids``; None unless asked."""
    return list(token_ids) if job.return_token_ids else None


def prompt_entries(job: Job, entries: list[TokenLogprob | None] | None,
                   ) -> list[TokenLogprob | None]:
    """The worker's prompt logprobs for ``job``'s prompt, checked to hold one entry per
    prompt token.

    Raises:
        APIError: 500 otherwise: the worker was asked for them, and an answer without them
            would silently misalign the tokens and their logprobs.
    """
    expected = len(job.request.token_ids)
    if entries is None or len(entries) != expected:
        got = "no" if entries is None else str(len(entries))
        logger.error("request %s: the worker returned %s prompt logprobs for %d prompt tokens",
                     job.request.request_id, got, expected)
        raise APIError(500, f"the worker returned {got} prompt logprobs for a prompt of "
                       f"{expected} tokens", code="internal_error")
    return entries


def vllm_prompt_logprobs(job: Job, entries: list[TokenLogprob | None] | None,
                         token_strings: TokenStringsFn) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of ``job``'s prompt: null for the first token; for each
    other, the token itself with its rank, then the ``job.prompt_logprobs`` most likely
    tokens ranked by their place, keyed by token id. None when the request did not ask.

    Raises:
        APIError: as :func:`prompt_entries`.
    """
    count = job.prompt_logprobs
    if count is None:
        return None
    return [None if entry is None else _ranked(entry, count, token_strings)
            for entry in prompt_entries(job, entries)]


def _ranked(entry: TokenLogprob, count: int, token_strings: TokenStringsFn,
            ) -> dict[str, PromptLogprob]:
    """One prompt position of vLLM's ``prompt_logprobs``: the prompt token first, then its
    ``count`` most likely alternatives (``entry.top`` may hold more, asked for an echo's
    logprobs); the prompt token keeps its own rank where it is among them."""
    top = entry.top[:count]
    # Ranked as the worker ranks the prompt token: 1 + the tokens more likely, so tokens of
    # equal logprob share a rank (every token more likely than one of the top is in the top).
    ranked = [(entry.token_id, entry.logprob, entry.rank),
              *((token_id, logprob, 1 + sum(other > logprob for _, other in top))
                for token_id, logprob in top)]
    result: dict[str, PromptLogprob] = {}
    for token_id, logprob, rank in ranked:
        result.setdefault(str(token_id), PromptLogprob(
            logprob=logprob, rank=rank, decoded_token=token_strings(token_id)[0]))
    return result


def tool_call(call: ParsedCall) -> ToolCall:
    """A parsed call as OpenAI returns it: a fresh id, the arguments as JSON text."""
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=call.name, arguments=json.dumps(
                        call.arguments, ensure_ascii=False)))


def _with_calls(reason: str, parser: CallParser, use: ToolUse) -> str:
    """``stop`` becomes ``tool_calls`` when the choice made calls (OpenAI's meaning), except
    for a function forced by name, which OpenAI and vLLM finish with ``stop``; a ``length``
    stays: the answer was cut, whatever it held."""
    called = reason == "stop" and parser.calls_made and use.choice != "named"
    return "tool_calls" if called else reason
