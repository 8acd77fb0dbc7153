"""Streams an :class:`~workers.engine.LLMEngine` to asyncio callers.

The engine's step loop runs in its own thread (torch releases the GIL in its kernels), so the
replica's event loop stays free to accept requests, stream tokens and answer routing-stats
calls while a forward pass runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from workers.engine import LLMEngine
from workers.kv_events import KVEvent
from workers.request import GenerationChunk, GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Runs the engine loop in a background thread.

    Args:
        engine: the engine to drive; only this class's thread touches it after construction.
        on_events: called from the engine thread with each step's KV events (must not block).
    """

    def __init__(self, engine: LLMEngine,
                 on_events: Callable[[list[KVEvent]], None] | None = None):
        self.engine = engine
        self._on_events = on_events
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Yield the request's chunks until it finishes; closing the iterator aborts it.

        Raises:
            InvalidRequestError: before the first chunk, if the request is invalid.
            RuntimeError: if the engine failed while serving it.
        """
        if self._stopped.is_set():
            raise RuntimeError("the engine is shut down")
        self.engine.validate(request)  # reads only immutable limits: safe off-thread
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", request, stream))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    # Refused or failed: nothing of this request runs in the engine, so never
                    # abort its id (another request may hold it: a refused duplicate id).
                    finished = True
                    raise item
                finished = item.is_last
                yield item
        finally:
            if not finished:
                self._inbox.put(("abort", request.request_id, None))

    def shutdown(self) -> None:
        """Stop the loop thread (pending requests get an error)."""
        self._stopped.set()
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain_inbox(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                chunks = self.engine.step()
            except Exception as exc:  # keep serving others: fail only what was running
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            # Events are queued for publishing before the chunks are delivered, so a flush
            # requested after a request finished covers its blocks.
            self._publish(self.engine.drain_events())
            for chunk in chunks:
                self._deliver(chunk)
        self._fail_all(RuntimeError("engine shut down"))

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                self._apply(*command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _apply(self, kind: str, payload, stream: _Stream | None) -> None:
        if kind == "add":
            try:
                self.engine.add_request(payload)
                self._streams[payload.request_id] = stream
            except Exception as exc:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
        elif kind == "abort":
            self.engine.abort(payload)
            self._streams.pop(payload, None)
            self._publish(self.engine.drain_events())

    def _deliver(self, chunk: GenerationChunk) -> None:
        stream = self._streams.get(chunk.request_id)
        if stream is None:
            return
        if chunk.is_last:
            del self._streams[chunk.request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, chunk)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(
                stream.queue.put_nowait, RuntimeError(f"engine failed: {exc}"))
        self._streams.clear()

    def _publish(self, events: list[KVEvent]) -> None:
        if events and self._on_events is not None:
            try:
                self._on_events(events)
            except Exception:
                log.exception("publishing KV events failed")
