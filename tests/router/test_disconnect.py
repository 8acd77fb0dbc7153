"""Closing a request's streams when its client goes away, while Serve cancels the request's
task: the work and the close must both finish, or a generator is closed while still running
(a fresh user's break test saw ``aclose(): asynchronous generator is already running`` logged
when clients dropped streamed batch completions) or a close never reaches the worker."""

from __future__ import annotations

import asyncio

import pytest

from router.api.disconnect import close_stream, unless_disconnected


async def test_the_work_unwinds_before_a_cancelled_caller_goes_on():
    release, unwound = asyncio.Event(), []

    async def slow_to_cancel():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await release.wait()  # e.g. a stream mid-send
            unwound.append(True)
            raise

    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    caller = asyncio.create_task(unless_disconnected(receive, slow_to_cancel()))
    await asyncio.sleep(0.01)
    gone.set()  # the client goes away: the work is cancelled
    await asyncio.sleep(0.01)
    caller.cancel()  # and Serve cancels the request's task meanwhile
    await asyncio.sleep(0.01)
    assert not caller.done()  # still waiting for the work to unwind
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert unwound == [True]


async def test_a_close_finishes_when_its_caller_is_cancelled():
    release, closed = asyncio.Event(), []

    async def stream():
        try:
            yield 1
            yield 2
        finally:
            await release.wait()  # e.g. telling the worker to cancel
            closed.append(True)

    chunks = stream()
    assert await anext(chunks) == 1
    closer = asyncio.create_task(close_stream(chunks))
    await asyncio.sleep(0.01)
    closer.cancel()
    await asyncio.sleep(0.01)
    assert not closer.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await closer
    assert closed == [True]
