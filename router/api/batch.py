"""A batch prompt streamed: its prompts' chunk streams merged into one, as vLLM streams a list
``prompt`` on ``/v1/completions``.

Each prompt is a request of its own, with ``n`` choices. In the merged stream, prompt ``p``'s
choice ``i`` is choice ``p * n + i``, chunks come in the order they arrive from the workers,
and a chunk's ``choices_left`` counts the other prompts' choices too, so only the batch's very
last chunk ends the stream. The usage counts every prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from contract.request import GenerationChunk
from router.api.disconnect import close_stream
from router.api.stream import next_chunk
from router.api.usage import Tally
from router.protocol import Usage

AHEAD_PER_PROMPT = 4
"""Chunks each prompt's stream may be read ahead of the merged stream's reader."""


class MergedChunks:
    """The chunk streams of a batch's prompts as one stream (an async iterator).

    Args:
        firsts: each prompt's first chunk, already read from its stream.
        streams: each prompt's stream, after its first chunk.
        n: choices per prompt.

    A stream that fails raises its error here (the others are then closed by :meth:`aclose`,
    which every owner must call, whether or not it iterated: closing is what frees the
    prompts' KV blocks). A stream that ends before its last chunk raises APIError 500.
    """

    def __init__(self, firsts: list[GenerationChunk],
                 streams: list[AsyncIterator[GenerationChunk]], n: int):
        self._streams = streams
        self._n = n
        self._unfinished = len(streams)
        # Bounded: a client that reads slowly holds the prompts' streams back, as it holds one
        # request's, rather than have every chunk of a large batch wait here in memory.
        self._arrivals: asyncio.Queue[tuple[int, GenerationChunk | BaseException]] = (
            asyncio.Queue(maxsize=AHEAD_PER_PROMPT * len(streams)))
        self._readers = [asyncio.create_task(self._read(p, first, stream))
                         for p, (first, stream) in enumerate(zip(firsts, streams, strict=True))]

    async def _read(self, p: int, first: GenerationChunk,
                    stream: AsyncIterator[GenerationChunk]) -> None:
        chunk = first
        try:
            while True:
                await self._arrivals.put((p, chunk))
                if chunk.is_last:
                    return
                chunk = await next_chunk(stream)
        except Exception as exc:  # handed to __anext__, which raises it to our reader
            await self._arrivals.put((p, exc))

    def __aiter__(self) -> MergedChunks:
        return self

    async def __anext__(self) -> GenerationChunk:
        if not self._unfinished:
            raise StopAsyncIteration
        p, arrival = await self._arrivals.get()
        if isinstance(arrival, BaseException):
            raise arrival
        done = arrival.is_last
        if done:
            self._unfinished -= 1
        others = self._unfinished - (0 if done else 1)  # the other prompts still running
        return replace(arrival, index=p * self._n + arrival.index,
                       choices_left=arrival.choices_left + self._n * others)

    async def aclose(self) -> None:
        """Stops reading and closes every prompt's stream (safe to call more than once)."""
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for stream in self._streams:
            await close_stream(stream)


class BatchTally:
    """What a batch prompt's requests have produced so far, as :class:`~router.api.usage.Tally`
    counts one request's: fed the merged stream's chunks (choice ``p * n + i``), it keeps one
    tally per prompt and reports their sum.

    Args:
        prompt_tokens: each prompt's length, in tokens.
        n: choices per prompt.
    """

    def __init__(self, prompt_tokens: list[int], n: int):
        self._tallies = [Tally(prompt_tokens=tokens) for tokens in prompt_tokens]
        self._n = n

    def _split(self, chunk: GenerationChunk) -> tuple[Tally, GenerationChunk]:
        p, i = divmod(chunk.index, self._n)
        return self._tallies[p], replace(chunk, index=i)

    def admit(self, chunk: GenerationChunk) -> None:
        """As :meth:`Tally.admit`, for the chunk's prompt."""
        tally, own = self._split(chunk)
        tally.admit(own)

    def add(self, chunk: GenerationChunk) -> None:
        """As :meth:`Tally.add`, for the chunk's prompt."""
        tally, own = self._split(chunk)
        tally.add(own)

    def merged(self) -> Tally:
        """The prompts' tallies as one (:meth:`Tally.merged`)."""
        return Tally.merged(self._tallies, self._n)

    def usage(self) -> Usage:
        """The batch's usage: every prompt's tokens and hits, and every choice's output."""
        return self.merged().usage()
