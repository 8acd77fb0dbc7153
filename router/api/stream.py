"""Reading the worker's chunk stream: into SSE events (``stream: true``) or into one tally
(a JSON answer).

A streaming answer always ends with ``data: [DONE]``; a failure after the headers went out
becomes an ``{"error": ...}`` event before it, so a client never hangs on a dead stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pydantic import BaseModel

from contract.request import GenerationChunk
from router.api.disconnect import close_stream
from router.api.formats import Format
from router.api.jobs import Job
from router.api.usage import Tally
from router.errors import APIError, from_backend_exception, retry_after_headers

if TYPE_CHECKING:
    from router.api.batch import BatchTally

DONE_EVENT = "data: [DONE]\n\n"


async def next_chunk(chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    """The backend's next chunk; a stream that ends before a finish reason is a server error."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        raise APIError(500, "the worker's stream ended before the request finished",
                       code="internal_error") from None


def finish_reason(reason: str | None) -> str:
    """The OpenAI ``finish_reason`` of the worker's last chunk.

    ``abort`` means the worker gave the request up (drain, shutdown, preemption limit) without
    the client asking: that is not an answer, so it is a retryable 503 (or, mid-stream, an
    error event), never a truncated text passed off as finished.
    """
    if reason in ("stop", "length"):
        return reason
    raise APIError(503, "the request was aborted by the server before it finished; retry",
                   code="request_aborted", headers=retry_after_headers(1.0))


async def collect(job: Job, first: GenerationChunk, chunks: AsyncIterator[GenerationChunk],
                  tally: Tally | BatchTally | None = None) -> Tally | BatchTally:
    """Reads the backend's stream to its end (non-streaming answers) into ``tally`` (by
    default a new one for ``job``'s request), which it returns."""
    if tally is None:
        tally = Tally(prompt_tokens=len(job.request.token_ids))
    chunk = first
    while True:
        tally.add(chunk)
        if chunk.finish_reason is not None:
            finish_reason(chunk.finish_reason)
            if chunk.is_last:
                return tally
        chunk = await next_chunk(chunks)


async def sse_events(job: Job, fmt: Format, first: GenerationChunk,
                     chunks: AsyncIterator[GenerationChunk],
                     tally: Tally | BatchTally | None = None) -> AsyncIterator[str]:
    """The SSE events of a streaming answer; always ends with ``data: [DONE]``.

    With ``job.continuous_usage`` every event carries the usage so far: the prompt and its
    cached tokens from the first event on (0 completion tokens on the role events), and the
    output tokens of all choices streamed up to and including that event. ``tally`` counts
    the usage (by default, of ``job``'s request alone; a batch prompt's counts all of its).
    """
    if tally is None:
        tally = Tally(prompt_tokens=len(job.request.token_ids))
    tally.admit(first)

    def sse(event: BaseModel) -> str:
        if job.continuous_usage:
            event = event.model_copy(update={"usage": tally.usage()})
        return _sse(event, job.include_usage)

    try:
        for event in fmt.opening():
            yield sse(event)
        chunk = first
        while True:
            tally.add(chunk)
            if chunk.text or chunk.token_ids or chunk.logprobs or chunk.prompt_logprobs:
                for event in fmt.text(chunk):
                    yield sse(event)
            if chunk.finish_reason is not None:
                reason = finish_reason(chunk.finish_reason)
                for event in fmt.finish(chunk.index, reason, chunk.stop_reason):
                    yield sse(event)
                if chunk.is_last:
                    break
            chunk = await next_chunk(chunks)
        if job.include_usage:
            yield _sse(fmt.usage(tally.usage()), True)
    except Exception as exc:
        error = from_backend_exception(exc, job.request.request_id)
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        await close_stream(chunks)
    yield DONE_EVENT


def _sse(event: BaseModel, include_usage: bool) -> str:
    """One SSE event; ``usage`` appears (as null until the last event, unless continuous)
    only when asked for."""
    exclude = None if include_usage else {"usage"}
    return f"data: {event.model_dump_json(exclude=exclude, serialize_as_any=True)}\n\n"
