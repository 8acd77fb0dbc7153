"""Noticing a client that went away, and closing the backend's stream when it does.

Closing the backend's generator is how a worker learns to cancel a request and free its KV
blocks, so every path out of a request (answer, error, disconnect, cancellation) closes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import suppress
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


async def close_stream(chunks: AsyncIterator[Any]) -> None:
    """Closes an async generator even while our task is being cancelled (the cancellation is
    raised once it is closed): closing is what tells the worker to stop and free the request's
    blocks."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    closing = asyncio.ensure_future(aclose())
    try:
        await _settled(closing)
    finally:
        if not closing.cancelled() and closing.exception() is not None:
            logger.warning("closing a response stream failed", exc_info=closing.exception())


async def _wait_for_disconnect(receive: Receive) -> None:
    """Returns when the ASGI server reports that the client went away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[_T]) -> _T:
    """Awaits ``work``, unless the client disconnects first: then ``work`` is cancelled and
    :class:`ClientDisconnected` raised.

    Plain ASGI endpoints never hear of a disconnect, so a request waiting in a queue or
    generating a long non-streaming answer would keep its worker busy for nobody.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        work_task.cancel()
        # Let both cancellations land: the caller closes the backend's generator next, which
        # fails while ``work_task`` is still inside it.
        await _settled(work_task, watch_task)
    if not watch_task.cancelled():
        watch_task.exception()  # retrieved so asyncio does not warn about it
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


async def _settled(*tasks: asyncio.Future) -> None:
    """Waits until ``tasks`` are done, even when this task is cancelled meanwhile, and then
    raises that cancellation: a request's task is cancelled when its client goes away (Serve
    calls ``Task.cancel``, which an anyio shield does not hold off), and work left unwinding
    would still be inside the generator that is closed next, or a close cut short would not
    reach the worker."""
    cancelled = False
    while True:
        try:
            await asyncio.wait(tasks)
            break
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that stops on client disconnect and always closes its iterator.

    Starlette's own leaves the body iterator suspended when the client goes away and, under
    ASGI 2.4, notices a disconnect only at its next send, so a request waiting for its next
    token would hold its worker's blocks. Closing the iterator runs its ``finally``, which
    closes the backend's generator.
    """

    def __init__(self, events: AsyncIterator[str], backend_chunks: AsyncIterator[Any],
                 headers: dict[str, str]):
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self.backend_chunks = backend_chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self._stream(send))
        except ClientDisconnected:
            logger.info("streaming client disconnected; request cancelled")
        finally:
            await close_stream(self.body_iterator)
            # Also closed directly: an event generator cancelled before its first step never
            # runs its ``finally``.
            await close_stream(self.backend_chunks)

    async def _stream(self, send: Send) -> None:
        # An OSError from send is an ASGI 2.4 server saying the client is gone.
        with suppress(OSError):
            await self.stream_response(send)
