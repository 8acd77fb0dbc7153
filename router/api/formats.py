"""The OpenAI shapes of each endpoint's answers: ``chat.completion`` (and its chunks) and
``text_completion``."""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel

from contract.request import TokenLogprob
from router.api.jobs import Job
from router.api.token_strings import TokenStringsFn
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
    TopLogprob,
    Usage,
)


class Format(Protocol):
    """The OpenAI shapes of one endpoint's answers."""

    def opening(self) -> list[BaseModel]:
        """Events sent before any text."""
        ...

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """An event carrying new text (and its tokens' logprobs) of choice ``index``."""
        ...

    def finish(self, index: int, reason: str) -> BaseModel:
        """The event carrying the finish reason of choice ``index``."""
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

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
               ) -> ChatCompletionChunk:
        job = self.job
        return ChatCompletionChunk(id=job.response_id, created=job.created,
                                   model=job.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        """The first delta of each choice announces the assistant's turn."""
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                      content=""))])
                for i in range(self.job.request.sampling.n)]

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """A content delta."""
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text),
                                            logprobs=self._logprobs(logprobs))])

    def finish(self, index: int, reason: str) -> BaseModel:
        """An empty delta with the finish reason."""
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                            finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: Tally) -> BaseModel:
        """The ``chat.completion`` object."""
        job = self.job
        choices = [ChatChoice(index=index, message=AssistantMessage(content="".join(c.text)),
                              logprobs=self._logprobs(c.logprobs), finish_reason=c.finish_reason)
                   for index, c in tally.ordered()]
        return ChatCompletionResponse(id=job.response_id, created=job.created,
                                      model=job.model, choices=choices, usage=tally.usage())

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

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        """A text chunk."""
        return self._chunk([CompletionChoice(index=index, text=text,
                                             logprobs=self._logprobs(index, logprobs))])

    def finish(self, index: int, reason: str) -> BaseModel:
        """An empty text chunk with the finish reason."""
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        """The usage-only chunk."""
        return self._chunk([], usage)

    def response(self, tally: Tally) -> BaseModel:
        """The ``text_completion`` object."""
        choices = [CompletionChoice(index=index, text="".join(c.text),
                                    logprobs=self._logprobs(index, c.logprobs),
                                    finish_reason=c.finish_reason)
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
